"""Tensor parallelism inside an AR stage: the rank's group and its collectives, how each weight
is split over the ranks, and the vocab-parallel embedding and LM head.

NOTE (layout, Megatron's): every decoder layer does two all-reduces. q/k/v and gate/up are
column-parallel (each rank holds a contiguous block of output rows: its heads, its slice of the
intermediate size), so attention and the SiLU gate run on local data; o_proj and down_proj are
row-parallel (each rank holds the matching block of input columns), so each rank's product is a
partial sum that one all-reduce completes; their biases are added once, after the reduce. The
fused q/k/v and gate/up weights of a rank are the concatenation of its own q, k, v (gate, up)
rows. KV heads: with size <= num_kv_heads each rank holds num_kv_heads / size of them; with
size > num_kv_heads each rank holds the one KV head its query heads read (replicated on
size / num_kv_heads ranks), so the tiny checkpoints (2 KV heads) run at TP=4.
The embedding and the LM head are split over the vocabulary (rows padded to a multiple of the
size): the embedding zeroes ids outside its rows and all-reduces, the head all-gathers its
logits columns, so every rank holds the same full logits.

A model is built sharded by constructing it inside `tensor_parallel(tp)`: constructors read
`current_tp()`. Checkpoint loading (checkpoint.load_parameters) finds each sharded parameter's
`tp_shard` and copies only its slice.

All-reduces: the group's own (NCCL on GPUs, gloo on the CPU), or, on CUDA ranks with peer
access (engine option tp_all_reduce), a one-shot kernel over symmetric memory for the small
tensors of decode steps (layers/symm_all_reduce.py), captured in the decode graphs like NCCL's."""

from __future__ import annotations

import contextlib
import contextvars
import datetime
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(eq=False)
class TensorParallel:
    """This process's place in a stage's tensor-parallel group. `group` is a c10d backend
    (ProcessGroupGloo on CPU, ProcessGroupNCCL on CUDA) of `size` ranks; None when size is 1
    or once released. Collectives must be called by every rank in the same order. One object
    per group, shared by the stage's model, runner and workers' handle, so release() reaches
    them all."""

    rank: int = 0
    size: int = 1
    group: Any = None
    store: Any = None  # the group's TCPStore (kept alive with it)
    # the one-shot all-reduce over symmetric memory (layers/symm_all_reduce.py: CUDA ranks
    # with peer access, tp_all_reduce "auto" or "symm_mem"); None: the group's all-reduce
    symm: Any = None

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def release(self) -> None:
        """Drop the (shut) group, its store and the one-shot all-reduce. Python holds the only
        references to them, so their C++ destructors run now: NCCL's watchdog and heartbeat
        threads and the store server's thread end with the stage, not in the interpreter's
        finalisation, however long the closed runner lives."""
        self.group = self.store = self.symm = None

    def _group(self):
        if self.group is None:
            raise RuntimeError("tensor parallel: the group is shut")
        return self.group

    @property
    def all_reduce_mode(self) -> str:
        """"symm_mem" (one-shot for the tensors it accepts, the group's otherwise) or "nccl"
        (the group's own: NCCL, or gloo on the CPU)."""
        return "nccl" if self.symm is None else "symm_mem"

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Sums (or takes the min or max of) x over the ranks, in place; returns x."""
        if not self.enabled:
            return x
        if self.symm is not None and op == "sum" and self.symm.accepts(x):
            return self.symm(x)
        import torch.distributed as dist
        opts = dist.AllreduceOptions()
        opts.reduceOp = getattr(dist.ReduceOp, op.upper())  # SUM, MIN or MAX
        self._group().allreduce([x], opts).wait()
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] per rank -> [..., size * n], rank order."""
        if not self.enabled:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._group().allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x into every rank's x (in place); returns x."""
        if self.enabled:
            import torch.distributed as dist
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            self._group().broadcast([x], opts).wait()
        return x


SINGLE = TensorParallel()
_CURRENT: contextvars.ContextVar[TensorParallel] = contextvars.ContextVar("omnistage_tp",
                                                                          default=SINGLE)


@contextlib.contextmanager
def tensor_parallel(tp: TensorParallel) -> Iterator[TensorParallel]:
    """Models constructed (and checkpoints read) inside are this rank's shard."""
    token = _CURRENT.set(tp)
    try:
        yield tp
    finally:
        _CURRENT.reset(token)


def current_tp() -> TensorParallel:
    return _CURRENT.get()


def new_group(backend: str, rank: int, size: int, host: str, port: int,
              timeout_s: float, all_reduce: str = "nccl",
              device: torch.device | None = None) -> TensorParallel:
    """Rank `rank` of a group of `size` whose store rank 0 serves on host:port: a c10d backend
    not registered as torch.distributed's default group (several stages of one process can
    each have one). Blocks until every rank joined (or the timeout). all_reduce: the mode
    symm_all_reduce.resolve_mode chose for the group (the same on every rank); "symm_mem" or
    "auto" (NCCL only) also set up the one-shot all-reduce on `device`, collectively."""
    import torch.distributed as dist
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, size, rank == 0, timeout=timeout)
    if backend == "gloo":
        group = dist.ProcessGroupGloo(store, rank, size, timeout)
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        group = dist.ProcessGroupNCCL(store, rank, size, opts)
    else:
        raise ValueError(f"backend: {backend!r}; expected gloo or nccl")
    symm = None
    if backend == "nccl" and all_reduce in ("auto", "symm_mem"):
        from omnistage.layers.symm_all_reduce import (AUTO_MAX_BYTES, BUFFER_BYTES,
                                                      SymmAllReduce)
        limit = AUTO_MAX_BYTES if all_reduce == "auto" else BUFFER_BYTES
        symm = SymmAllReduce(store, rank, size, device or torch.device("cuda"), limit, group)
    return TensorParallel(rank, size, group, store, symm)


# ------------------------------------------------------------------------- how weights split
def _size_error(what: str, value: int, tp: int, extra: str = "") -> ValueError:
    return ValueError(f"tensor_parallel_size: {tp} does not divide {what} ({value}){extra}")


def split(total: int, tp: TensorParallel, what: str) -> tuple[int, int]:
    """(start, length) of this rank's equal block of `total` rows; ValueError naming
    tensor_parallel_size when it does not divide."""
    if total % tp.size:
        raise _size_error(what, total, tp.size)
    n = total // tp.size
    return tp.rank * n, n


@dataclass(frozen=True)
class HeadLayout:
    """One rank's attention heads: its query heads [q_start, q_start + num_heads) and KV heads
    [kv_start, kv_start + num_kv_heads) of the whole model's."""

    num_heads: int
    num_kv_heads: int
    q_start: int
    kv_start: int


def head_layout(num_heads: int, num_kv_heads: int, tp: TensorParallel) -> HeadLayout:
    """Query heads split evenly; KV heads split, or replicated when the size exceeds them (each
    rank keeps the KV head its query heads read)."""
    q_start, local = split(num_heads, tp, "num_attention_heads")
    if num_kv_heads >= tp.size:
        kv_start, local_kv = split(num_kv_heads, tp, "num_key_value_heads")
        return HeadLayout(local, local_kv, q_start, kv_start)
    if tp.size % num_kv_heads:
        raise _size_error("num_key_value_heads", num_kv_heads, tp.size,
                          " and is larger: it must then be a multiple of it")
    group = num_heads // num_kv_heads  # query heads per KV head
    return HeadLayout(local, 1, q_start, q_start // group)


class Shard:
    """How one parameter of this rank is cut from the checkpoint's whole tensor: `pieces` are
    (start, length) blocks along `dim`, concatenated (one block, or the gate and up halves of
    a fused gate_up). Rows past the whole tensor's end (vocab padding) stay zero."""

    def __init__(self, dim: int, pieces: list[tuple[int, int]], full_shape: tuple[int, ...],
                 keep_full: Callable[[torch.Tensor], None] | None = None) -> None:
        self.dim, self.pieces, self.full_shape = dim, pieces, tuple(full_shape)
        self.keep_full = keep_full  # gets the whole tensor too (rank 0's embedding table)

    def take(self, tensor: Any) -> torch.Tensor:
        """This rank's part of `tensor` (a torch.Tensor, or checkpoint.LazyTensor: only the
        slices are read)."""
        if tuple(tensor.shape) != self.full_shape:
            raise ValueError(f"shape {tuple(tensor.shape)}, expected {list(self.full_shape)} "
                             "(the whole, unsharded tensor)")
        if self.keep_full is not None:
            self.keep_full(tensor if isinstance(tensor, torch.Tensor) else tensor.full())
        parts = []
        for start, length in self.pieces:
            avail = max(0, min(length, self.full_shape[self.dim] - start))
            part = tensor.narrow(self.dim, start, avail) if avail else None
            if avail < length:  # padding rows
                shape = list(self.full_shape)
                shape[self.dim] = length - avail
                pad = torch.zeros(shape, dtype=tensor.dtype)
                part = pad if part is None else torch.cat([part, pad.to(part.device)], self.dim)
            parts.append(part)
        return parts[0] if len(parts) == 1 else torch.cat(parts, self.dim)


def mark_shard(param: nn.Parameter, dim: int, pieces: list[tuple[int, int]],
               full_shape: tuple[int, ...], keep_full=None) -> nn.Parameter:
    param.tp_shard = Shard(dim, pieces, full_shape, keep_full)
    return param


def column_linear(in_features: int, out_full: int, pieces: list[tuple[int, int]],
                  bias: bool) -> nn.Linear:
    """A linear holding the output rows `pieces` of the whole [out_full, in] weight."""
    out = sum(n for _, n in pieces)
    lin = nn.Linear(in_features, out, bias=bias)
    mark_shard(lin.weight, 0, pieces, (out_full, in_features))
    if bias:
        mark_shard(lin.bias, 0, pieces, (out_full,))
    return lin


def row_linear(in_full: int, out_features: int, start: int, length: int, bias: bool) -> nn.Linear:
    """A linear holding the input columns [start, start + length) of the whole weight; its
    product is a partial sum (all-reduce it, then add the bias, which is whole)."""
    lin = nn.Linear(length, out_features, bias=bias)
    mark_shard(lin.weight, 1, [(start, length)], (out_features, in_full))
    return lin


def vocab_rows(vocab_size: int, tp: TensorParallel) -> tuple[int, int]:
    """(start, length) of this rank's vocabulary rows (padded: size * length >= vocab_size)."""
    per = -(-vocab_size // tp.size)
    return tp.rank * per, per


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the token table; forward() is collective (every rank, same ids).
    Rank 0 also keeps the whole table (`full_table`) for lookups outside a step (lookup():
    the talker adapters read thinker embedding rows between steps, on rank 0 only)."""

    def __init__(self, vocab_size: int, dim: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp, self.vocab_size, self.embedding_dim = tp, vocab_size, dim
        self.start, self.rows = vocab_rows(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(self.rows, dim))
        keep = self._keep_full if tp.rank == 0 else None
        mark_shard(self.weight, 0, [(self.start, self.rows)], (vocab_size, dim), keep)
        self.register_buffer("full_table", None, persistent=False)

    def _keep_full(self, whole: torch.Tensor) -> None:
        self.full_table = whole.to(self.weight.device, self.weight.dtype).clone()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        rows = rows.masked_fill(outside[:, None], 0)
        return self.tp.all_reduce(rows)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the whole table, without a collective (rank 0)."""
        if self.full_table is None:
            raise RuntimeError("lookup: only rank 0 of a tensor-parallel group holds the "
                               "whole embedding table")
        return F.embedding(ids, self.full_table)


class ParallelLMHead(nn.Module):
    """The LM head split over the vocabulary; forward() is collective: this rank's logits
    columns, all-gathered -> [N, vocab_size] on every rank. `weight` may be the embedding's
    (tied: the same padded rows)."""

    def __init__(self, dim: int, vocab_size: int, tp: TensorParallel,
                 tied: VocabParallelEmbedding | None = None) -> None:
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        if tied is not None:
            self.weight = tied.weight
        else:
            start, rows = vocab_rows(vocab_size, tp)
            self.weight = nn.Parameter(torch.empty(rows, dim))
            mark_shard(self.weight, 0, [(start, rows)], (vocab_size, dim))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = F.linear(hidden, self.weight)
        return self.tp.all_gather_last(local)[..., :self.vocab_size]


def quantize_fp8_row_parallel(w: torch.Tensor, tp: TensorParallel
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """layers.fp8.quantize_fp8 of a row-parallel weight [..., N, K / size] (this rank's input
    columns of each output row) with the whole row's scale: the row amax is max-reduced over
    the ranks (collective), so each rank's e4m3 values are its slice of TP=1's and its scales
    are TP=1's (a scale per slice would quantise differently from one rank)."""
    from omnistage.layers.fp8 import quantize_fp8
    return quantize_fp8(w, lambda amax: tp.all_reduce(amax, "max"))
