"""Continuous batching: each step packs running sequences first (decodes and unfinished
prefill chunks), then admits waiting ones, under a token budget and a sequence cap.

NOTE: preemption is by recompute. When a running sequence needs a block and none is free,
the most recently admitted running sequence loses its blocks and goes back to the front of
the waiting queue (its full blocks stay in the prefix cache, so recompute often hits)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

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
    # decode steps replayed from CUDA graphs: "auto" = on CUDA with the Triton attention;
    # "eager" = the graph path's static buffers run uncaptured, on any device (CPU tests)
    cuda_graphs: Literal["auto", "off", "eager"] = "auto"
    prefill_graphs: bool = True  # one-sequence prefills through padded graphs (with graphs)
    graph_warmup: bool = True  # capture every batch size at startup, not at first use
    # with graph_warmup: "full" = every decode batch size at load; "lazy" = sizes <= 4 at load,
    # the others when no stage of the process has work (runtime idle passes; a step of a size
    # not captured yet replays a captured larger size or runs eagerly)
    graph_warmup_plan: Literal["full", "lazy"] = "full"
    compile: bool = True  # torch.compile the layers' norm/rope/MLP kernels (CUDA)
    async_scheduling: bool = True  # launch the next decode step before collecting tokens
    fast_sampler: bool = True  # the Triton sampler kernels (CUDA); else the torch reference
    pdl: bool = True  # programmatic dependent launch of the decode kernels (Hopper+)
    fused_rope_kv: bool = True  # rope + paged KV write in one Triton launch (CUDA)
    triton_gemv: bool = True  # 1-row decode steps' dense parts as Triton GEMVs (tuned shapes)
    gemv_fused_reduce: bool = True  # split-K GEMVs sum their partials in the same launch
    ar_stream: str | None = None  # AR stages of one name share a CUDA stream; None: own one
    # tensor parallelism (engine/ar/tp.py): ranks of this stage's model and their devices in
    # rank order (runtime/build.py records the stage's placement here; None: one rank)
    tensor_parallel_size: int = 1
    devices: tuple[str, ...] | None = None

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
        if self.graph_warmup_plan not in ("full", "lazy"):
            raise ValueError(f"graph_warmup_plan: 'full' or 'lazy', got "
                             f"{self.graph_warmup_plan!r}")
        if self.cuda_graphs not in ("auto", "off", "eager"):
            raise ValueError(f"cuda_graphs: {self.cuda_graphs!r}; expected auto, off or eager")
        for name in BOOL_SWITCHES:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be a bool, got {getattr(self, name)!r}")
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or not 1 <= tp <= 64:
            raise ValueError(f"tensor_parallel_size: an integer in [1, 64], got {tp!r}")
        if self.devices is not None and len(self.devices) != tp:
            raise ValueError(f"tensor_parallel_size: {tp}, but devices lists "
                             f"{len(self.devices)}: one device per rank")
        if self.ar_stream is not None and (not isinstance(self.ar_stream, str)
                                           or not self.ar_stream):
            raise ValueError(f"ar_stream: a non-empty name or None, got {self.ar_stream!r}")


# EngineConfig's engine/kernel on-off switches (each also an option of engine_config)
BOOL_SWITCHES = ("prefill_graphs", "graph_warmup", "compile", "async_scheduling",
                 "fast_sampler", "pdl", "fused_rope_kv", "triton_gemv", "gemv_fused_reduce")


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
        # request ids that alone may be scheduled (None: all); the runtime sets it to re-run
        # the requests of a step that raised one at a time (StageHost.recover)
        self.only: frozenset[str] | None = None

    def _allowed(self, seq: Sequence) -> bool:
        return self.only is None or seq.request_id in self.only

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
            if n <= 0 or not self._allowed(seq):  # gated: waits for its next input row
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
            if not self._allowed(seq):
                skipped.append(seq)
                continue
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
        if self.only is not None or self.waiting or len(self.running) != len(seqs) \
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


def engine_config(model_max_len: int, *, max_model_len: int | None = None,
                  max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                  block_size: int | None = None, num_kv_blocks: int | None = None,
                  kv_cache_memory_fraction: float | None = None,
                  enable_prefix_caching: bool = True,
                  enable_chunked_prefill: bool = True, cuda_graphs: str | None = None,
                  prefill_graphs: bool | None = None, graph_warmup: bool | None = None,
                  graph_warmup_plan: str | None = None,
                  compile: bool | None = None, async_scheduling: bool | None = None,
                  fast_sampler: bool | None = None, pdl: bool | None = None,
                  fused_rope_kv: bool | None = None, triton_gemv: bool | None = None,
                  gemv_fused_reduce: bool | None = None,
                  ar_stream: str | None = None, tensor_parallel_size: int | None = None,
                  devices: list[str] | tuple[str, ...] | None = None) -> EngineConfig:
    """The engine's config; an option left None takes EngineConfig's default."""
    switches = dict(cuda_graphs=cuda_graphs, prefill_graphs=prefill_graphs,
                    graph_warmup=graph_warmup, graph_warmup_plan=graph_warmup_plan,
                    compile=compile,
                    async_scheduling=async_scheduling, fast_sampler=fast_sampler, pdl=pdl,
                    fused_rope_kv=fused_rope_kv, triton_gemv=triton_gemv,
                    gemv_fused_reduce=gemv_fused_reduce, ar_stream=ar_stream,
                    tensor_parallel_size=tensor_parallel_size,
                    devices=None if devices is None else tuple(devices))

    def pick(value, default):
        return default if value is None else value

    max_len = pick(max_model_len, min(model_max_len, 32768))
    if isinstance(max_len, int) and max_len > model_max_len:
        raise ValueError(f"max_model_len: {max_len} exceeds the model's "
                         f"max_position_embeddings {model_max_len}")
    default_budget = max_len if not enable_chunked_prefill else 2048
    cfg = EngineConfig(
        max_model_len=max_len, max_num_seqs=pick(max_num_seqs, 64),
        max_num_batched_tokens=pick(max_num_batched_tokens, default_budget),
        block_size=pick(block_size, 16), num_kv_blocks=num_kv_blocks,
        kv_cache_memory_fraction=kv_cache_memory_fraction,
        enable_prefix_caching=bool(enable_prefix_caching),
        enable_chunked_prefill=bool(enable_chunked_prefill),
        **{k: v for k, v in switches.items() if v is not None})
    cfg.validate()
    return cfg
