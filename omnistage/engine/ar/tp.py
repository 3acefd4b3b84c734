"""Tensor parallelism of an AR stage: rank 0 schedules, ranks 1..N-1 run the same forward.

NOTE (one step on every rank): rank 0's AREngine schedules and prepares each step as usual;
before its forward, the ModelRunner broadcasts the step through the group (StepChannel) as a
typed message: a fixed int64 header, then the step's tensors, no pickled objects. An eager step
carries the ForwardBatch rank 0 prepared (ids, positions, slots, block tables, replacement and
additive rows) and the rows whose logits it takes; a graphed decode step carries the decode
graphs' static int inputs (DecodeGraphs' layout, copied device to device: a step launched
ahead sends the ids rank 0 sampled on the device) and its staged rows. Every rank then runs the
same collectives in the same order: the forward's all-reduces, and the logits all-gather.
(On CUDA ranks with peer access the small all-reduces may be one-shot kernels over symmetric
memory instead of NCCL's: the tp_all_reduce engine option, layers/symm_all_reduce.py.)
Captures (and their warm-up runs) happen at the same step on every rank: the graphs' keys are
the same. Media encoders run on rank 0 only (their rows travel in the message).

Sampling: only rank 0 samples. Every rank holds the same full logits (all-gathered), but the
other ranks never draw: their next inputs come from rank 0's next message, so tokens cannot
diverge. Under CUDA graphs the forward graph of a rank also gathers the logits of every row
(TPGraphModel), so the head graphs (the sampler) hold no collective and rank 0 captures them
alone; each rank's decode step is one forward graph with its all-reduces inside.

The worker ranks' processes (their pool, start and ordered shutdown): engine/ar/tp_workers.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from omnistage.engine.ar.attention import AttentionMetadata
from omnistage.engine.ar.interface import ForwardBatch
from omnistage.layers.parallel import TensorParallel

KIND_EAGER, KIND_GRAPH, KIND_STOP = 1, 2, 3
HEADER_LEN = 12
_ROW_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# ------------------------------------------------------------------------- step messages
@dataclass
class EagerStep:
    """An eager forward: rank 0's ForwardBatch (tensors on the stage device) and the rows
    whose logits it computes (sample_rows [S] long, device)."""

    batch: ForwardBatch
    sample_rows: torch.Tensor


@dataclass
class GraphStep:
    """A decode step replayed from the graphs of padded size `size`: DecodeGraphs' static
    ints [count] int32 (device), and the staged rows: embeds [size, W] + embeds_mask [size]
    bool, additive [size, W2] (model dtype, device), or None."""

    ints: torch.Tensor
    size: int
    embeds: torch.Tensor | None
    embeds_mask: torch.Tensor | None
    additive: torch.Tensor | None


def _wire(t: torch.Tensor) -> torch.Tensor:
    # what goes through the backend: 2-byte floats as int16 bits (gloo has no bfloat16), bool as
    # uint8
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    if t.dtype in (torch.bfloat16, torch.float16):
        return t.contiguous().view(torch.int16)
    return t.contiguous()


class StepChannel:
    """Rank 0 -> the other ranks, by broadcast in the group. send_* on rank 0 and receive() on
    the others must pair up, in order."""

    def __init__(self, tp: TensorParallel, device: torch.device) -> None:
        self.tp, self.device = tp, device

    def _header(self, *fields: int) -> None:
        h = torch.zeros(HEADER_LEN, dtype=torch.long, device=self.device)
        h[:len(fields)] = torch.tensor(fields, dtype=torch.long)
        self.tp.broadcast(h)

    def _send(self, *tensors: torch.Tensor | None) -> None:
        for t in tensors:
            if t is not None:
                self.tp.broadcast(_wire(t))

    def _recv(self, shape, dtype: torch.dtype) -> torch.Tensor:
        wire = torch.uint8 if dtype == torch.bool else \
            torch.int16 if dtype in (torch.bfloat16, torch.float16) else dtype
        t = self.tp.broadcast(torch.empty(shape, dtype=wire, device=self.device))
        return t.to(torch.bool) if dtype == torch.bool else t.view(dtype)

    # ---------------------------------------------------------------- rank 0
    def send_eager(self, fb: ForwardBatch, sample_rows: list[int]) -> None:
        meta = fb.attn
        e, a = fb.inputs_embeds, fb.additive_embeds
        row_dtype = next((t.dtype for t in (e, a) if t is not None), torch.float32)
        self._header(KIND_EAGER, fb.input_ids.shape[0], meta.seq_lens.shape[0],
                     meta.block_tables.shape[1], len(sample_rows), int(fb.positions.dim() == 2),
                     0 if e is None else e.shape[1], 0 if a is None else a.shape[1],
                     meta.max_query_len, _ROW_DTYPES.index(row_dtype))
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        self._send(fb.input_ids, fb.positions, meta.slot_mapping, meta.query_start_loc,
                   meta.seq_lens, meta.block_tables, rows, e, fb.embeds_mask, a)

    def send_graph(self, graphs, count: int, size: int, embeds_rows: list, add_rows: list
                   ) -> None:
        """DecodeGraphs.before_forward on rank 0: the static ints it just filled, and the
        step's rows packed as its _stage_rows stages them (None rows: zero, unmasked)."""
        embeds = mask = additive = None
        if any(r is not None for r in embeds_rows):
            width = next(r[0].shape[-1] for r in embeds_rows if r is not None)
            embeds = torch.zeros(size, width, dtype=graphs.dtype, device=self.device)
            mask = torch.zeros(size, dtype=torch.bool, device=self.device)
            for i, r in enumerate(embeds_rows):
                if r is not None:
                    embeds[i:i + 1].copy_(r[0])
                    mask[i:i + 1].copy_(r[1])
        if any(r is not None for r in add_rows):
            width = next(r.shape[-1] for r in add_rows if r is not None)
            additive = torch.zeros(size, width, dtype=graphs.dtype, device=self.device)
            for i, r in enumerate(add_rows):
                if r is not None:
                    additive[i:i + 1].copy_(r)
        self._header(KIND_GRAPH, count, size, 0 if embeds is None else embeds.shape[1],
                     0 if additive is None else additive.shape[1],
                     _ROW_DTYPES.index(graphs.dtype))
        self._send(graphs.dev[:count], embeds, mask, additive)

    def send_stop(self) -> None:
        self._header(KIND_STOP)

    # ---------------------------------------------------------------- ranks 1..N-1
    def receive(self) -> EagerStep | GraphStep | None:
        """The next step (None: stop)."""
        h = self._recv((HEADER_LEN,), torch.long).tolist()
        kind = h[0]
        if kind == KIND_STOP:
            return None
        if kind == KIND_GRAPH:
            count, size, w_e, w_a, dt = h[1:6]
            dtype = _ROW_DTYPES[dt]
            ints = self._recv((count,), torch.int32)
            embeds = self._recv((size, w_e), dtype) if w_e else None
            mask = self._recv((size,), torch.bool) if w_e else None
            additive = self._recv((size, w_a), dtype) if w_a else None
            return GraphStep(ints, size, embeds, mask, additive)
        if kind != KIND_EAGER:
            raise RuntimeError(f"tensor parallel: unknown step message kind {kind}")
        T, n, max_blocks, S, mrope, w_e, w_a, max_q, dt = h[1:10]
        dtype = _ROW_DTYPES[dt]
        ids = self._recv((T,), torch.long)
        positions = self._recv((3, T) if mrope else (T,), torch.long)
        slots = self._recv((T,), torch.long)
        qsl = self._recv((n + 1,), torch.int32)
        seq_lens = self._recv((n,), torch.int32)
        tables = self._recv((n, max_blocks), torch.int32)
        rows = self._recv((S,), torch.long)
        embeds = self._recv((T, w_e), dtype) if w_e else None
        mask = self._recv((T,), torch.bool) if w_e else None
        additive = self._recv((T, w_a), dtype) if w_a else None
        q = qsl.tolist()
        meta = AttentionMetadata(slot_mapping=slots, query_start_loc=qsl, seq_lens=seq_lens,
                                 block_tables=tables,
                                 query_lens_cpu=[b - a for a, b in zip(q, q[1:])],
                                 seq_lens_cpu=seq_lens.tolist(), max_query_len=max_q,
                                 decode_only=max_q == 1)
        fb = ForwardBatch(input_ids=ids, positions=positions, attn=meta, inputs_embeds=embeds,
                          embeds_mask=mask, additive_embeds=additive)
        return EagerStep(fb, rows)


# ------------------------------------------------------------------------- executing a step
class TPGraphModel:
    """The model as DecodeGraphs sees it under tensor parallelism: its forward also takes the
    logits of every row (the all-gather inside the forward graph) into a buffer that
    compute_logits() reads back, so the head graphs hold no collective."""

    def __init__(self, model: torch.nn.Module, max_rows: int) -> None:
        self.__dict__["_model"] = model
        self.__dict__["max_rows"] = max_rows  # the largest graph's batch size
        # [max_rows, V] fp32, at the first (warm-up) run: one buffer that every forward and
        # head graph of every size reads and writes
        self.__dict__["logits"] = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_model"], name)

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        model = self.__dict__["_model"]
        hidden = model(batch)
        logits = model.compute_logits(hidden)
        if self.logits is None:  # the first run: a warm-up, before any capture
            self.__dict__["logits"] = torch.zeros(self.max_rows, logits.shape[1],
                                                  dtype=logits.dtype, device=logits.device)
        self.logits[:logits.shape[0]].copy_(logits)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits[:hidden.shape[0]]


@torch.inference_mode()
def run_step(runner, step: EagerStep | GraphStep) -> None:
    """A rank > 0 runs rank 0's step on its own shard (results stay on rank 0)."""
    if isinstance(step, EagerStep):
        hidden = runner.model(step.batch)
        if step.sample_rows.numel():
            runner.model.compute_logits(hidden[step.sample_rows])
        runner.num_forwards += 1
        return
    g, B = runner.graphs, step.size
    has_e, has_a = step.embeds is not None, step.additive is not None
    g.dev[:step.ints.shape[0]].copy_(step.ints)
    if has_e and g.embeds is None:
        g.embeds = torch.zeros(g.max_size, step.embeds.shape[1], dtype=g.dtype, device=g.device)
    if has_a and g.additive is None:
        g.additive = torch.zeros(g.max_size, step.additive.shape[1], dtype=g.dtype,
                                 device=g.device)
    key = (B, has_e, has_a)
    fwd = g.graphs.get(key)
    if fwd is None:  # rank 0 captures this key in this step too (same warm-up collectives)
        if has_e:
            g.embeds_mask[:B].zero_()
        if has_a:
            g.additive[:B].zero_()
        fwd = g.graphs[key] = g.capture_graph(
            lambda warm: g._forward(B, has_e, has_a, warm))
    if has_e:
        g.embeds[:B].copy_(step.embeds)
        g.embeds_mask[:B].copy_(step.embeds_mask)
    if has_a:
        g.additive[:B].copy_(step.additive)
    fwd.replay()
    runner.num_forwards += 1


def follow(runner) -> int:
    """A rank > 0's loop: rank 0's steps until it says stop; returns the steps run."""
    channel = StepChannel(runner.tp, runner.device)
    steps = 0
    while (step := channel.receive()) is not None:
        run_step(runner, step)
        steps += 1
    return steps
