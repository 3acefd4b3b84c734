"""Qwen3-Omni thinker on the AR engine: the MoE LM (q/k norm, interleaved 3-axis mrope), whose
prompt rows at audio / image / video placeholders come from the AuT audio encoder and the vision
encoder, with the vision encoder's deepstack features added after its early layers.

NOTE (deepstack through the engine): encode_media writes each prompt's rows as
`seq.prompt_embeds` [P, D * (1 + n_deepstack)]: columns [0, D) are the encoder row that replaces
the token embedding, columns [D * (1 + j), D * (2 + j)) the deepstack row added to the output of
decoder layer j (zeros at audio and text positions; `seq.prompt_embeds_mask` marks the replaced
positions). So the engine's `inputs_embeds` plumbing carries the deepstack rows with their
positions into any prefill chunk, and forward() splits them off again. Every media prompt has
this width (audio-only ones too, with zero deepstack columns), so prompts of one step stack."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import torch
from torch import nn

from omnistage.engine.ar.interface import ForwardBatch, merge_inputs
from omnistage.engine.ar.sequence import MediaSpan, Sequence
from omnistage.layers.moe_decoder import (
    MoEAttention,
    MoEDecoderConfig,
    MoEDecoderModel,
    load_named_tensors,
)
from omnistage.models.qwen2_5_omni.processor import ProcessedPrompt
from omnistage.models.qwen2_5_omni.thinker import Qwen2_5OmniMediaInputs
from omnistage.models.qwen3_omni.audio_encoder import Qwen3OmniAudioEncoder
from omnistage.models.qwen3_omni.vision_encoder import Qwen3OmniVisionEncoder
from omnistage.models.registry import register_model


@register_model("Qwen3OmniMoeThinker")
class Qwen3OmniThinkerForCausalLM(nn.Module):
    """The engine's model contract (engine/ar/interface.py) for the thinker.

    Checkpoint names (after the `thinker.` prefix): model.embed_tokens / model.layers.N.* /
    model.norm / lm_head / audio_tower.* / visual.*, MoE experts per expert
    (`model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight`).

    export_layer: None, or transformers' `hidden_states` index (the pipeline sets the talker's
    `accept_hidden_layer`): forward() then returns [T, 2D], the final-normed rows and that
    layer's rows side by side, so the engine's hidden export (and its graph output buffers)
    carry both; compute_logits reads the first half, exported_rows() the second."""

    def __init__(self, thinker_config: dict) -> None:
        super().__init__()
        # transformers ties the head by the thinker config's flag, not the text config's
        text = dict(thinker_config["text_config"],
                    tie_word_embeddings=thinker_config.get("tie_word_embeddings", False))
        # transformers' Qwen3-Omni rotary interleaves the mrope sections whatever the flags say
        self.config = MoEDecoderConfig.from_hf(text, mrope_interleaved=True)
        self.thinker_config = thinker_config
        self.model = MoEDecoderModel(self.config)
        self.lm_head = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        vision = thinker_config["vision_config"]
        self.num_deepstack = len(vision.get("deepstack_visual_indexes", ()))
        if self.num_deepstack > self.config.num_hidden_layers:
            raise ValueError(f"vision_config.deepstack_visual_indexes: {self.num_deepstack} "
                             f"entries for {self.config.num_hidden_layers} thinker layers")
        self.audio_tower = Qwen3OmniAudioEncoder(thinker_config["audio_config"])
        self.visual = Qwen3OmniVisionEncoder(vision)
        self.export_layer: int | None = None

    # ---------------------------------------------------------------- engine contract
    @property
    def kv_shape(self) -> tuple[int, int, int]:
        c = self.config
        return c.num_hidden_layers, c.num_key_value_heads, c.head_dim

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def attention_layers(self) -> list[MoEAttention]:
        return [layer.self_attn for layer in self.model.layers]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def embed_row(self, token_id: int) -> torch.Tensor:
        """embed of one id, [D]: a view of the table's row (no id tensor, no kernel)."""
        return self.model.embed_tokens.weight[token_id]

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """-> final-normed hidden [T, D] (with export_layer: [T, 2D], class note)."""
        deepstack = None
        if batch.inputs_embeds is not None:
            width = self.config.hidden_size
            rows = batch.inputs_embeds  # [T, D * (1 + n_deepstack)] (module note)
            if rows.shape[-1] not in (width, width * (1 + self.num_deepstack)):
                raise ValueError(f"inputs_embeds: width {rows.shape[-1]}, expected {width} or "
                                 f"{width * (1 + self.num_deepstack)}")
            if rows.shape[-1] > width:
                deepstack = list(rows[:, width:].split(width, dim=-1))
                batch = replace(batch, inputs_embeds=rows[:, :width])
        x = merge_inputs(self.embed(batch.input_ids), batch)
        hidden, exported = self.model(x, batch, deepstack, self.export_layer)
        return hidden if exported is None else torch.cat([hidden, exported], dim=-1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden[..., :self.config.hidden_size]).float()

    def exported_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """The export_layer rows of forward()'s output rows."""
        if self.export_layer is None:
            raise ValueError("exported_rows: the thinker has no export_layer set")
        return hidden[..., self.config.hidden_size:]

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Checkpoint tensors named as after the `thinker.` prefix (class docstring)."""
        tied = self.config.tie_word_embeddings
        load_named_tensors(self, tensors, skip=lambda name: tied and name == "lm_head.weight")

    # ---------------------------------------------------------------- media
    @torch.inference_mode()
    def encode_media(self, seqs: list[Sequence]) -> None:
        """Run the encoders once over every pending prompt of the step and write each prompt's
        rows into seq.prompt_embeds [P, D * (1 + n_deepstack)] (layout: module note; mask:
        seq.prompt_embeds_mask [P])."""
        device, dtype = self.lm_head.weight.device, self.lm_head.weight.dtype
        width = self.config.hidden_size
        inputs = [s.pending_media for s in seqs]
        audio = [f.to(device, dtype) for m in inputs for f in m.audio_features]
        audio_out = iter(self.audio_tower(audio) if audio else [])
        vis_rows, offset = self._encode_visual(inputs, device, dtype)
        for seq, m in zip(seqs, inputs):
            embeds = torch.zeros(seq.num_prompt_tokens, width * (1 + self.num_deepstack),
                                 device=device, dtype=dtype)
            mask = torch.zeros(seq.num_prompt_tokens, dtype=torch.bool, device=device)
            for idx in m.audio_positions:
                feats = next(audio_out)
                if feats.shape[0] != idx.numel():
                    raise ValueError(f"audio placeholder count {idx.numel()} != encoder rows "
                                     f"{feats.shape[0]}")
                embeds[idx.to(device), :width], mask[idx.to(device)] = feats, True
            for kind, positions in (("image", m.image_positions), ("video", m.video_positions)):
                for idx in positions:
                    n, o = idx.numel(), offset[kind]
                    if o + n > vis_rows.shape[0]:
                        raise ValueError(f"{kind} placeholder count exceeds the encoder rows "
                                         f"{vis_rows.shape[0]}")
                    embeds[idx.to(device)], mask[idx.to(device)] = vis_rows[o:o + n], True
                    offset[kind] += n
            seq.prompt_embeds, seq.prompt_embeds_mask = embeds, mask
            seq.pending_media = None

    def _encode_visual(self, inputs: list[Qwen2_5OmniMediaInputs], device: torch.device,
                       dtype: torch.dtype) -> tuple[torch.Tensor | None, dict[str, int]]:
        """Images and videos of the step in one vision pass -> (rows [N, D * (1 + n_ds)]: the
        embedding and its deepstack rows side by side; the first video row's index)."""
        vis = [(m.pixel_values, m.image_grid_thw) for m in inputs if m.pixel_values is not None]
        vis += [(m.video_pixel_values, m.video_grid_thw) for m in inputs
                if m.video_pixel_values is not None]
        offset = {"image": 0, "video": 0}
        if not vis:
            return None, offset
        grids = torch.cat([g for _, g in vis])
        embeds, deepstack = self.visual(torch.cat([p for p, _ in vis]).to(device, dtype),
                                        grids.to(device))
        if len(deepstack) != self.num_deepstack:
            raise ValueError(f"vision encoder gave {len(deepstack)} deepstack sets, expected "
                             f"{self.num_deepstack} (vision_config.deepstack_visual_indexes)")
        offset["video"] = sum(int(m.image_grid_thw.prod(-1).sum()) for m in inputs
                              if m.pixel_values is not None) // self.visual.merge**2
        return torch.cat([embeds, *deepstack], dim=-1), offset


def thinker_sequence(request_id: str, prompt: ProcessedPrompt, params, seed: int,
                     export_hidden: bool = False) -> Sequence:
    """An engine Sequence for a processed Qwen3-Omni prompt (encoder inputs left pending until
    the step that first schedules it)."""
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
