"""Tiny random Qwen-Image checkpoint in diffusers' released layout, built offline in ~1 s.

Layout (as `Qwen/Qwen-Image`): model_index.json (`QwenImagePipeline`), scheduler/
scheduler_config.json (the released FlowMatchEulerDiscreteScheduler values), text_encoder/
(`Qwen2_5_VLForConditionalGeneration`: config.json, generation_config.json, model.safetensors),
tokenizer/ (`Qwen2Tokenizer`: tokenizer.json, tokenizer_config.json), transformer/ and vae/
(config.json + diffusion_pytorch_model.safetensors, diffusers' tensor names; the VAE file holds
the encoder too, as released). Everything in fp32.

Sizes: DiT 2 blocks of 2 heads x 16 (axes_dims_rope 4/6/6), in_channels 64 (z_dim 16, patch 2),
joint_attention_dim 64 = the text encoder's hidden size (2 layers, 4 heads x 16, mrope 2/3/3;
a 1-block vision tower nothing runs); VAE base_dim 8 with the released dim_mult, residual
blocks and temporal flags (x8 spatial).

Tokenizer: byte-level BPE (512) + Qwen's specials (ids 0..6) + the words of diffusers' prompt
template as whole tokens, so that the template prefix before the user text is 34 tokens, as
with the released tokenizer (diffusers drops a constant 34). Those words also match inside user
text (" the" in " them"): harmless for a test tokenizer.

Initialisation (DESIGN.md "Tiny checkpoints"): with default inits the image hardly depends on the
prompt. DiT linears N(0, 1.5/sqrt(fan_in)) (norm_out / proj_out included, never zero), biases 0,
text values x3 and text key norms 2 (see `transformer_tensors`);
text encoder matrices N(0, 0.1) and token embeddings N(0, 1); VAE convs N(0, 1.4/sqrt(fan_in))
over the 2-D part of the kernel (what one frame sees), biases N(0, 0.05). tests/models/qwen_image/
test_tiny_checkpoint.py checks image std and prompt sensitivity through diffusers.

The tensors are generated from the names and shapes alone (no diffusers import): building needs
only torch, transformers and safetensors.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

from omnistage.checkpoint import quiet_transformers
from omnistage.models.qwen_image.transformer import QwenImageTransformer, diffusers_name
from omnistage.testing.tiny_omni import is_complete_build, staged_build
from omnistage.testing.tokenizer import CHATML_TEMPLATE, train_bpe

BUILD_VERSION = 1
MARKER = "tiny_qwen_image_build.json"
DIFFUSERS_VERSION = "0.34.0.dev0"  # the released checkpoint's files record this version
COMPONENTS = ("scheduler", "text_encoder", "tokenizer", "transformer", "vae")

PROMPT_TEMPLATE_PREFIX = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, "
    "quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
    "<|im_start|>user\n")
PROMPT_TEMPLATE_DROP = 34  # diffusers' prompt_template_encode_start_idx

TINY_QWEN_IMAGE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                            "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
TEMPLATE_WORDS = ["system", "user", "assistant", "Describe", " image", " by", " detailing", " the",
                  " color", " shape", " size", " texture", " quantity", " text", " spatial",
                  " relationships", " of", " objects", " and", " background"]
TINY_BPE_VOCAB = 512
TEXT_HIDDEN = 64

MODEL_INDEX = {
    "_class_name": "QwenImagePipeline", "_diffusers_version": DIFFUSERS_VERSION,
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
    "tokenizer": ["transformers", "Qwen2Tokenizer"],
    "transformer": ["diffusers", "QwenImageTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKLQwenImage"],
}
SCHEDULER_CONFIG = {  # Qwen/Qwen-Image scheduler/scheduler_config.json
    "_class_name": "FlowMatchEulerDiscreteScheduler", "_diffusers_version": DIFFUSERS_VERSION,
    "base_image_seq_len": 256, "base_shift": 0.5, "invert_sigmas": False,
    "max_image_seq_len": 8192, "max_shift": 0.9, "num_train_timesteps": 1000, "shift": 1.0,
    "shift_terminal": 0.02, "stochastic_sampling": False, "time_shift_type": "exponential",
    "use_beta_sigmas": False, "use_dynamic_shifting": True, "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}
TRANSFORMER_CONFIG = {
    "_class_name": "QwenImageTransformer2DModel", "_diffusers_version": DIFFUSERS_VERSION,
    "attention_head_dim": 16, "axes_dims_rope": [4, 6, 6], "guidance_embeds": False,
    "in_channels": 64, "joint_attention_dim": TEXT_HIDDEN, "num_attention_heads": 2,
    "num_layers": 2, "out_channels": 16, "patch_size": 2,
}
VAE_CONFIG = {
    "_class_name": "AutoencoderKLQwenImage", "_diffusers_version": DIFFUSERS_VERSION,
    "attn_scales": [], "base_dim": 8, "dim_mult": [1, 2, 4, 4], "dropout": 0.0,
    "latents_mean": [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                     0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921],
    "latents_std": [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687,
                    2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.916],
    "num_res_blocks": 2, "temperal_downsample": [False, True, True], "z_dim": 16,
}


def build_tiny_qwen_image_tokenizer() -> Qwen2Tokenizer:
    """Byte-level BPE with Qwen's specials and the template words (see the module docstring)."""
    tok = Qwen2Tokenizer(tokenizer_object=train_bpe(TINY_BPE_VOCAB, TINY_QWEN_IMAGE_SPECIALS),
                         eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None)
    tok.add_tokens(TEMPLATE_WORDS)
    tok.chat_template = CHATML_TEMPLATE
    prefix_len = len(tok(PROMPT_TEMPLATE_PREFIX).input_ids)
    if prefix_len != PROMPT_TEMPLATE_DROP:  # an internal invariant of this builder
        raise RuntimeError(f"tiny tokenizer: template prefix is {prefix_len} tokens, "
                           f"expected {PROMPT_TEMPLATE_DROP}")
    return tok


def tiny_text_encoder_config(tok: Qwen2Tokenizer) -> Qwen2_5_VLConfig:
    i = tok.convert_tokens_to_ids
    text = {"vocab_size": len(tok), "hidden_size": TEXT_HIDDEN, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                "mrope_section": [2, 3, 3]},  # head_dim 16: sums to 8
            "bos_token_id": i("<|endoftext|>"), "eos_token_id": i("<|im_end|>"),
            "pad_token_id": i("<|endoftext|>")}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
              "out_hidden_size": TEXT_HIDDEN, "fullatt_block_indexes": [0]}
    with quiet_transformers():
        return Qwen2_5_VLConfig(
            text_config=text, vision_config=vision, image_token_id=i("<|image_pad|>"),
            video_token_id=i("<|video_pad|>"), vision_start_token_id=i("<|vision_start|>"),
            vision_end_token_id=i("<|vision_end|>"))


def _normal(gen: torch.Generator, shape: tuple[int, ...], std: float) -> torch.Tensor:
    return torch.randn(shape, generator=gen) * std


def transformer_tensors(seed: int) -> dict[str, torch.Tensor]:
    """The DiT's tensors by diffusers' names: linears N(0, 1.5/sqrt(fan_in)), biases 0, norm
    weights 1; then the text's pull on the image raised: text value projections x3 and text key
    norm weights 2 (measured on 3 steps at 64x48: latent distance between prompts 0.3 -> 0.7,
    against 1.5 between seeds)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {name: tuple(p.shape)
              for name, p in QwenImageTransformer(TRANSFORMER_CONFIG).named_parameters()}
    out = {}
    for ours in sorted(shapes):
        shape = shapes[ours]
        if len(shape) == 2:
            t = _normal(gen, shape, 1.5 / shape[1] ** 0.5)
        elif ours.endswith(".bias"):
            t = torch.zeros(shape)
        else:
            t = torch.ones(shape)
        if ours.endswith("attn.add_v_proj.weight"):
            t = t * 3.0
        elif ours.endswith("attn.norm_added_k.weight"):
            t = t * 2.0
        out[diffusers_name(ours)] = t
    return out


def vae_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Names and shapes of every tensor of diffusers' `AutoencoderKLQwenImage` for `cfg`
    (encoder, quant convs, decoder): causal convs [out, in, t, h, w], RMS gammas [C, 1, 1(, 1)]."""
    base, z, mult, nres = cfg["base_dim"], cfg["z_dim"], cfg["dim_mult"], cfg["num_res_blocks"]
    down = cfg["temperal_downsample"]
    shapes: dict[str, tuple[int, ...]] = {}

    def conv(name: str, cin: int, cout: int, kernel: tuple[int, ...]) -> None:
        shapes[f"{name}.weight"], shapes[f"{name}.bias"] = (cout, cin, *kernel), (cout,)

    def resnet(name: str, cin: int, cout: int) -> None:
        shapes[f"{name}.norm1.gamma"] = (cin, 1, 1, 1)
        shapes[f"{name}.norm2.gamma"] = (cout, 1, 1, 1)
        conv(f"{name}.conv1", cin, cout, (3, 3, 3))
        conv(f"{name}.conv2", cout, cout, (3, 3, 3))
        if cin != cout:
            conv(f"{name}.conv_shortcut", cin, cout, (1, 1, 1))

    def mid(name: str, dim: int) -> None:
        resnet(f"{name}.resnets.0", dim, dim)
        resnet(f"{name}.resnets.1", dim, dim)
        shapes[f"{name}.attentions.0.norm.gamma"] = (dim, 1, 1)
        conv(f"{name}.attentions.0.to_qkv", dim, 3 * dim, (1, 1))
        conv(f"{name}.attentions.0.proj", dim, dim, (1, 1))

    dims = [base * m for m in [1, *mult]]
    conv("encoder.conv_in", 3, dims[0], (3, 3, 3))
    index = 0  # encoder.down_blocks is one flat list of residual and downsample blocks
    for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:])):
        for j in range(nres):
            resnet(f"encoder.down_blocks.{index}", cin if j == 0 else cout, cout)
            index += 1
        if i < len(mult) - 1:
            conv(f"encoder.down_blocks.{index}.resample.1", cout, cout, (3, 3))
            if down[i]:
                conv(f"encoder.down_blocks.{index}.time_conv", cout, cout, (3, 1, 1))
            index += 1
    mid("encoder.mid_block", dims[-1])
    shapes["encoder.norm_out.gamma"] = (dims[-1], 1, 1, 1)
    conv("encoder.conv_out", dims[-1], 2 * z, (3, 3, 3))
    conv("quant_conv", 2 * z, 2 * z, (1, 1, 1))
    conv("post_quant_conv", z, z, (1, 1, 1))

    dims = [base * m for m in [mult[-1], *mult[::-1]]]
    up = down[::-1]
    conv("decoder.conv_in", z, dims[0], (3, 3, 3))
    mid("decoder.mid_block", dims[0])
    for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:])):
        cin = cin // 2 if i > 0 else cin  # the previous upsampler halved the channels
        for j in range(nres + 1):
            resnet(f"decoder.up_blocks.{i}.resnets.{j}", cin if j == 0 else cout, cout)
        if i < len(mult) - 1:
            conv(f"decoder.up_blocks.{i}.upsamplers.0.resample.1", cout, cout // 2, (3, 3))
            if up[i]:
                conv(f"decoder.up_blocks.{i}.upsamplers.0.time_conv", cout, 2 * cout, (3, 1, 1))
    shapes["decoder.norm_out.gamma"] = (dims[-1], 1, 1, 1)
    conv("decoder.conv_out", dims[-1], 3, (3, 3, 3))
    return shapes


def vae_tensors(seed: int, gain: float = 1.4, bias_std: float = 0.05) -> dict[str, torch.Tensor]:
    """VAE tensors: conv weights N(0, gain/sqrt(in * kh * kw)) (the 2-D fan-in: one frame sees
    one time slice), biases N(0, bias_std), gammas 1."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sorted(vae_shapes(VAE_CONFIG).items()):
        if name.endswith(".gamma"):
            out[name] = torch.ones(shape)
        elif name.endswith(".bias"):
            out[name] = _normal(gen, shape, bias_std)
        else:
            fan_in = shape[1] * shape[-1] * shape[-2]
            out[name] = _normal(gen, shape, gain / fan_in ** 0.5)
    return out


def _text_encoder(tok: Qwen2Tokenizer, seed: int) -> Qwen2_5_VLForConditionalGeneration:
    """Default init, then the language model sharpened: matrices N(0, 0.1), embeddings N(0, 1)
    (prompts then give clearly different hidden states); the vision tower keeps its init."""
    torch.manual_seed(seed)
    with quiet_transformers():
        model = Qwen2_5_VLForConditionalGeneration(tiny_text_encoder_config(tok)).eval()
    with torch.no_grad():
        for p in model.model.language_model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.1)
        model.model.language_model.embed_tokens.weight.normal_(0.0, 1.0)
        model.lm_head.weight.normal_(0.0, 0.1)
    return model


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _write_diffusers_model(folder: Path, config: dict[str, Any],
                           tensors: dict[str, torch.Tensor]) -> None:
    _write_json(folder / "config.json", config)
    save_file({k: v.contiguous() for k, v in tensors.items()},
              str(folder / "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})


def build_tiny_qwen_image(path: str | Path, seed: int = 0) -> Path:
    """Build (or reuse) a tiny random QwenImagePipeline checkpoint at `path`; returns the path.

    Deterministic for a seed (identical files); a complete build for the same seed is reused.
    Files are written to a temporary sibling directory first and moved in, the marker last."""
    out = Path(path)
    args = {"version": BUILD_VERSION, "seed": int(seed)}
    if is_complete_build(out, MARKER, args):
        return out
    tok = build_tiny_qwen_image_tokenizer()
    # staged_build moves files, not folders: clear another build's component folders first
    (out / MARKER).unlink(missing_ok=True)
    for name in COMPONENTS:
        if (out / name).is_dir():
            shutil.rmtree(out / name)
    with staged_build(out, MARKER, args) as tmp:
        _write_json(tmp / "model_index.json", MODEL_INDEX)
        _write_json(tmp / "scheduler" / "scheduler_config.json", SCHEDULER_CONFIG)
        tok.save_pretrained(tmp / "tokenizer")
        with quiet_transformers():
            _text_encoder(tok, seed).save_pretrained(tmp / "text_encoder")
        _write_diffusers_model(tmp / "transformer", TRANSFORMER_CONFIG,
                               transformer_tensors(seed + 1))
        _write_diffusers_model(tmp / "vae", VAE_CONFIG, vae_tensors(seed + 2))
    return out
