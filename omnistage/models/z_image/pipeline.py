"""Z-Image (diffusers' ZImagePipeline folder; Z-Image-Turbo): Qwen3 text encoder ->
single-stream DiT (ZImageTransformer2DModel) -> AutoencoderKL, on the shared diffusion stages
(models/diffusion_pipeline.py; built-in YAML config/pipelines/z_image.yaml).

Facts (diffusers is the oracle): the prompt is one user turn through the tokenizer's chat
template (generation prompt, enable_thinking=True), at most 512 tokens; embeddings are the
encoder's hidden_states[-2] at the real tokens; the noise is one CPU draw of
[n, C, 2(H/16), 2(W/16)]; the DiT gets (1000 - t)/1000 and predicts the negated velocity; CFG
runs when guidance_scale > 0 (negative prompt default ""): pos + g(pos - neg), optionally
capped to the cond norm (cfg_normalization) and off at steps past cfg_truncation. Served with
the Turbo model card's settings: 9 steps, guidance 0."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from omnistage.models.autoencoder_kl import AutoencoderKLDecoder
from omnistage.models.diffusion_pipeline import (DiTNetwork, ImagePipeline, decoder_worker,
                                                 denoiser_worker, encoder_worker, example_mask,
                                                 load_component)
from omnistage.models.registry import register_pipeline, register_stage
from omnistage.models.text_encoder import CausalTextEncoder
from omnistage.models.z_image.transformer import ZImageTransformer
from omnistage.runtime.build import StageContext
from omnistage.sampling_params import DiffusionParams

TURBO_STEPS, TURBO_GUIDANCE = 9, 0.0  # Z-Image-Turbo's model card
# diffusers' ZImagePipeline defaults for its CFG path (no norm cap, no truncation)
CFG_NORMALIZATION, CFG_TRUNCATION = 0.0, 1.0


class ZImageNetwork(DiTNetwork):
    """The denoiser the engine drives: the DiT takes (1000 - t)/1000 and predicts the negated
    velocity."""

    sign = -1.0

    def dit_inputs(self, latents: Tensor, timesteps: Tensor, text: Tensor,
                   text_mask: Tensor | None, grid: tuple[int, ...]) -> tuple:
        return latents, (1000 - timesteps) / 1000, text, text_mask

    def guide(self, cond: Tensor, uncond: Tensor, scale: float, options: dict[str, Any]
              ) -> Tensor:
        guided = cond + scale * (cond - uncond)
        cap = options.get("cfg_normalization", 0.0)
        if cap > 0:  # per image: its whole-sample norm at most cap x the cond's
            dims = tuple(range(1, cond.dim()))
            limit = cond.norm(dim=dims, keepdim=True) * cap
            norm = guided.norm(dim=dims, keepdim=True)
            guided = torch.where(norm > limit, guided * (limit / norm), guided)
        return guided

    def example(self, rows: int, text_len: int, size: int, padded: bool) -> tuple:
        w, cfg = self.dit.x_pad_token, self.dit.cfg
        return (torch.randn(rows, cfg.in_channels, size // 8, size // 8, device=w.device,
                            dtype=w.dtype),
                torch.full((rows,), 500.0, device=w.device),
                torch.randn(rows, text_len, cfg.cap_feat_dim, device=w.device, dtype=w.dtype),
                example_mask(rows, text_len, padded, w.device), ())


@register_stage("ZImageTextEncoder", "gen")
def build_text_encoder(ctx: StageContext):
    return encoder_worker(ctx, load_component(CausalTextEncoder, ctx, "text_encoder", -2))


@register_stage("ZImageTransformer", "gen")
def build_transformer(ctx: StageContext):
    return denoiser_worker(ctx, ZImageNetwork(
        load_component(ZImageTransformer, ctx, "transformer")))


@register_stage("ZImageVAE", "gen")
def build_vae(ctx: StageContext):
    vae = load_component(AutoencoderKLDecoder, ctx, "vae")
    return decoder_worker(ctx, lambda latents, grid: vae.decode(latents), vae)


@register_pipeline("z_image")
class ZImagePipeline(ImagePipeline):
    CLASS_NAMES = ("ZImagePipeline",)
    family = "Z-Image"
    default_steps = TURBO_STEPS

    def prompt_ids(self, text: str) -> list[int]:
        rendered = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True,
            enable_thinking=True)
        return self.tokenizer(rendered, max_length=self.max_sequence_length,
                              truncation=True).input_ids

    def noise(self, n: int, height: int, width: int, seed: int) -> tuple[Tensor, tuple]:
        h, w = 2 * (height // 16), 2 * (width // 16)
        x = torch.randn((n, self.latent_channels, h, w),
                        generator=torch.Generator("cpu").manual_seed(seed))
        return x, (h, w)

    @property
    def latent_channels(self) -> int:
        from omnistage.checkpoint import read_json
        return int(read_json(self.path / "transformer" / "config.json")["in_channels"])

    def guidance(self, p: DiffusionParams, sigmas: list[float], steps: int
                 ) -> tuple[list[float], dict[str, Any], bool]:
        if p.true_cfg_scale is not None:
            raise ValueError("sampling_params.true_cfg_scale: Z-Image guides with "
                             "guidance_scale")
        scale = TURBO_GUIDANCE if p.guidance_scale is None else float(p.guidance_scale)
        if scale <= 0:
            return [0.0] * steps, {}, False
        # cfg_truncation: no guidance at steps whose normalised time (1 - sigma) exceeds it
        per_step = [0.0 if CFG_TRUNCATION <= 1 and 1 - s > CFG_TRUNCATION else scale
                    for s in sigmas[:steps]]
        return per_step, {"cfg_normalization": CFG_NORMALIZATION}, True
