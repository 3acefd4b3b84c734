"""Qwen2.5-Omni thinker on the AR engine: the Qwen2 LM with TMRoPE (3-axis mrope), whose prompt
embeddings at audio / image placeholders come from the audio and vision encoders."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omnistage.engine.ar.sequence import MediaSpan, Sequence
from omnistage.models.layers import DecoderForCausalLM
from omnistage.models.qwen2_5_omni.audio_encoder import Qwen2_5OmniAudioEncoder
from omnistage.models.qwen2_5_omni.processor import ProcessedPrompt
from omnistage.models.qwen2_5_omni.vision_encoder import Qwen2_5OmniVisionEncoder
from omnistage.models.registry import register_model


@dataclass
class Qwen2_5OmniMediaInputs:
    """Encoder inputs of one prompt, waiting for the step that prefills it (CPU tensors).
    *_positions: per item, the prompt indices (int64 [n]) its encoder rows replace; audio items
    are in prompt order (a video's audio track interleaves with its video's rows)."""

    audio_features: list[torch.Tensor]  # per audio [128, frames]
    pixel_values: torch.Tensor | None  # images [patches, 1176]
    image_grid_thw: torch.Tensor | None  # [n_images, 3]
    audio_positions: list[torch.Tensor]
    image_positions: list[torch.Tensor]
    video_pixel_values: torch.Tensor | None = None  # [patches, 1176]
    video_grid_thw: torch.Tensor | None = None  # [n_videos, 3]
    video_positions: list[torch.Tensor] = field(default_factory=list)


@register_model("Qwen2_5OmniThinker")
class Qwen2_5OmniThinkerForCausalLM(DecoderForCausalLM):
    """Checkpoint names (after the `thinker.` prefix): model.* / lm_head.* / audio_tower.* /
    visual.*, the same as ours."""

    def __init__(self, thinker_config: dict) -> None:
        # transformers ties the head by the thinker config's flag, not the text config's
        text = dict(thinker_config["text_config"],
                    tie_word_embeddings=thinker_config.get("tie_word_embeddings", False))
        super().__init__(text)
        self.thinker_config = thinker_config
        self.audio_tower = Qwen2_5OmniAudioEncoder(thinker_config["audio_config"])
        self.visual = Qwen2_5OmniVisionEncoder(thinker_config["vision_config"])

    @staticmethod
    def attention_bias(hf_config: dict) -> bool:
        return True

    def checkpoint_name(self, name: str) -> str | None:
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None  # tied: the embedding is the head
        return name

    # ---------------------------------------------------------------- media
    @torch.inference_mode()
    def encode_media(self, seqs: list[Sequence]) -> None:
        """Run the encoders once over every pending prompt of the step and write each prompt's
        placeholder rows into seq.prompt_embeds [P, D] (mask: seq.prompt_embeds_mask [P])."""
        device, dtype = self.lm_head.weight.device, self.lm_head.weight.dtype
        inputs = [s.pending_media for s in seqs]
        audio = [f.to(device, dtype) for m in inputs for f in m.audio_features]
        audio_out = iter(self.audio_tower(audio) if audio else [])
        # images and videos in one vision pass (each grid is encoded on its own)
        vis = [(m.pixel_values, m.image_grid_thw) for m in inputs if m.pixel_values is not None]
        vis += [(m.video_pixel_values, m.video_grid_thw) for m in inputs
                if m.video_pixel_values is not None]
        vis_out, offset = None, {"image": 0, "video": 0}
        if vis:
            grids = torch.cat([g for _, g in vis])
            vis_out = self.visual(torch.cat([p for p, _ in vis]).to(device, dtype),
                                  grids.to(device))
            offset["video"] = sum(int(m.image_grid_thw.prod(-1).sum()) for m in inputs
                                  if m.pixel_values is not None) // self.visual.merge**2
        for seq, m in zip(seqs, inputs):
            embeds = torch.zeros(seq.num_prompt_tokens, self.config.hidden_size,
                                 device=device, dtype=dtype)
            mask = torch.zeros(seq.num_prompt_tokens, dtype=torch.bool, device=device)
            for idx in m.audio_positions:
                feats = next(audio_out)
                if feats.shape[0] != idx.numel():
                    raise ValueError(f"audio placeholder count {idx.numel()} != encoder rows "
                                     f"{feats.shape[0]}")
                embeds[idx.to(device)], mask[idx.to(device)] = feats, True
            for kind, positions in (("image", m.image_positions), ("video", m.video_positions)):
                for idx in positions:
                    n, o = idx.numel(), offset[kind]
                    embeds[idx.to(device)], mask[idx.to(device)] = vis_out[o:o + n], True
                    offset[kind] += n
            seq.prompt_embeds, seq.prompt_embeds_mask = embeds, mask
            seq.pending_media = None


def thinker_sequence(request_id: str, prompt: ProcessedPrompt, params, seed: int,
                     export_hidden: bool = False) -> Sequence:
    """An engine Sequence for a processed Qwen2.5-Omni prompt."""
    seq = Sequence(request_id, list(prompt.input_ids), params, seed,
                   media=[MediaSpan(m.start, m.start + m.length, m.content_hash)
                          for m in prompt.media],
                   mrope_positions=prompt.mrope_positions, rope_delta=prompt.rope_delta,
                   export_hidden=export_hidden)
    if prompt.media:
        rows = prompt.media_rows()
        seq.pending_media = Qwen2_5OmniMediaInputs(
            list(prompt.audio_features), prompt.image_pixel_values, prompt.image_grid_thw,
            rows["audio"], rows["image"], prompt.video_pixel_values, prompt.video_grid_thw,
            rows["video"])
    return seq
