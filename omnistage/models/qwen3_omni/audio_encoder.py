"""Qwen3-Omni thinker audio encoder ("AuT"): a conv2d stem per chunk of mel frames, then windowed
self-attention, then a two-layer head.

Parameter names mirror the checkpoint's `thinker.audio_tower.*` with that prefix stripped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.checkpoint import load_parameters
from omnistage.models.qwen2_5_omni.audio_encoder import (
    Qwen2_5OmniAudioEncoderLayer,
    build_segment_plan,
    sinusoid_positions,
    validate_features,
)

AUDIO_CHECKPOINT_PREFIX = "thinker.audio_tower."

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


def activation(name: str, field: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation called `name` in a transformers config; ValueError names `field`."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"{field} {name!r} is not one of {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def _conv_stem_length(frames: int) -> int:
    """Rows left after the stem's three stride-2 convs (kernel 3, padding 1): ceil-halve x3."""
    for _ in range(3):
        frames = (frames + 1) // 2
    return frames


class Qwen3OmniAudioEncoderLayer(Qwen2_5OmniAudioEncoderLayer):
    """Qwen2.5-Omni's audio encoder layer with a biased k_proj and the config's activation."""

    def __init__(self, dim: int, num_heads: int, ffn_dim: int,
                 act: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__(dim, num_heads, ffn_dim, act, key_bias=True)


class Qwen3OmniAudioEncoder(nn.Module):
    """Mel features -> audio embeddings in the thinker's hidden size.

    NOTE: each audio's frames are cut into chunks of `2 * n_window` frames (1 s); every chunk goes
    through the conv stem alone (3 stride-2 conv2d over mel x time, 8x fewer rows) and gets
    positions 0.. of its own. The rows of one audio are then re-joined and attend within windows
    of `n_window_infer` frames' worth of rows (the last window of an audio is shorter).
    The last, partial chunk of an audio longer than one chunk is zero-padded to a full chunk
    before the stem (its convs see that padding), as transformers does whenever the batch holds a
    full chunk; an audio shorter than one chunk is not padded, as transformers does for it alone.
    So an audio's embeddings never depend on the other audios of the call.
    """

    def __init__(self, audio_config: dict[str, Any]) -> None:
        super().__init__()
        config = audio_config
        dim = config["d_model"]
        self.num_mel_bins = config["num_mel_bins"]
        self.n_window = config["n_window"]
        self.n_window_infer = config["n_window_infer"]
        self.conv_chunksize = config.get("conv_chunksize", 500)
        if self.n_window < 1:
            raise ValueError(f"audio_config.n_window must be >= 1, got {self.n_window}")
        chunk = 2 * self.n_window
        if self.n_window_infer < chunk:
            raise ValueError(f"audio_config.n_window_infer {self.n_window_infer} must be >= "
                             f"2 * n_window = {chunk}")
        if self.conv_chunksize < 1:
            raise ValueError(f"audio_config.conv_chunksize must be >= 1, got {self.conv_chunksize}")
        self.rows_per_chunk = _conv_stem_length(chunk)
        # windows cover whole chunks: n_window_infer is rounded down to a multiple of the chunk
        self.rows_per_window = self.rows_per_chunk * (self.n_window_infer // chunk)
        max_positions = config["max_source_positions"]
        if self.rows_per_chunk > max_positions:
            raise ValueError(f"audio_config.n_window {self.n_window} gives {self.rows_per_chunk} "
                             f"rows per chunk, more than max_source_positions {max_positions}")
        act = activation(config.get("activation_function", "gelu"),
                         "audio_config.activation_function")

        stem = config["downsample_hidden_size"]
        self.conv2d1 = nn.Conv2d(1, stem, kernel_size=3, stride=2, padding=1)
        self.conv2d2 = nn.Conv2d(stem, stem, kernel_size=3, stride=2, padding=1)
        self.conv2d3 = nn.Conv2d(stem, stem, kernel_size=3, stride=2, padding=1)
        self.conv_out = nn.Linear(stem * _conv_stem_length(self.num_mel_bins), dim, bias=False)
        self.register_buffer("positional_embedding", sinusoid_positions(max_positions, dim),
                             persistent=False)
        self.layers = nn.ModuleList(
            Qwen3OmniAudioEncoderLayer(dim, config["encoder_attention_heads"],
                                       config["encoder_ffn_dim"], act)
            for _ in range(config["encoder_layers"]))
        self.ln_post = nn.LayerNorm(dim)
        self.proj1 = nn.Linear(dim, dim)
        self.act = act
        self.proj2 = nn.Linear(dim, config["output_dim"])

    @staticmethod
    def num_tokens(frames: int, n_window: int = 50) -> int:
        """Embeddings (= placeholder tokens) from an audio of `frames` mel frames.

        Equals transformers' `_get_feat_extract_output_lengths` for the n_window values it
        supports (49..52: it hard-codes 13 rows per full chunk); exact for any n_window here.
        """
        if frames < 0 or n_window < 1:
            raise ValueError(f"num_tokens needs frames >= 0 and n_window >= 1, got {frames}, "
                             f"{n_window}")
        full_chunks, tail = divmod(frames, 2 * n_window)
        return full_chunks * _conv_stem_length(2 * n_window) + _conv_stem_length(tail)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads checkpoint tensors named as `thinker.audio_tower.*` or without that prefix."""
        load_parameters(self, named_tensors,
                        rename=lambda name: name.removeprefix(AUDIO_CHECKPOINT_PREFIX))

    def _stem(self, chunks: torch.Tensor) -> torch.Tensor:
        # chunks: [C, mel, L] -> [C, L', dim] (L' = rows after the stem, positions added)
        x = chunks.unsqueeze(1).to(self.conv2d1.weight.dtype)
        # bounded batches of chunks keep the first conv's activations small on long audio
        parts = []
        for part in x.split(self.conv_chunksize):
            part = F.gelu(self.conv2d1(part))
            part = F.gelu(self.conv2d2(part))
            parts.append(F.gelu(self.conv2d3(part)))
        x = torch.cat(parts)  # [C, channels, mel', L']
        x = self.conv_out(x.permute(0, 3, 1, 2).flatten(2))  # time-major, (channel, mel') rows
        return x + self.positional_embedding[: x.shape[1]].to(x.dtype)

    def _embed_chunks(self, features: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
        # -> rows [sum_i num_tokens_i, dim] in audio and chunk order, and rows per audio
        chunk = 2 * self.n_window
        pieces: list[torch.Tensor] = []
        rows_per_piece: list[int] = []
        for f in features:
            split = list(f.split(chunk, dim=1))
            rows_per_piece += [_conv_stem_length(p.shape[1]) for p in split]
            if len(split) > 1 and split[-1].shape[1] < chunk:
                split[-1] = F.pad(split[-1], (0, chunk - split[-1].shape[1]))
            pieces += split
        device = features[0].device
        rows_per_audio = [self.num_tokens(f.shape[1], self.n_window) for f in features]
        starts = torch.tensor([0, *rows_per_piece[:-1]]).cumsum(0)
        out: torch.Tensor | None = None
        # pieces of equal (padded) length share one stem call: all full chunks in one batch
        by_length: dict[int, list[int]] = {}
        for index, piece in enumerate(pieces):
            by_length.setdefault(piece.shape[1], []).append(index)
        for indexes in by_length.values():
            emb = self._stem(torch.stack([pieces[i] for i in indexes]))  # [k, L', dim]
            if out is None:
                out = emb.new_empty(sum(rows_per_audio), emb.shape[-1])
            offsets = torch.arange(emb.shape[1])
            valid = offsets < torch.tensor([rows_per_piece[i] for i in indexes])[:, None]
            rows = (starts[indexes][:, None] + offsets)[valid].to(device)
            out.index_copy_(0, rows, emb[valid.to(device)])
        return out, rows_per_audio

    def forward(self, features: list[torch.Tensor]) -> list[torch.Tensor]:
        # features[i]: [num_mel_bins, frames_i] (valid frames only) -> per audio [N_i, output_dim]
        validate_features(features, self.num_mel_bins)
        x, rows_per_audio = self._embed_chunks(features)
        windows = []
        for rows in rows_per_audio:
            full, rest = divmod(rows, self.rows_per_window)
            windows += [self.rows_per_window] * full + ([rest] if rest else [])
        plan = build_segment_plan(windows, x.device)
        for layer in self.layers:
            x = layer(x, plan)
        out = self.proj2(self.act(self.proj1(self.ln_post(x))))
        return list(out.split(rows_per_audio))
