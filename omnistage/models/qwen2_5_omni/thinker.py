"""Qwen2.5-Omni thinker on the AR engine: the Qwen2 LM with TMRoPE (3-axis mrope), whose prompt
embeddings at audio / image placeholders come from the audio and vision encoders."""

from __future__ import annotations

from collections.abc import Iterator
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


class OmniThinkerMedia:
    """encode_media for a thinker with `audio_tower`, `visual` (with `merge`), `lm_head` and
    `config.hidden_size`: one audio pass and one vision pass over the step's pending prompts.
    `_visual_rows` and `prompt_row_width` say what a vision row holds (Qwen2.5: the
    embedding; Qwen3: its deepstack rows beside it). Mixed in before nn.Module."""

    @property
    def prompt_row_width(self) -> int:
        """The width of seq.prompt_embeds' rows."""
        return self.config.hidden_size

    def _visual_rows(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Vision rows [N, prompt_row_width] of the step's images then videos."""
        return self.visual(pixel_values, grid_thw)

    @torch.inference_mode()
    def encode_media(self, seqs: list[Sequence]) -> None:
        """Run the encoders once over every pending prompt of the step and write each prompt's
        rows into seq.prompt_embeds [P, prompt_row_width] (mask: seq.prompt_embeds_mask [P])."""
        emb = self.model.embed_tokens.weight  # (an FP8 lm_head holds e4m3 weights)
        device, dtype = emb.device, emb.dtype
        inputs = [s.pending_media for s in seqs]
        audio = [f.to(device, dtype) for m in inputs for f in m.audio_features]
        audio_rows = iter(self.audio_tower(audio) if audio else [])
        visual_rows, video_offset = None, 0
        visual = visual_inputs(inputs, self.visual.merge)
        if visual is not None:
            pixels, grids, video_offset = visual
            visual_rows = self._visual_rows(pixels.to(device, dtype), grids.to(device))
        write_media_rows(seqs, audio_rows, visual_rows, video_offset, self.config.hidden_size,
                         self.prompt_row_width, device, dtype)


@register_model("Qwen2_5OmniThinker")
class Qwen2_5OmniThinkerForCausalLM(OmniThinkerMedia, DecoderForCausalLM):
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


def visual_inputs(inputs: list[Qwen2_5OmniMediaInputs], merge: int
                  ) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """The step's images, then its videos, for one vision pass (each grid is encoded on its
    own): (pixel_values, grid_thw [n, 3], the index of the first video row in the encoder's
    output); None when there are none."""
    vis = [(m.pixel_values, m.image_grid_thw) for m in inputs if m.pixel_values is not None]
    vis += [(m.video_pixel_values, m.video_grid_thw) for m in inputs
            if m.video_pixel_values is not None]
    if not vis:
        return None
    video_offset = sum(int(m.image_grid_thw.prod(-1).sum()) for m in inputs
                       if m.pixel_values is not None) // merge**2
    return torch.cat([p for p, _ in vis]), torch.cat([g for _, g in vis]), video_offset


def write_media_rows(seqs: list[Sequence], audio_rows: Iterator[torch.Tensor],
                     visual_rows: torch.Tensor | None, video_offset: int, width: int,
                     row_width: int, device: torch.device, dtype: torch.dtype) -> None:
    """Write each pending prompt's seq.prompt_embeds [P, row_width] (zeros but at its media
    positions) and seq.prompt_embeds_mask [P] (True there), and clear seq.pending_media.
    audio_rows: each audio's encoder rows [n, width] in the step's prompt order (they fill a
    position's first `width` columns); visual_rows [N, row_width]: the vision pass over
    visual_inputs' pixels (image rows, then video rows from `video_offset`)."""
    offset = {"image": 0, "video": video_offset}
    for seq in seqs:
        m = seq.pending_media
        embeds = torch.zeros(seq.num_prompt_tokens, row_width, device=device, dtype=dtype)
        mask = torch.zeros(seq.num_prompt_tokens, dtype=torch.bool, device=device)
        for idx in m.audio_positions:
            feats = next(audio_rows)
            if feats.shape[0] != idx.numel():
                raise ValueError(f"audio placeholder count {idx.numel()} != encoder rows "
                                 f"{feats.shape[0]}")
            embeds[idx.to(device), :width], mask[idx.to(device)] = feats, True
        for kind, positions in (("image", m.image_positions), ("video", m.video_positions)):
            for idx in positions:
                n, o = idx.numel(), offset[kind]
                if visual_rows is None or o + n > visual_rows.shape[0]:
                    raise ValueError(f"{kind} placeholder count exceeds the encoder rows "
                                     f"{0 if visual_rows is None else visual_rows.shape[0]}")
                embeds[idx.to(device)], mask[idx.to(device)] = visual_rows[o:o + n], True
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
