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

from omnistage.engine.ar.interface import DecoderContract, ForwardBatch, merge_inputs
from omnistage.layers.moe_decoder import MoEDecoderConfig, MoEDecoderModel, load_named_tensors
# a processed prompt -> its engine Sequence: Qwen2.5-Omni's (the same prompt and media rows)
from omnistage.models.qwen2_5_omni.thinker import thinker_sequence as thinker_sequence
from omnistage.models.qwen2_5_omni.thinker import OmniThinkerMedia
from omnistage.models.qwen3_omni.audio_encoder import Qwen3OmniAudioEncoder
from omnistage.models.qwen3_omni.vision_encoder import Qwen3OmniVisionEncoder
from omnistage.layers.parallel import current_tp
from omnistage.models.layers import embed_lookup, embed_row_lookup, parallel_lm_head
from omnistage.models.registry import register_model


@register_model("Qwen3OmniMoeThinker")
class Qwen3OmniThinkerForCausalLM(OmniThinkerMedia, DecoderContract, nn.Module):
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
        self.tp = current_tp()  # built inside layers.parallel.tensor_parallel: this rank's shard
        self.model = MoEDecoderModel(self.config)
        self.lm_head = parallel_lm_head(self.config.hidden_size, self.config.vocab_size,
                                        self.model.embed_tokens, self.tp,
                                        self.config.tie_word_embeddings)
        if self.config.tie_word_embeddings and not self.tp.enabled:
            self.lm_head.weight = self.model.embed_tokens.weight
        vision = thinker_config["vision_config"]
        self.num_deepstack = len(vision.get("deepstack_visual_indexes", ()))
        if self.num_deepstack > self.config.num_hidden_layers:
            raise ValueError(f"vision_config.deepstack_visual_indexes: {self.num_deepstack} "
                             f"entries for {self.config.num_hidden_layers} thinker layers")
        self.audio_tower = Qwen3OmniAudioEncoder(thinker_config["audio_config"])
        self.visual = Qwen3OmniVisionEncoder(vision)
        self.export_layer: int | None = None

    # ------------------------------------------ engine contract (the rest: DecoderContract)
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
        # the module call: collective under tensor parallelism (embed() is a local lookup)
        x = merge_inputs(self.input_embedding(batch.input_ids), batch)
        hidden, exported = self.model(x, batch, deepstack, self.export_layer)
        return hidden if exported is None else torch.cat([hidden, exported], dim=-1)

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """(layers, this rank's KV heads, head_dim): under tensor parallelism a rank caches
        only its heads."""
        c = self.config
        return c.num_hidden_layers, self.model.layers[0].self_attn.num_kv_heads, c.head_dim

    @classmethod
    def supports_tensor_parallel(cls) -> bool:
        return True

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return embed_lookup(self.input_embedding, input_ids)

    def embed_row(self, token_id: int) -> torch.Tensor:
        return embed_row_lookup(self.input_embedding, token_id)

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
    @property
    def prompt_row_width(self) -> int:
        """seq.prompt_embeds' rows: D * (1 + n_deepstack) (module note)."""
        return self.config.hidden_size * (1 + self.num_deepstack)

    def _visual_rows(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """The vision embedding and its deepstack rows side by side [N, prompt_row_width]."""
        embeds, deepstack = self.visual(pixel_values, grid_thw)
        if len(deepstack) != self.num_deepstack:
            raise ValueError(f"vision encoder gave {len(deepstack)} deepstack sets, expected "
                             f"{self.num_deepstack} (vision_config.deepstack_visual_indexes)")
        return torch.cat([embeds, *deepstack], dim=-1)
