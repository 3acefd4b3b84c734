"""Tiny random Qwen3-Omni-30B-A3B checkpoint in the released layout, built offline in ~1 s.

Layout (as the released `Qwen/Qwen3-Omni-30B-A3B-Instruct`): config.json (architectures
`Qwen3OmniMoeForConditionalGeneration`, thinker / talker / code2wav configs,
`enable_audio_output`), generation_config.json, sharded safetensors + index with `thinker.*`,
`talker.*`, `code2wav.*` prefixes and MoE experts stored per expert
(`...mlp.experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`), tokenizer files,
chat_template.json, and one root preprocessor_config.json (WhisperFeatureExtractor with 128 mel
bins and a 300 s window merged with Qwen2VLImageProcessor fields: patch 16, merge 2, mean/std
0.5). The released checkpoints have no processor_config.json or video_preprocessor_config.json:
transformers' video processor falls back to preprocessor_config.json.

`talker=False` builds the Thinking / Captioner layout: the same architecture name with
`enable_audio_output: false` and thinker weights only (config.json keeps the tiny talker and
code2wav configs so their ids stay consistent; nothing reads them while audio output is off).

Running transformers' `generate` on it (the reference for parity tests):
- pass `thinker_eos_token_id=TINY_QWEN3_OMNI_EOS` (transformers' default is 151645);
- `thinker_do_sample=False, talker_do_sample=False` for greedy text and codes;
- for prompts with audio, transformers' talker rope index reads `talker.config.audio_config`,
  which the talker config lacks: run `enable_talker_audio_prompts(model)` once after loading
  (it sets `model.talker.config.audio_config = model.thinker.config.audio_config`);
- the processor's video processor needs torchvision, which does not import beside torch 2.13
  CPU: `build_tiny_qwen3_omni_processor` supplies one built from transformers' image processor.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoTokenizer,
    PreTrainedTokenizerBase,
    Qwen2Tokenizer,
    Qwen3OmniMoeConfig,
    Qwen3OmniMoeForConditionalGeneration,
    Qwen3OmniMoeProcessor,
    WhisperFeatureExtractor,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from omnistage.checkpoint import quiet_transformers
from omnistage.testing.tiny_omni import is_complete_build, staged_build
from omnistage.testing.tokenizer import train_bpe
from omnistage.testing.video_stub import AcceptsVideoProcessorStub, FrameVideoProcessor

BUILD_VERSION = 1
MARKER = "tiny_qwen3_omni_build.json"

# Special tokens take ids 0..15, in this order (the released tokenizer has them at 151643+).
TINY_QWEN3_OMNI_SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|image_pad|>", "<|video_pad|>", "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>",
    "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>", "<tts_text_bos_single>", "<think>",
    "</think>",
]
# The talker finds user / assistant turns by the single token after <|im_start|>; the tiny BPE
# splits these words, so they are added as (non-special) whole tokens, after the BPE vocab.
ROLE_TOKENS = ["system", "user", "assistant"]
TINY_QWEN3_OMNI_IDS = {tok: i for i, tok in enumerate(TINY_QWEN3_OMNI_SPECIALS)}
TINY_QWEN3_OMNI_EOS = [TINY_QWEN3_OMNI_IDS["<|im_end|>"], TINY_QWEN3_OMNI_IDS["<|endoftext|>"]]
TINY_BPE_VOCAB = 1024
# The released codec ids (talker vocab 3072 = 2048 codes + 1024 specials, as in the release).
TINY_CODEC_IDS = {"codec_pad_id": 2148, "codec_bos_id": 2149, "codec_eos_token_id": 2150,
                  "codec_nothink_id": 2155, "codec_think_bos_id": 2156,
                  "codec_think_eos_id": 2157}
# transformers' generate looks the speaker up lower-cased: speaker="Ethan" -> "ethan".
TINY_SPEAKERS = {"chelsie": 2301, "ethan": 2302, "aiden": 2303}

# Qwen3-Omni's chat template structure: Qwen3 turns, no default system prompt, media parts as
# <|vision_start|><|image_pad|><|vision_end|>, <|audio_start|><|audio_pad|><|audio_end|>,
# <|vision_start|><|video_pad|><|vision_end|>; the generation prompt is 3 tokens
# (<|im_start|>assistant\n), which the talker's prompt layout relies on.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' or 'image' in part or 'image_url' in part -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'audio' or 'audio' in part or 'audio_url' in part -%}"
    "{{- '<|audio_start|><|audio_pad|><|audio_end|>' -}}"
    "{%- elif part['type'] == 'video' or 'video' in part -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif 'text' in part -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_EXTRA_TOKENS = {"image_token": "<|image_pad|>", "audio_token": "<|audio_pad|>",
                 "video_token": "<|video_pad|>", "vision_bos_token": "<|vision_start|>",
                 "vision_eos_token": "<|vision_end|>", "audio_bos_token": "<|audio_start|>",
                 "audio_eos_token": "<|audio_end|>"}
_CLIP_HALF = [0.5, 0.5, 0.5]  # the released image/video mean and std
_MIN_PIXELS, _MAX_PIXELS = 3136, 12845056  # released image processor bounds


def build_tiny_qwen3_omni_tokenizer() -> Qwen2Tokenizer:
    """Byte-level BPE (Qwen2 pre-tokenizer) with Qwen3-Omni's special and role tokens."""
    tok = Qwen2Tokenizer(tokenizer_object=train_bpe(TINY_BPE_VOCAB, TINY_QWEN3_OMNI_SPECIALS),
                         eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None,
                         extra_special_tokens=dict(_EXTRA_TOKENS))
    tok.add_tokens(ROLE_TOKENS)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def tiny_qwen3_omni_config_dict(tok: PreTrainedTokenizerBase, *, talker: bool = True,
                                **overrides: Any) -> dict[str, Any]:
    """Keyword arguments of `Qwen3OmniMoeConfig` for the tiny model; `overrides` are merged in
    recursively (e.g. `thinker_config={"text_config": {"num_hidden_layers": 4}}`).

    Constraints kept: special ids inside the small vocab; mrope_section sums to head_dim / 2
    (interleaved); thinker hidden = audio output_dim = vision out_hidden_size = talker
    thinker_hidden_size; 128 mel bins; talker vocab = codebook (2048) + 1024 specials, every
    codec special and speaker id in [vocab - 1024, vocab) (generate suppresses that range except
    eos); accept_hidden_layer an inner thinker layer; code2wav keeps the released codebook size,
    16 quantizers, upsampling (x1920 -> 24 kHz at 12.5 Hz) and sliding window."""
    i = tok.convert_tokens_to_ids
    hidden = 64
    ids = {"audio_token_id": i("<|audio_pad|>"), "image_token_id": i("<|image_pad|>"),
           "video_token_id": i("<|video_pad|>"), "audio_start_token_id": i("<|audio_start|>"),
           "audio_end_token_id": i("<|audio_end|>"), "vision_start_token_id": i("<|vision_start|>"),
           "vision_end_token_id": i("<|vision_end|>")}
    timing = {"position_id_per_seconds": 13, "seconds_per_chunk": 2}
    mrope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3],
             "interleaved": True, "mrope_interleaved": True}  # head_dim 16
    thinker = {
        "text_config": {
            "vocab_size": len(tok), "hidden_size": hidden, "intermediate_size": 128,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "moe_intermediate_size": 32, "num_experts": 8,
            "num_experts_per_tok": 2, "norm_topk_prob": True, "max_position_embeddings": 4096,
            "rope_parameters": mrope},
        # n_window as released (the AuT length rule depends on it); n_window_infer 200 (released
        # 800) so that a few seconds of audio already spans several attention windows
        "audio_config": {
            "d_model": 32, "encoder_layers": 2, "encoder_attention_heads": 4,
            "encoder_ffn_dim": 64, "num_mel_bins": 128, "output_dim": hidden, "n_window": 50,
            "n_window_infer": 200, "downsample_hidden_size": 16, "max_source_positions": 1500},
        "vision_config": {
            "depth": 3, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4,
            "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
            "out_hidden_size": hidden, "num_position_embeddings": 2304,
            "deepstack_visual_indexes": [1, 2]},
        "user_token_id": i("user"), **timing, **ids}
    talker_cfg = {
        "text_config": {
            "vocab_size": 3072, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
            "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True,
            "max_position_embeddings": 4096,
            "rope_parameters": {k: v for k, v in mrope.items() if k != "mrope_interleaved"}},
        "code_predictor_config": {
            "vocab_size": 2048, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 8, "num_code_groups": 16, "max_position_embeddings": 64,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
        "num_code_groups": 16, "thinker_hidden_size": hidden, "accept_hidden_layer": 2,
        "speaker_id": dict(TINY_SPEAKERS), "spatial_merge_size": 2,
        **TINY_CODEC_IDS, **timing, **ids}
    code2wav = {
        "codebook_size": 2048, "num_quantizers": 16, "hidden_size": 32,
        "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 64,
        "num_hidden_layers": 2, "sliding_window": 72, "upsample_rates": [8, 5, 4, 3],
        "upsampling_ratios": [2, 2], "decoder_dim": 64, "max_position_embeddings": 8000}
    cfg: dict[str, Any] = {
        "thinker_config": thinker, "talker_config": talker_cfg, "code2wav_config": code2wav,
        "enable_audio_output": talker, "im_start_token_id": i("<|im_start|>"),
        "im_end_token_id": i("<|im_end|>"), "tts_pad_token_id": i("<tts_pad>"),
        "tts_bos_token_id": i("<tts_text_bos>"), "tts_eos_token_id": i("<tts_text_eod>"),
        "system_token_id": i("system"), "user_token_id": i("user"),
        "assistant_token_id": i("assistant")}
    for key in overrides:
        if key not in cfg:
            raise ValueError(f"overrides: unknown config key {key!r} "
                             f"(expected one of {', '.join(sorted(cfg))})")
    return _merge(cfg, overrides)


def _feature_extractor() -> WhisperFeatureExtractor:
    # The released checkpoint pads audio to a 300 s window (n_samples 4800000), 128 mel bins.
    return WhisperFeatureExtractor(feature_size=128, chunk_length=300, return_attention_mask=True)


def _image_processor() -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                                    min_pixels=_MIN_PIXELS, max_pixels=_MAX_PIXELS,
                                    image_mean=_CLIP_HALF, image_std=_CLIP_HALF)


def _save_processor_files(out: Path, tok: Qwen2Tokenizer) -> None:
    tok.save_pretrained(out)
    # chat template in its own chat_template.json, as released (not in tokenizer_config.json)
    cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg.pop("chat_template", None)
    tok_cfg["processor_class"] = "Qwen3OmniMoeProcessor"
    cfg_path.write_text(json.dumps(tok_cfg, indent=2) + "\n")
    (out / "chat_template.jinja").unlink(missing_ok=True)
    (out / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}) + "\n")
    merged = {**_feature_extractor().to_dict(), **_image_processor().to_dict(),
              "min_pixels": _MIN_PIXELS, "max_pixels": _MAX_PIXELS,
              "feature_extractor_type": "WhisperFeatureExtractor",
              "image_processor_type": "Qwen2VLImageProcessor",
              "processor_class": "Qwen3OmniMoeProcessor"}
    (out / "preprocessor_config.json").write_text(json.dumps(merged, indent=2) + "\n")


def _normal_(module: torch.nn.Module, std: float) -> None:
    # every matrix (Linear, Embedding, fused expert tensors, routers); norms keep their ones
    for p in module.parameters():
        if p.dim() >= 2:
            p.normal_(0.0, std)


def _reinit_(model: Qwen3OmniMoeForConditionalGeneration) -> None:
    """Random LMs at std 0.02 sit near argmax ties; std 0.1 makes greedy decoding stable
    (thinker LM, talker LM + projections, code predictor); thinker token embeddings at std 1 so
    that greedy text does not settle into a loop of a few tokens. The audio / vision encoders
    keep transformers' init. transformers' code2wav init gives a near-silent waveform;
    PyTorch's default Linear/Conv init gives an RMS of ~0.1-0.3."""
    with torch.no_grad():
        # (transformers 5.24 nests the text model; 5.17, on the GPU machines, does not)
        text_model = getattr(model.thinker.model, "language_model", model.thinker.model)
        _normal_(text_model, 0.1)
        text_model.embed_tokens.weight.normal_(0.0, 1.0)
        _normal_(model.thinker.lm_head, 0.1)
        if getattr(model, "has_talker", False):
            _normal_(model.talker, 0.1)
            _reinit_code2wav_(model.code2wav)


def _code2wav_preclamp(code2wav: torch.nn.Module, codes: torch.Tensor) -> torch.Tensor:
    # code2wav's forward without the final clamp: codes [1, Q, F] -> waveform [1, 1, F * 1920]
    hidden = code2wav.code_embedding(codes + code2wav.code_offset).mean(1)
    x = code2wav.pre_transformer(inputs_embeds=hidden).last_hidden_state.permute(0, 2, 1)
    for blocks in code2wav.upsample:
        for block in blocks:
            x = block(x)
    for block in code2wav.decoder:
        x = block(x)
    return x


def _reinit_code2wav_(code2wav: torch.nn.Module, target_rms: float = 0.2) -> None:
    """NOTE: with transformers' init the waveform is near silent; with PyTorch's default
    Linear/Conv init alone its RMS is ~0.1 but the conv biases dominate: two unrelated code
    sequences give waveforms only 5% apart, so a wrong decoder would still compare equal. Here:
    default init with weights x1.3 (keeps the signal alive through ~20 convs) and biases x0.1,
    ConvNeXt gamma 0.3 and layer scales 0.1 (released init: 1e-6 / 0.01, which make those
    blocks near no-ops), code embeddings N(0, 1); then the last conv is scaled so that random
    codes give an RMS of `target_rms` (unrelated codes then differ by ~80%, no clipping)."""
    for m in code2wav.modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
            m.reset_parameters()
            m.weight.mul_(1.3)
            if m.bias is not None:
                m.bias.mul_(0.1)
    for name, p in code2wav.named_parameters():
        if name.endswith(".gamma"):
            p.fill_(0.3)
        elif name.endswith("_layer_scale.scale"):
            p.fill_(0.1)
    code2wav.code_embedding.weight.normal_(0.0, 1.0)
    cfg = code2wav.config
    probe = torch.randint(0, cfg.codebook_size, (1, cfg.num_quantizers, 16))
    rms = _code2wav_preclamp(code2wav, probe).pow(2).mean().sqrt()
    last = code2wav.decoder[-1].conv
    last.weight.mul_(target_rms / rms)
    last.bias.mul_(target_rms / rms)


def build_tiny_qwen3_omni(path: str | Path, *, talker: bool = True, seed: int = 0,
                          **overrides: Any) -> Path:
    """Build (or reuse) a tiny random Qwen3-Omni checkpoint at `path`; returns the path.

    Deterministic for given arguments; a complete build with the same arguments is reused.
    `overrides` are merged recursively into the config (see `tiny_qwen3_omni_config_dict`) and
    must be JSON-serialisable. Files are written to a temporary sibling directory first and moved
    in, the marker file last.
    """
    out = Path(path)
    args = {"version": BUILD_VERSION, "talker": talker, "seed": seed, "overrides": overrides}
    try:
        json.dumps(args)
    except TypeError as e:
        raise ValueError(f"overrides: must be JSON-serialisable ({e})") from e
    if is_complete_build(out, MARKER, args):
        return out
    tok = build_tiny_qwen3_omni_tokenizer()
    with quiet_transformers():  # rope validation: mrope keys under rope_type "default", as released
        cfg = Qwen3OmniMoeConfig(**tiny_qwen3_omni_config_dict(tok, talker=talker, **overrides))
    # another build's shard count leaves stale shards
    with staged_build(out, MARKER, args, ("model*.safetensors*",)) as tmp:
        with quiet_transformers():
            torch.manual_seed(seed)
            model = Qwen3OmniMoeForConditionalGeneration(cfg).eval()
        _reinit_(model)
        model.generation_config.eos_token_id = list(TINY_QWEN3_OMNI_EOS)
        model.generation_config.pad_token_id = TINY_QWEN3_OMNI_IDS["<|endoftext|>"]
        total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        with quiet_transformers():  # about 4 shards + index, as released (15 / 13 shards)
            model.save_pretrained(tmp, max_shard_size=max(total // 4, 1 << 16))
        _save_processor_files(tmp, tok)
    return out


def enable_talker_audio_prompts(model: Qwen3OmniMoeForConditionalGeneration) -> None:
    """transformers 5.24's talker rope index reads `config.audio_config.n_window` for prompts
    with audio, and the talker config has no audio_config: lend it the thinker's."""
    if getattr(model, "has_talker", False):
        model.talker.config.audio_config = model.thinker.config.audio_config


# --------------------------------------------------------------- reference processor (tests)


class _TinyQwen3FrameVideoProcessor(FrameVideoProcessor):
    """The video processor transformers' Qwen3-Omni processor runs: settings from the
    released preprocessor_config.json (patch 16, mean / std 0.5), the processor's video size
    (128..768 tokens of 32 x 32 pixels)."""

    patch_size = 16
    image_mean = image_std = _CLIP_HALF
    size = {"shortest_edge": 128 * 32 * 32, "longest_edge": 768 * 32 * 32}


class _TinyQwen3OmniProcessor(AcceptsVideoProcessorStub, Qwen3OmniMoeProcessor):
    pass


def build_tiny_qwen3_omni_processor(path: str | Path) -> Qwen3OmniMoeProcessor:
    """transformers' `Qwen3OmniMoeProcessor` for a tiny checkpoint (tests' reference): its
    tokenizer, feature extractor and PIL image processor from the checkpoint files, and
    `_TinyQwen3FrameVideoProcessor` for video (torchvision does not import here)."""
    root = str(path)
    with quiet_transformers():
        tok = AutoTokenizer.from_pretrained(root)
    template = json.loads((Path(root) / "chat_template.json").read_text())["chat_template"]
    return _TinyQwen3OmniProcessor(
        image_processor=Qwen2VLImageProcessorPil.from_pretrained(root),
        video_processor=_TinyQwen3FrameVideoProcessor(),
        feature_extractor=WhisperFeatureExtractor.from_pretrained(root),
        tokenizer=tok, chat_template=template)
