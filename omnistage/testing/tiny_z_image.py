"""Tiny random Z-Image checkpoint (diffusers' `ZImagePipeline` layout), built offline in seconds.

Layout, as the released `Tongyi-MAI/Z-Image-Turbo`:
- model_index.json: ZImagePipeline with FlowMatchEulerDiscreteScheduler, `Qwen3Model`
  (transformers), `Qwen2Tokenizer`, ZImageTransformer2DModel, AutoencoderKL;
- scheduler/scheduler_config.json: the released keys only (num_train_timesteps 1000,
  use_dynamic_shifting false, shift 3.0): static shift, so the pipeline's `mu` is unused;
- text_encoder/: config.json + model.safetensors of a tiny Qwen3 saved as `Qwen3ForCausalLM`
  with tied embeddings (names `model.*`, no lm_head, as the released Qwen3-4B files);
  `Qwen3Model.from_pretrained` loads it;
- tokenizer/: byte-level BPE with `<|endoftext|>` (pad), `<|im_start|>`, `<|im_end|>` (eos) as
  single special tokens, `<think>` / `</think>` as added tokens, and a Qwen3 chat template
  (`QWEN3_CHAT_TEMPLATE`);
- transformer/, vae/: config.json + diffusion_pytorch_model.safetensors written by diffusers.
Sizes: text encoder hidden 32 (= the DiT's cap_feat_dim), 2 layers (the pipeline reads
hidden_states[-2], the first layer's output); DiT dim 64, 4 heads (head_dim 16, rope axes
[4, 6, 6], released axes_lens), 2 main layers, 1 noise + 1 context refiner; VAE 16 latent
channels, widths [16, 32, 32, 32] (8x upscale), one resnet per encoder block, the released
scaling (0.3611) and shift (0.1159) factors, no quant convs (as released).

diffusers' default init gives a near-flat image that hardly depends on the prompt; the weights
are re-initialised (see `reinit_*_`) so that images are textured and prompt-dependent.
Building needs diffusers (a test dependency).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from omnistage.checkpoint import quiet_transformers
from omnistage.testing.tiny_omni import is_complete_build, staged_build
from omnistage.testing.tokenizer import train_bpe

BUILD_VERSION = 1
MARKER = "tiny_z_image_build.json"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
THINK_TOKENS = ["<think>", "</think>"]  # added, not special, as in Qwen3's tokenizer
BPE_VOCAB = 512
MODEL_MAX_LENGTH = 131072  # Qwen3's tokenizer_config
COMPONENTS = ("scheduler", "text_encoder", "tokenizer", "transformer", "vae")

# Qwen3's chat template for system / user / assistant turns with string content (no tools):
# no default system prompt; the generation prompt is `<|im_start|>assistant\n`, followed by an
# empty think block only when enable_thinking is passed as false.
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)

MODEL_INDEX = {
    "_class_name": "ZImagePipeline",
    "_diffusers_version": "0.36.0.dev0",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "Qwen3Model"],
    "tokenizer": ["transformers", "Qwen2Tokenizer"],
    "transformer": ["diffusers", "ZImageTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}
SCHEDULER_CONFIG = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "_diffusers_version": "0.36.0.dev0",
    "num_train_timesteps": 1000,
    "use_dynamic_shifting": False,
    "shift": 3.0,
}
TEXT_HIDDEN = 32
TRANSFORMER_CONFIG: dict[str, Any] = {
    "all_patch_size": [2], "all_f_patch_size": [1], "in_channels": 16, "dim": 64,
    "n_layers": 2, "n_refiner_layers": 1, "n_heads": 4, "n_kv_heads": 4, "norm_eps": 1e-5,
    "qk_norm": True, "cap_feat_dim": TEXT_HIDDEN, "rope_theta": 256.0, "t_scale": 1000.0,
    "axes_dims": [4, 6, 6], "axes_lens": [1536, 512, 512],
}
VAE_CONFIG: dict[str, Any] = {
    "in_channels": 3, "out_channels": 3, "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4, "block_out_channels": [16, 32, 32, 32],
    "layers_per_block": 1, "act_fn": "silu", "latent_channels": 16, "norm_num_groups": 8,
    "sample_size": 1024, "scaling_factor": 0.3611, "shift_factor": 0.1159,
    "force_upcast": True, "use_quant_conv": False, "use_post_quant_conv": False,
    "mid_block_add_attention": True,
}


def build_tiny_z_image_tokenizer():
    """Qwen2Tokenizer (byte-level BPE, Qwen2 pre-tokenizer) with Qwen3's special tokens and
    chat template; pads on the right with `<|endoftext|>`."""
    from transformers import Qwen2Tokenizer
    tok = Qwen2Tokenizer(tokenizer_object=train_bpe(BPE_VOCAB, SPECIALS), eos_token="<|im_end|>",
                         pad_token="<|endoftext|>", unk_token=None,
                         model_max_length=MODEL_MAX_LENGTH)
    tok.add_tokens(THINK_TOKENS)
    tok.chat_template = QWEN3_CHAT_TEMPLATE
    return tok


def _text_encoder(tok, seed: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    ids = tok.convert_tokens_to_ids
    cfg = Qwen3Config(
        vocab_size=len(tok), hidden_size=TEXT_HIDDEN, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
        rope_theta=1e6, max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=ids("<|endoftext|>"), eos_token_id=ids("<|im_end|>"),
        pad_token_id=ids("<|endoftext|>"))
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(cfg).eval()
    reinit_text_encoder_(model)
    return model


def reinit_text_encoder_(model: torch.nn.Module) -> None:
    """Sharpened: token embeddings N(0, 1) and matrices N(0, 1 / sqrt(fan_in)) (std 0.02 makes
    every prompt's hidden states nearly the same); norm weights keep their ones."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("embed_tokens.weight"):
                p.normal_(0.0, 1.0)
            elif p.dim() == 2:
                p.normal_(0.0, p.shape[1] ** -0.5)


def reinit_transformer_(model: torch.nn.Module) -> None:
    """Linear weights N(0, 1.5 / sqrt(fan_in)), biases N(0, 0.1); the pad tokens (zeros in
    diffusers' init) N(0, 1); norm scales N(1, 0.1) so that a skipped norm shows, except the
    q/k norms: N(3, 0.3). NOTE: q and k leave their norms at unit RMS, so with scales of 1 the
    attention logits are ~N(0, 1) and attention is near uniform: the image tokens average the
    caption away ("a photo of a dog" and "... a cat" gave images 1.8 / 255 apart); scales of 3
    make attention peaked (15 / 255 apart)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("pad_token"):
                p.normal_(0.0, 1.0)
            elif p.dim() == 2:
                p.normal_(0.0, 1.5 * p.shape[1] ** -0.5)
            elif ".norm_q." in name or ".norm_k." in name:
                p.normal_(3.0, 0.3)
            elif "norm" in name:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.1)


def reinit_vae_decoder_(vae: torch.nn.Module) -> None:
    """NOTE: PyTorch's default conv init shrinks the signal at every conv (std ~ 1 / sqrt(3
    fan_in)), so the decoded image is the biases' near-constant. Here the decoder's convs and
    attention projections are N(0, 1.2 / sqrt(fan_in)) with biases N(0, 0.02), GroupNorm
    affines stay (1, 0), and conv_out is N(0, 0.6 / sqrt(fan_in)) so that most pixels stay inside
    [-1, 1]. The encoder keeps diffusers' init (the pipeline never runs it)."""
    with torch.no_grad():
        for name, p in vae.decoder.named_parameters():
            if "norm" in name:
                continue
            if p.dim() >= 2:
                gain = 0.6 if name.startswith("conv_out") else 1.2
                p.normal_(0.0, gain * p[0].numel() ** -0.5)
            else:
                p.normal_(0.0, 0.02)


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def build_tiny_z_image(path: str | Path, seed: int = 0) -> Path:
    """Build (or reuse) a tiny random Z-Image checkpoint at `path`; returns the path.

    Deterministic for a seed (identical files); a complete build for the same seed is reused.
    Files are written to a temporary sibling directory first and moved in, the marker last.
    Another build at `path` is replaced (its component folders removed)."""
    from diffusers import AutoencoderKL, ZImageTransformer2DModel

    out = Path(path)
    args = {"version": BUILD_VERSION, "seed": seed}
    if is_complete_build(out, MARKER, args):
        return out
    # the caller's RNG state is left as it was
    with torch.random.fork_rng(devices=[]), staged_build(out, MARKER, args) as tmp:
        _write_json(tmp / "model_index.json", MODEL_INDEX)
        _write_json(tmp / "scheduler" / "scheduler_config.json", SCHEDULER_CONFIG)
        tok = build_tiny_z_image_tokenizer()
        with quiet_transformers():
            tok.save_pretrained(tmp / "tokenizer")
            _text_encoder(tok, seed).save_pretrained(tmp / "text_encoder")
        torch.manual_seed(seed + 1)
        transformer = ZImageTransformer2DModel(**TRANSFORMER_CONFIG).eval()
        reinit_transformer_(transformer)
        transformer.save_pretrained(tmp / "transformer")
        torch.manual_seed(seed + 2)
        vae = AutoencoderKL(**VAE_CONFIG).eval()
        reinit_vae_decoder_(vae)
        vae.save_pretrained(tmp / "vae")
        # staged_build moves entries with os.replace, which cannot replace a non-empty folder:
        # drop another build's component folders (marker first, so none reads a half build)
        (out / MARKER).unlink(missing_ok=True)
        for folder in COMPONENTS:
            if (out / folder).is_dir():
                shutil.rmtree(out / folder)
    return out
