"""Tiny random Qwen2 / Llama checkpoints with a real tokenizer, built offline in seconds.

Used by the tests, the benchmarks and `omnistage demo`."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from omnistage.testing.tokenizer import CHATML_TEMPLATE, train_bpe

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _tokenizer(vocab_size: int):
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_object=train_bpe(vocab_size, SPECIALS),
                                  eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  bos_token=None, unk_token=None)
    tok.chat_template = CHATML_TEMPLATE
    return tok


def scale_weights_(model: torch.nn.Module, std: float = 0.1) -> None:
    """Larger random weights keep greedy argmax away from near-ties (norm weights untouched)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std)
            elif name.endswith("bias"):
                p.normal_(0.0, std)


def build_tiny_lm(out_dir: str | Path, arch: str = "qwen2", *, hidden_size: int = 64,
                  num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                  intermediate_size: int = 128, vocab_size: int = 512,
                  tie_word_embeddings: bool = True, num_shards: int = 1, seed: int = 0,
                  dtype: torch.dtype = torch.float32) -> Path:
    """Build (or reuse) a tiny random causal LM checkpoint. arch: 'qwen2' | 'llama'."""
    from transformers import (GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM)
    out = Path(out_dir)
    spec = dict(arch=arch, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                num_kv_heads=num_kv_heads, intermediate_size=intermediate_size,
                vocab_size=vocab_size, tie=tie_word_embeddings, shards=num_shards, seed=seed,
                dtype=str(dtype))
    stamp = out / "omnistage_tiny.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == spec:
        return out
    tok = _tokenizer(vocab_size)
    eos = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    common = dict(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=intermediate_size,
                  num_hidden_layers=num_layers, num_attention_heads=num_heads,
                  num_key_value_heads=num_kv_heads, max_position_embeddings=4096,
                  tie_word_embeddings=tie_word_embeddings, eos_token_id=eos[0],
                  pad_token_id=eos[1], bos_token_id=eos[1])
    if arch == "qwen2":
        config, cls = Qwen2Config(rope_theta=1e6, **common), Qwen2ForCausalLM
    elif arch == "llama":
        config, cls = LlamaConfig(rope_theta=1e4, **common), LlamaForCausalLM
    else:
        raise ValueError(f"arch: {arch!r} (expected 'qwen2' or 'llama')")
    torch.manual_seed(seed)
    model = cls(config).eval()
    scale_weights_(model)
    model.to(dtype)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=eos[1],
                                               bos_token_id=eos[1])
    out.mkdir(parents=True, exist_ok=True)
    shard = None
    if num_shards > 1:
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        shard = f"{max(1, nbytes // num_shards // 1000 + 1)}KB"
    model.save_pretrained(out, **({"max_shard_size": shard} if shard else {}))
    tok.save_pretrained(out)
    stamp.write_text(json.dumps(spec))
    return out
