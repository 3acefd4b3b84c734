"""A request inside one AR stage: its tokens, KV blocks, and optional non-token inputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

import torch

from omnistage.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class InputSource(Protocol):
    """Rows a stage adapter supplies per position (e.g. the talker's thinker rows).

    ready(seq) -> how many positions (from 0) have their input row; positions at or past it are
    gated. rows(seq, start, end) -> (rows [end-start, D] on device, replace [end-start] bool or
    None): where `replace` is True a row replaces the token embedding, elsewhere it is added."""

    def ready(self, seq: Sequence) -> int: ...

    def rows(self, seq: Sequence, start: int, end: int
             ) -> tuple[torch.Tensor, torch.Tensor | None]: ...


@dataclass
class MediaSpan:
    """Placeholder positions [start, end) whose KV depends on media content, not just ids."""

    start: int
    end: int
    content_hash: bytes


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    stop_token_ids: frozenset[int] = frozenset()
    # prompt rows replacing token embeddings (encoder outputs), device tensors
    prompt_embeds: torch.Tensor | None = None  # [P, D]
    prompt_embeds_mask: torch.Tensor | None = None  # [P] bool
    media: list[MediaSpan] = field(default_factory=list)
    mrope_positions: torch.Tensor | None = None  # [3, P] long; later positions: i + rope_delta
    rope_delta: int = 0
    input_source: InputSource | None = None
    pending_media: Any = None  # model-specific encoder inputs, encoded when first scheduled
    forced_output_ids: list[int] | None = None  # emit exactly these instead of sampling
    export_hidden: bool = False
    export_prompt_only: bool = False  # with export_hidden: only prompt positions' rows
    cacheable: bool = True  # False when the KV depends on inputs the hash cannot see
    # ids the prefix-cache hash takes for the first positions instead of the ids fed there: a
    # stage whose prompt KV is set by another stage's prompt (the talker's, by the thinker's)
    hash_token_ids: list[int] | None = None
    penalize_prompt: bool = True  # repetition penalty over prompt ids too (transformers' rule)
    grammar: Any = None  # structured output: its structured_output.GrammarMatcher (engine-set)
    arrival: int = 0  # FCFS order

    # state
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of full blocks, in order
    finish_reason: str | None = None
    error: str | None = None
    output_text: str = ""
    num_preemptions: int = 0
    # multi-codebook models: per output token, the summed embeddings of its other codebooks
    # (added to its input row when it is fed back)
    residual_embeds: list[torch.Tensor] = field(default_factory=list)
    # hidden-row export with the prefix cache (BlockManager.export_rows): the rows of a fresh
    # hit, handed on with the first computed step; exported rows of a block not yet full
    cached_rows: torch.Tensor | None = None
    # (first position, row pieces in order, rows in all): BlockManager._keep_rows says why
    row_tail: tuple[int, list[torch.Tensor], int] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_id(self, i: int) -> int:
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[i] if i < p else self.output_token_ids[i - p]

    def hash_token_id(self, i: int) -> int:
        """The id position i contributes to its block's prefix-cache hash."""
        h = self.hash_token_ids
        return h[i] if h is not None and i < len(h) else self.token_id(i)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def ready_tokens(self) -> int:
        """Positions whose inputs exist (the gate for stages fed row by row)."""
        if self.input_source is None:
            return self.num_tokens
        return min(self.num_tokens, self.input_source.ready(self))
