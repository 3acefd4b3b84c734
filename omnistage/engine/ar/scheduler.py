"""Continuous batching: each step packs running sequences first (decodes and unfinished
prefill chunks), then admits waiting ones, under a token budget and a sequence cap.

NOTE: preemption is by recompute. When a running sequence needs a block and none is free,
the most recently admitted running sequence loses its blocks and goes back to the front of
the waiting queue (its full blocks stay in the prefix cache, so recompute often hits)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from omnistage.engine.ar.block_manager import BlockManager
from omnistage.engine.ar.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class EngineConfig:
    max_model_len: int = 4096
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_fraction: float | None = None  # of free device memory, when num_kv_blocks unset
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True

    def validate(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {v!r}")
        if self.block_size > 1024:
            raise ValueError(f"block_size: at most 1024, got {self.block_size}")
        if self.num_kv_blocks is not None and (not isinstance(self.num_kv_blocks, int)
                                               or self.num_kv_blocks < 2):
            raise ValueError(f"num_kv_blocks: must be an integer >= 2, got {self.num_kv_blocks!r}")
        f = self.kv_cache_memory_fraction
        if f is not None and not 0 < f <= 0.95:
            raise ValueError(f"kv_cache_memory_fraction: must be in (0, 0.95], got {f}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("max_num_batched_tokens: must be >= max_model_len when chunked "
                             "prefill is off (a whole prompt must fit in one step)")


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_tokens: list[int]  # new tokens per seq this step (1 for a decode)
    # async scheduling: positions start this far past num_computed_tokens (the step was
    # launched before the previous step's tokens came back)
    ahead: int = 0

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.blocks = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        budget = self.config.max_num_batched_tokens
        batch = ScheduledBatch([], [])
        # 1. running sequences, oldest first
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.ready_tokens() - seq.num_computed_tokens, budget)
            if n <= 0:  # gated: waits for its next input row
                i += 1
                continue
            total = seq.num_computed_tokens + n
            while not self.blocks.can_allocate(seq, total):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                break  # preempted itself: nothing after it is left either
            self.blocks.allocate(seq, total)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n
            i += 1
        # 2. waiting sequences, FCFS; a gated one does not block the ones behind it
        skipped: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting.popleft()
            cached = self.blocks.match_prefix(seq) if not seq.block_table else []
            start = len(cached) * self.blocks.block_size if cached else seq.num_computed_tokens
            n = seq.ready_tokens() - start
            if n <= 0:
                skipped.append(seq)
                continue
            if n > budget and not self.config.enable_chunked_prefill:
                self.waiting.appendleft(seq)
                break
            n = min(n, budget)
            if not self.blocks.can_allocate(seq, start + n, cached):
                self.waiting.appendleft(seq)
                break
            if cached:
                self.blocks.take_cached(seq, cached)
            self.blocks.allocate(seq, start + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        return batch if batch.seqs else None

    def schedule_ahead(self, seqs: list[Sequence]) -> ScheduledBatch | None:
        """Async scheduling: the decode step after the one in flight for `seqs`, when it is
        the step schedule() would make then: nothing waiting, exactly these sequences running
        (each sampled in that step), each next position's input row ready, and its KV blocks
        free without preemption."""
        if self.waiting or len(self.running) != len(seqs) \
                or any(a is not b for a, b in zip(self.running, seqs)):
            return None
        need = 0
        for seq in seqs:
            nxt = seq.num_computed_tokens + 1  # prev's position + 1
            if nxt != seq.num_tokens or (seq.input_source is not None
                                         and seq.input_source.ready(seq) <= nxt):
                return None
            need += self.blocks.blocks_needed(seq, nxt + 1)
        if need > self.blocks.num_free_blocks:
            return None
        for seq in seqs:
            self.blocks.allocate(seq, seq.num_computed_tokens + 2)
        return ScheduledBatch(list(seqs), [1] * len(seqs), ahead=1)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Free the seq's blocks and drop it from the queues (abort, stop, error)."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = seq.finish_reason or reason
