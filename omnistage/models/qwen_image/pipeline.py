"""Qwen-Image (diffusers' QwenImagePipeline folder): Qwen2.5-VL text encoder -> MMDiT
(QwenImageTransformer2DModel) -> AutoencoderKLQwenImage, on the shared diffusion stages
(models/diffusion_pipeline.py; built-in YAML config/pipelines/qwen_image.yaml).

Facts (diffusers is the oracle): the prompt goes through a fixed chat template whose first 34
encoded positions are dropped; embeddings are the encoder's last (normed) hidden state, at
most 512 of them; the noise is one CPU draw of [n, 1, C, 2(H/16), 2(W/16)] packed into 2x2
patches; the DiT gets t/1000; CFG runs when true_cfg_scale > 1 and a negative prompt is given:
neg + s(cond - neg) rescaled per token to the cond norm."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from omnistage.models.diffusion_pipeline import (DiTNetwork, ImagePipeline, decoder_worker,
                                                 denoiser_worker, encoder_worker, example_mask,
                                                 load_component)
from omnistage.models.qwen_image.transformer import QwenImageTransformer
from omnistage.models.qwen_image.vae import QwenImageVAEDecoder
from omnistage.models.registry import register_pipeline, register_stage
from omnistage.models.text_encoder import CausalTextEncoder
from omnistage.runtime.build import StageContext
from omnistage.sampling_params import DiffusionParams

TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, "
            "texture, quantity, text, spatial relationships of the objects and background:"
            "<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")
DROP_POSITIONS = 34  # diffusers' prompt_template_encode_start_idx (a constant, not measured)
TOKENIZER_MAX = 1024  # diffusers' tokenizer_max_length (+ the dropped positions)
DEFAULT_TRUE_CFG = 4.0  # diffusers' __call__ default


class QwenImageNetwork(DiTNetwork):
    """The denoiser the engine drives: the DiT takes t/1000 and the grid."""

    def dit_inputs(self, latents: Tensor, timesteps: Tensor, text: Tensor,
                   text_mask: Tensor | None, grid: tuple[int, ...]) -> tuple:
        return latents, timesteps / 1000, text, text_mask, grid

    def guide(self, cond: Tensor, uncond: Tensor, scale: float, options: dict[str, Any]
              ) -> Tensor:
        combined = uncond + scale * (cond - uncond)
        return combined * (cond.norm(dim=-1, keepdim=True) / combined.norm(dim=-1, keepdim=True))

    def example(self, rows: int, text_len: int, size: int, padded: bool) -> tuple:
        w = self.dit.img_in.weight
        cfg, grid = self.dit.cfg, (size // 16, size // 16)
        return (torch.randn(rows, grid[0] * grid[1], cfg.in_channels, device=w.device,
                            dtype=w.dtype),
                torch.full((rows,), 500.0, device=w.device),
                torch.randn(rows, text_len, cfg.joint_attention_dim, device=w.device,
                            dtype=w.dtype), example_mask(rows, text_len, padded, w.device), grid)


def unpack(tokens: Tensor, h: int, w: int) -> Tensor:
    """[n, h*w, C*4] 2x2 patches -> [n, C, 2h, 2w] latents."""
    n, _, d = tokens.shape
    c = d // 4
    return tokens.view(n, h, w, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(n, c, 2 * h, 2 * w)


@register_stage("QwenImageTextEncoder", "gen")
def build_text_encoder(ctx: StageContext):
    encoder = load_component(CausalTextEncoder, ctx, "text_encoder", -1)
    return encoder_worker(ctx, encoder, drop=DROP_POSITIONS)


@register_stage("QwenImageTransformer", "gen")
def build_transformer(ctx: StageContext):
    return denoiser_worker(ctx, QwenImageNetwork(
        load_component(QwenImageTransformer, ctx, "transformer")))


@register_stage("QwenImageVAE", "gen")
def build_vae(ctx: StageContext):
    vae = load_component(QwenImageVAEDecoder, ctx, "vae")

    def decode(tokens: Tensor, grid: tuple[int, int]) -> Tensor:
        return vae.decode(unpack(tokens, *grid))
    return decoder_worker(ctx, decode, vae)


@register_pipeline("qwen_image")
class QwenImagePipeline(ImagePipeline):
    CLASS_NAMES = ("QwenImagePipeline",)
    family = "Qwen-Image"
    default_steps = 50

    def prompt_ids(self, text: str) -> list[int]:
        ids = self.tokenizer(TEMPLATE.format(text), max_length=TOKENIZER_MAX + DROP_POSITIONS,
                             truncation=True).input_ids
        # diffusers keeps the first max_sequence_length embeddings after the drop: the encoder
        # is causal, so the ids past them change nothing
        return ids[:DROP_POSITIONS + self.max_sequence_length]

    def noise(self, n: int, height: int, width: int, seed: int) -> tuple[Tensor, tuple]:
        c = self.latent_channels
        h, w = 2 * (height // 16), 2 * (width // 16)
        x = torch.randn((n, 1, c, h, w), generator=torch.Generator("cpu").manual_seed(seed))
        tokens = x.view(n, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
        return tokens.reshape(n, (h // 2) * (w // 2), c * 4), (h // 2, w // 2)

    @property
    def latent_channels(self) -> int:
        from omnistage.checkpoint import read_json
        return int(read_json(self.path / "transformer" / "config.json")["in_channels"]) // 4

    def guidance(self, p: DiffusionParams, sigmas: list[float], steps: int
                 ) -> tuple[list[float], dict[str, Any], bool]:
        if p.guidance_scale is not None:
            raise ValueError("sampling_params.guidance_scale: Qwen-Image is not guidance-"
                             "distilled; use true_cfg_scale (with a negative_prompt)")
        scale = DEFAULT_TRUE_CFG if p.true_cfg_scale is None else float(p.true_cfg_scale)
        cfg = scale > 1 and p.negative_prompt is not None  # diffusers' rule
        return [scale if cfg else 0.0] * steps, {}, cfg
