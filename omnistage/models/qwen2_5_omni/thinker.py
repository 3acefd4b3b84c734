"""Qwen2.5-Omni thinker on the AR engine: the Qwen2 LM with TMRoPE (3-axis mrope), whose prompt
embeddings at audio / image placeholders come from the audio and vision encoders."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omnistage.engine.ar.sequence import MediaSpan, Sequence
from omnistage.models.layers import DecoderForCausalLM
from omnistage.models.qwen2_5_omni.audio_encoder import Qwen2_5OmniAudioEncoder
from omnistage.models.qwen2_5_omni.processor import ProcessedPrompt
from omnistage.models.qwen2_5_omni.vision_encoder import Qwen2_5OmniVisionEncoder
from omnistage.models.registry import register_model


@dataclass
class Qwen2_5OmniMediaInputs:
    """Encoder inputs of one prompt, waiting for the step that prefills it (CPU tensors)."""

    audio_features: list[torch.Tensor]  # per audio [128, frames]
    pixel_values: torch.Tensor | None  # [patches, 1176]
    image_grid_thw: torch.Tensor | None  # [n_images, 3]
    audio_positions: list[tuple[int, int]]  # placeholder spans [start, end) in the prompt
    image_positions: list[tuple[int, int]]


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
        audio_out = self.audio_tower(audio) if audio else []
        pix = [m.pixel_values for m in inputs if m.pixel_values is not None]
        image_rows = None
        if pix:
            grids = torch.cat([m.image_grid_thw for m in inputs if m.image_grid_thw is not None])
            image_rows = self.visual(torch.cat(pix).to(device, dtype), grids.to(device))
        a, img_off = 0, 0
        for seq, m in zip(seqs, inputs):
            embeds = torch.zeros(seq.num_prompt_tokens, self.config.hidden_size,
                                 device=device, dtype=dtype)
            mask = torch.zeros(seq.num_prompt_tokens, dtype=torch.bool, device=device)
            for start, end in m.audio_positions:
                rows = audio_out[a]
                a += 1
                if rows.shape[0] != end - start:
                    raise ValueError(f"audio placeholder span {end - start} != encoder rows "
                                     f"{rows.shape[0]}")
                embeds[start:end], mask[start:end] = rows, True
            for start, end in m.image_positions:
                n = end - start
                embeds[start:end], mask[start:end] = image_rows[img_off:img_off + n], True
                img_off += n
            seq.prompt_embeds, seq.prompt_embeds_mask = embeds, mask
            seq.pending_media = None


def thinker_sequence(request_id: str, prompt: ProcessedPrompt, params, seed: int,
                     export_hidden: bool = False) -> Sequence:
    """An engine Sequence for a processed Qwen2.5-Omni prompt."""
    audio = [(m.start, m.start + m.length) for m in prompt.media if m.kind == "audio"]
    image = [(m.start, m.start + m.length) for m in prompt.media if m.kind == "image"]
    seq = Sequence(request_id, list(prompt.input_ids), params, seed,
                   media=[MediaSpan(m.start, m.start + m.length, m.content_hash)
                          for m in prompt.media],
                   mrope_positions=prompt.mrope_positions, rope_delta=prompt.rope_delta,
                   export_hidden=export_hidden)
    if prompt.media:
        seq.pending_media = Qwen2_5OmniMediaInputs(
            list(prompt.audio_features), prompt.image_pixel_values, prompt.image_grid_thw,
            audio, image)
    return seq
