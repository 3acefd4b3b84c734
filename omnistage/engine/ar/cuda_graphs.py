"""Decode steps replayed from CUDA graphs (GPU fast path of the ModelRunner).

A decode-only step of B sequences runs through graphs captured for the smallest captured size
>= B; rows past B are padding that writes its K/V into a dummy block the runner keeps beyond
the block manager's range. Two graphs per step, replayed back to back:
  forward (size, has replacement rows, has additive rows): the model -> hidden, copied into a
    static buffer outside the graph pool;
  head (size, SamplingFlags): logits of that hidden, the sampler on the SamplerState's device
    rows (penalties, bans, warpers, Gumbel draw), forced ids, the counts update -> B ids, then
    one D2H copy of B ints. Head key (size, None) = logits only (sampled eagerly: no sampler
    state, or its graph failed to capture).
Keying heads by the flags keeps sample()'s host branches fixed per graph (same ops as eager).

NOTE (logprobs): a step whose rows ask SamplingParams.logprobs replays a head graph keyed
(size, flags, L), L = the asking rows' count padded up to a batch size: inside the graph,
logprobs.row_logprobs gathers those rows (their indices in the static input buffer) before
the draw and packs their top-MAX_LOGPROBS after it; one more D2H copy beside the ids'. Steps
without them replay the L = 0 heads, unchanged. Such heads are captured at first use (not at
warm-up), so the first logprobs step of a size stalls for its capture.

Static inputs live in one int32 device buffer filled from a pinned host buffer by one
non_blocking copy per step: [ids M | positions 3M | slots M | seq_lens M | sample slots M |
steps M | forced ids M | logprob rows M | tables M x MB] (M = largest size, MB = blocks per
sequence at max_model_len). Graphs are captured lazily and share one memory pool: everything
read across graphs (hidden, ids, sampler state) lives outside it.

Async scheduling: a step may be launched before the previous one's tokens reached the host
(run(..., ahead=1)); its input ids are then copied on the device from the previous step's
sampled ids. Two steps can be in flight, so the pinned input and token buffers alternate.

EngineConfig.cuda_graphs="eager" runs this same static-buffer path without capturing (each
replay reruns the function), on any device: the CPU tests exercise the graph path's bookkeeping."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
import time
import warnings
from typing import Any

import numpy as np
import torch

from omnistage.engine.ar.attention import AttentionMetadata
from omnistage.engine.ar.logprobs import pack, row_logprobs
from omnistage.engine.ar.sampler import SamplerState, StepSampling
from omnistage.engine.streams import private_stream
from omnistage.engine.ar.interface import ForwardBatch
from omnistage.sampling_params import MAX_LOGPROBS

def smallest_bucket(n: int, buckets) -> int | None:
    """The smallest of the increasing `buckets` that holds n (None: n exceeds them all); the
    one bucket lookup of both engines' graphs."""
    return next((b for b in buckets if b >= n), None)


def warm_and_capture(warm: Callable[[], Any], capture: Callable[[], Any], device: torch.device,
                     pool: Any, stream: torch.cuda.Stream, warm_stream: torch.cuda.Stream,
                     warmups: int = 1, after_warmup: Callable[[], None] | None = None
                     ) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Run `warm` `warmups` times on warm_stream (Triton compiles, library handles and
    workspaces settle), then capture `capture` into `pool` on `stream`; (graph, its output).
    Every CUDA graph of both engines is captured here.

    NOTE: thread_local: a CUDA call of another thread (a front end, another stage's launcher)
    cannot break the capture. `stream` is a private one (private_stream): cuBLAS keeps a
    workspace per stream and a graph bakes in the one it was captured on; graphs that replay
    side by side on their own streams must not share one (split-K semaphores there: a hang)."""
    current = torch.cuda.current_stream(device)
    warm_stream.wait_stream(current)
    with torch.cuda.stream(warm_stream):
        for _ in range(warmups):
            warm()
    current.wait_stream(warm_stream)
    if after_warmup is not None:
        after_warmup()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
        out = capture()
    return graph, out


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, 48, 64, 80, ... up to (and including) max_num_seqs."""
    return ([s for s in (1, 2, 4, 8, 16, 32) if s < max_num_seqs]
            + list(range(48, max_num_seqs, 16)) + [max_num_seqs])


def decode_input_offsets(max_size: int) -> dict[str, int]:
    """Where each static input of DecodeGraphs (largest batch size `max_size`) starts in its
    int32 buffer, in elements (the block tables last, max_blocks per row)."""
    return {name: k * max_size for name, k in (("ids", 0), ("pos", 1), ("slots", 4), ("lens", 5),
            ("sslot", 6), ("step", 7), ("force", 8), ("lprow", 9), ("tables", 10))}


# lazy warm-up: batch sizes up to this are captured at load (a first burst of requests)
LAZY_LOAD_SIZE = 4


def decode_capture_plan(sizes: list[int], lazy: bool, load_size: int = LAZY_LOAD_SIZE
                        ) -> tuple[list[int], list[int]]:
    """Decode batch sizes -> (captured at load, captured later one per idle gap, in order).
    full: every size at load; lazy: the sizes up to load_size (at least the smallest) and the
    largest at load, the others later, smallest first (concurrency ramps up).

    NOTE (why the largest at load): until its own size is captured, a step pads up to a
    captured larger size; with none it runs eagerly, which made a burst of 32 requests right
    after a lazy start decode about 10x slower per step (the talker: 1024 eager steps)."""
    if not lazy:
        return list(sizes), []
    now = [b for b in sizes if b <= load_size] or list(sizes[:1])
    if sizes and sizes[-1] not in now:
        now.append(sizes[-1])
    return now, [b for b in sizes if b not in now]


def graphs_enabled(mode: str, device: torch.device) -> bool:
    """Whether decode steps take the graph path (mode: EngineConfig.cuda_graphs): "auto" on a
    CUDA device with the Triton attention, "eager" (uncaptured) on any device."""
    if mode == "eager":
        return True
    if device.type != "cuda" or mode != "auto":
        return False
    from omnistage.engine.ar.attention import _triton_ok
    return _triton_ok(device)


class _Graph:
    def __init__(self, graph: torch.cuda.CUDAGraph, out: torch.Tensor) -> None:
        self.graph, self.out = graph, out

    def replay(self) -> None:
        self.graph.replay()


class _EagerGraph:
    """Stand-in for a captured graph (eager mode): each replay reruns the function."""

    def __init__(self, fn, out: torch.Tensor) -> None:
        self.fn, self.out = fn, out

    def replay(self) -> None:
        self.out = self.fn(False)


class _HostEvent:
    """A CUDA event's no-op stand-in off the GPU (work there is done when queued)."""

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class DecodeGraphs:
    def __init__(self, model, *, max_num_seqs: int, max_model_len: int, block_size: int,
                 dummy_block: int, uses_mrope: bool, device: torch.device,
                 dtype: torch.dtype, sampler: SamplerState | None = None,
                 eager: bool = False) -> None:
        self.model, self.device, self.dtype, self.sampler = model, device, dtype, sampler
        self.scratch_slot = sampler.scratch if sampler is not None else 0
        self.sizes = graph_batch_sizes(max_num_seqs)
        M = self.max_size = self.sizes[-1]
        self.block_size, self.dummy_block, self.uses_mrope = block_size, dummy_block, uses_mrope
        MB = self.max_blocks = -(-max_model_len // block_size)
        self._off = decode_input_offsets(M)
        total = self._off["tables"] + M * MB
        cuda = device.type == "cuda"
        self.capture = cuda and not eager  # eager: replays rerun the functions
        # two of each host buffer (and its event): a step launched ahead is filled while the
        # previous one may still be in flight
        self.host = [torch.zeros(total, dtype=torch.int32, pin_memory=cuda) for _ in range(2)]
        self.host_np = [h.numpy() for h in self.host]
        self.dev = torch.zeros(total, dtype=torch.int32, device=device)
        for h in self.host_np:
            self._fill_padding(h, 0)
        self.dev.copy_(self.host[0])
        self.num_runs = 0
        self.qsl = torch.arange(M + 1, dtype=torch.int32, device=device)
        # row buffers [M, width], allocated when a model first sends rows (width = its input's)
        self.embeds: torch.Tensor | None = None
        self.embeds_mask = torch.zeros(M, dtype=torch.bool, device=device)
        self.additive: torch.Tensor | None = None
        self.hidden: torch.Tensor | None = None  # [M, D] forward output, outside the pool
        self.tokens = torch.zeros(M, dtype=torch.long, device=device)  # head output
        self.tokens_host = torch.zeros(2, M, dtype=torch.long, pin_memory=cuda)
        # logprobs heads: their rows' packed results (logprobs.pack), at first use
        self.lp_k = min(MAX_LOGPROBS, sampler.vocab_size) if sampler is not None else 0
        self.lp_out: torch.Tensor | None = None  # [M, 1 + 2 lp_k] fp32
        self.lp_host: torch.Tensor | None = None  # [2, M, 1 + 2 lp_k] fp32
        # multi-codebook models: the head graph also runs model.predict_residuals (the inner
        # loop of codebooks 1..K-1), its codes and summed embeddings in these buffers
        groups = getattr(model, "num_code_groups", 1)
        self.residual = groups > 1 and sampler is not None
        if self.residual:
            self.codes = torch.zeros(M, groups - 1, dtype=torch.long, device=device)
            self.codes_host = torch.zeros(2, M, groups - 1, dtype=torch.long, pin_memory=cuda)
            self.residual_embeds: torch.Tensor | None = None  # [M, D], at first capture
            self.residual_ran = [False, False]  # per host buffer: its run's head drew them
        self.graphs: dict[tuple[int, bool, bool], _Graph] = {}  # forward graphs
        # tensor parallel rank 0 (engine/ar/tp.py): before_forward(self, count, B, embeds_rows,
        # add_rows) sends the step to the other ranks before any capture or replay
        self.before_forward: Callable | None = None
        self.heads: dict[tuple, _Graph | None] = {}  # None: capture failed
        # (n, B, host buffer, sampling) of a run whose head waits (run_deferred_head)
        self.deferred: tuple | None = None
        self.pool = None
        # captures and their warm-up runs: streams of this runner's own (see private_stream)
        self.capture_stream = private_stream(device) if self.capture else None
        self.warm_stream = private_stream(device) if self.capture else None
        # lazy warm-up (warmup(lazy=True)): sizes queued for capture_next(); until captured, a
        # step of such a size replays a captured larger size or runs eagerly (no capture)
        self.lazy = False
        self.later: deque[int] = deque()
        self.later_plan: tuple[bool, list] = (False, [])  # (additive rows, head flag sets)
        self.captured_later, self.later_seconds = 0, 0.0
        event = torch.cuda.Event if cuda else _HostEvent
        self.copied = [event(), event()]  # the input copy has read host[i]
        self.sampled = [event(), event()]  # tokens_host[i] holds the run's ids

    # ---------------------------------------------------------------- host side
    def padded_size(self, n: int) -> int | None:
        return smallest_bucket(n, self.sizes)

    def can_run(self, seqs, num_tokens: list[int]) -> bool:
        return (len(seqs) <= self.max_size and all(n == 1 for n in num_tokens)
                and all(len(s.block_table) <= self.max_blocks for s in seqs))

    def _fill_padding(self, h, start: int) -> None:
        # rows >= start of host buffer h: token 0 at position 0, one key in the dummy block's
        # slot 0, sampled into the scratch slot
        M, MB, o = self.max_size, self.max_blocks, self._off
        h[o["ids"] + start:o["ids"] + M] = 0
        for a in range(3):
            h[o["pos"] + a * M + start:o["pos"] + (a + 1) * M] = 0
        h[o["slots"] + start:o["slots"] + M] = self.dummy_block * self.block_size
        h[o["lens"] + start:o["lens"] + M] = 1
        h[o["sslot"] + start:o["sslot"] + M] = self.scratch_slot
        h[o["step"] + start:o["step"] + M] = 0
        h[o["force"] + start:o["force"] + M] = -1
        h[o["lprow"] + start:o["lprow"] + M] = 0
        h[o["tables"] + start * MB:o["tables"] + M * MB:MB] = self.dummy_block

    def _fill(self, h, seqs, B: int, sampling: StepSampling | None, ahead: int) -> int:
        """Writes the step's ints into host buffer h; returns how many ints to copy. ahead:
        positions start that far past num_computed_tokens (their ids come from the device)."""
        M, MB, bs, o = self.max_size, self.max_blocks, self.block_size, self._off
        for r, seq in enumerate(seqs):
            i = seq.num_computed_tokens + ahead
            h[o["ids"] + r] = 0 if ahead else seq.token_id(i)
            table = seq.block_table
            h[o["slots"] + r] = table[i // bs] * bs + i % bs
            h[o["lens"] + r] = i + 1
            h[o["tables"] + r * MB:o["tables"] + r * MB + len(table)] = table
            p = seq.mrope_positions
            if self.uses_mrope and p is not None and i < p.shape[1]:
                for a in range(3):
                    h[o["pos"] + a * M + r] = int(p[a, i])
            else:
                pos = i + (seq.rope_delta if self.uses_mrope else 0)
                for a in range(3):
                    h[o["pos"] + a * M + r] = pos
        n = len(seqs)
        if sampling is not None:
            h[o["sslot"]:o["sslot"] + n] = sampling.slots
            h[o["step"]:o["step"] + n] = sampling.steps
            h[o["force"]:o["force"] + n] = sampling.force
        self._fill_padding(h, n)
        if sampling is not None:  # (after the padding: fewer rows than n ask)
            h[o["lprow"]:o["lprow"] + len(sampling.logprob_rows)] = sampling.logprob_rows
        return o["tables"] + B * MB

    def _stage_rows(self, embeds_rows, add_rows, B: int, has_e: bool, has_a: bool) -> None:
        # device rows of the step into the static buffers; padding rows zero / unmasked
        n = len(embeds_rows)
        if has_e:
            self.embeds_mask[:B].zero_()
            for r, e in enumerate(embeds_rows):
                if e is not None:
                    self.embeds[r:r + 1].copy_(e[0])
                    self.embeds_mask[r:r + 1].copy_(e[1])
        if has_a:
            if all(a is not None for a in add_rows):
                self.additive[:n].copy_(torch.cat(add_rows))
            else:
                for r, a in enumerate(add_rows):
                    if a is None:
                        self.additive[r].zero_()
                    else:
                        self.additive[r:r + 1].copy_(a)
            self.additive[n:B].zero_()

    def _ensure_row_buffers(self, embeds_rows, add_rows) -> None:
        M = self.max_size
        for e in embeds_rows:
            if e is not None and self.embeds is None:
                self.embeds = torch.zeros(M, e[0].shape[-1], dtype=self.dtype, device=self.device)
        for a in add_rows:
            if a is not None and self.additive is None:
                self.additive = torch.zeros(M, a.shape[-1], dtype=self.dtype, device=self.device)

    # ---------------------------------------------------------------- device side
    def _forward(self, B: int, has_e: bool, has_a: bool, warm: bool) -> torch.Tensor:
        M, MB, o = self.max_size, self.max_blocks, self._off
        d = self.dev
        tables = d[o["tables"]:o["tables"] + M * MB].view(M, MB)[:B]
        # seq_lens_cpu: an upper bound (read by the torch attention of the eager mode only)
        meta = AttentionMetadata(
            slot_mapping=d[o["slots"]:o["slots"] + B].long(), query_start_loc=self.qsl[:B + 1],
            seq_lens=d[o["lens"]:o["lens"] + B], block_tables=tables,
            query_lens_cpu=[1] * B, seq_lens_cpu=[MB * self.block_size] * B, max_query_len=1,
            decode_only=True)
        pos = d[o["pos"]:o["pos"] + 3 * M].view(3, M)[:, :B].long()
        fb = ForwardBatch(input_ids=d[o["ids"]:o["ids"] + B].long(),
                          positions=pos if self.uses_mrope else pos[0], attn=meta)
        if has_e:
            fb.inputs_embeds, fb.embeds_mask = self.embeds[:B], self.embeds_mask[:B]
        if has_a:
            fb.additive_embeds = self.additive[:B]
        hidden = self.model(fb)
        if not warm:
            self.hidden[:B].copy_(hidden)
        return hidden

    def _draw(self, logits: torch.Tensor, B: int, flags, L: int, warm: bool):
        # sampled ids into self.tokens[:B], the L logprob rows' packed results into lp_out
        o, d = self._off, self.dev
        slots = d[o["sslot"]:o["sslot"] + B].long()
        steps = d[o["step"]:o["step"] + B].long()
        force = d[o["force"]:o["force"] + B].long()
        lp = None
        if L:
            rows = d[o["lprow"]:o["lprow"] + L].long()
            lp = row_logprobs(self.sampler, logits, slots, steps, flags, rows, self.lp_k)
        # warm-up runs must not count their draws
        ids = self.sampler.sample_rows(logits, slots, steps, force, flags, update=not warm)
        if not warm:
            self.tokens[:B].copy_(ids)
            if lp is not None:
                self.lp_out[:L].copy_(pack(lp, ids))
        return ids, slots, steps

    def _head(self, B: int, flags, L: int, warm: bool) -> torch.Tensor:
        # flags None: logits [B, V]; else sampled ids into self.tokens[:B]
        logits = self.model.compute_logits(self.hidden[:B])
        if flags is None:
            return logits
        ids, slots, steps = self._draw(logits, B, flags, L, warm)
        if self.residual:
            st = self.sampler
            codes, embeds = self.model.predict_residuals(
                self.hidden[:B], ids, st.iparams[slots, 1], steps, st.fparams[slots, 0] == 0,
                all_greedy=flags.all_greedy)
            if self.residual_embeds is None:
                self.residual_embeds = torch.zeros(self.max_size, embeds.shape[-1],
                                                   dtype=embeds.dtype, device=self.device)
            if not warm:
                self.codes[:B].copy_(codes)
                self.residual_embeds[:B].copy_(embeds)
        return ids

    def capture_graph(self, fn) -> _Graph | _EagerGraph:
        """fn(warm) -> output, run twice to warm up, then captured into this runner's pool on
        its capture stream (PrefillGraphs captures through it too); eager mode: a stand-in."""
        if not self.capture:
            out = fn(True)
            if self.hidden is None:
                self.hidden = torch.zeros(self.max_size, out.shape[-1], dtype=out.dtype,
                                          device=self.device)
            return _EagerGraph(fn, out)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        warmed: list[torch.Tensor] = []

        def settle() -> None:  # the hidden buffer's width: the warm-up output's
            if self.hidden is None:
                out = warmed[-1]
                self.hidden = torch.zeros(self.max_size, out.shape[-1], dtype=out.dtype,
                                          device=self.device)

        g, out = warm_and_capture(lambda: warmed.append(fn(True)), lambda: fn(False),
                                  self.device, self.pool, self.capture_stream, self.warm_stream,
                                  warmups=2, after_warmup=settle)
        return _Graph(g, out)

    def run(self, seqs, embeds_rows, add_rows, sampling: StepSampling | None = None,
            logits: bool = False, ahead: int = 0
            ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """One decode step of len(seqs) sequences -> (hidden [n, D], logits [n, V] when
        `logits`, run index), views of static buffers (valid until the next run). With
        `sampling`, the head graph samples every row; sampled_tokens(n, run index) returns
        the ids. ahead=1: the previous run (same sequences, same rows) has not been collected;
        its sampled ids are this step's input ids."""
        n = len(seqs)
        has_e = any(e is not None for e in embeds_rows)
        has_a = any(a is not None for a in add_rows)
        B = self.step_size(n, has_e, has_a)
        self._ensure_row_buffers(embeds_rows, add_rows)
        run, k = self.num_runs, self.num_runs % 2
        self.num_runs += 1
        self.copied[k].synchronize()  # the copy of two runs ago has read this buffer
        count = self._fill(self.host_np[k], seqs, B, sampling, ahead)
        self.dev[:count].copy_(self.host[k][:count], non_blocking=True)
        self.copied[k].record()
        if ahead:
            o = self._off["ids"]
            self.dev[o:o + n].copy_(self.tokens[:n])
        if self.before_forward is not None:
            self.before_forward(self, count, B, embeds_rows, add_rows)
        key = (B, has_e, has_a)
        fwd = self.graphs.get(key)
        if fwd is None and self._pending(B, has_a) and self.hidden is not None:
            # lazy: its capture waits for an idle gap; this step runs the same code eagerly
            fwd = _EagerGraph(lambda warm: self._forward(B, has_e, has_a, warm), None)
        elif fwd is None:
            if has_e:  # warm-up rows: not the stale ones of an earlier step
                self.embeds_mask[:B].zero_()
            if has_a:
                self.additive[:B].zero_()
            fwd = self.graphs[key] = self.capture_graph(
                lambda warm: self._forward(B, has_e, has_a, warm))
        self._stage_rows(embeds_rows, add_rows, B, has_e, has_a)
        fwd.replay()
        self.deferred = None
        if sampling is not None and sampling.flags.grammar and ahead:
            # NOTE (structured output, async scheduling): a step launched ahead queues only its
            # forward; its head waits for run_deferred_head(), called once the previous step's
            # tokens were read and accepted by the matchers, which then fill this step's masks
            # while the GPU runs the forward
            self.deferred = (n, B, k, sampling)
            return self.hidden[:n], None, run
        out = self._run_head(n, B, k, sampling, logits)
        return self.hidden[:n], out, run

    def run_deferred_head(self) -> None:
        """The head of the last run() whose head was deferred (no-op when there is none)."""
        if self.deferred is not None:
            n, B, k, sampling = self.deferred
            self.deferred = None
            with torch.inference_mode():  # (as the runner's launches: the model's weights)
                self._run_head(n, B, k, sampling, False)

    def _run_head(self, n: int, B: int, k: int, sampling: StepSampling | None,
                  logits: bool) -> torch.Tensor | None:
        # the head graph of a run whose forward was replayed: ids (and logprobs) to the pinned
        # host buffers of index k, or the logits [n, V] (`logits`, no sampling)
        if sampling is not None and sampling.flags.grammar:
            # structured output: the matchers fill their masks while the GPU runs the forward
            self.sampler.flush_grammar()
        out = None
        if sampling is not None or logits:
            flags = sampling.flags if sampling is not None else None
            n_lp = len(sampling.logprob_rows) if sampling is not None else 0
            L = self.padded_size(n_lp) if n_lp else 0
            head = self._get_head(B, flags, L)
            if head is None:  # sampler not capturable here: logits graph, eager sampler
                lg = self._get_head(B, None)
                lg.replay()
                self._draw(lg.out[:B], B, flags, L, warm=False)
            else:
                head.replay()
            if sampling is not None:
                self.tokens_host[k, :n].copy_(self.tokens[:n], non_blocking=True)
                if n_lp:
                    self.lp_host[k, :n_lp].copy_(self.lp_out[:n_lp], non_blocking=True)
                if self.residual:
                    self.residual_ran[k] = head is not None
                    if head is not None:
                        self.codes_host[k, :n].copy_(self.codes[:n], non_blocking=True)
                self.sampled[k].record()
            else:
                out = head.out[:n]
        return out

    def step_size(self, n: int, has_e: bool = False, has_a: bool = False) -> int:
        """The batch size a step of n rows runs at: the smallest size >= n; lazy, while that
        size waits for its capture, the smallest captured larger one (its padding rows write
        into the dummy block), else that size eagerly."""
        B = self.padded_size(n)
        if not self._pending(B, has_a):
            return B
        return next((s for s in self.sizes if s > B and (s, has_e, has_a) in self.graphs
                     and not self._pending(s, has_a)), B)

    def _pending(self, B: int, has_a: bool | None = None) -> bool:
        # a size the lazy warm-up queued (its forward with these additive rows or its heads)
        return bool(self.later) and B in self.later and (
            has_a is None or has_a == self.later_plan[0])

    def pending_captures(self) -> int:
        """Sizes a lazy warm-up left for capture_next()."""
        return len(self.later)

    def capture_next(self) -> int | None:
        """Capture the next queued size's forward and head graphs (None: none left). Call it
        on the stage's thread with no step in flight and no head deferred: the warm-up runs
        rewrite the static input rows."""
        if not self.later or self.deferred is not None:
            return None
        t0 = time.perf_counter()
        B = self.later[0]
        with torch.inference_mode():
            self._prepare_capture(self.later_plan[0])
            self.later.popleft()  # (before the capture: a failed one is not retried)
            self._capture_size(B, *self.later_plan)
        self.captured_later += 1
        self.later_seconds += time.perf_counter() - t0
        return B

    def _prepare_capture(self, has_a: bool) -> None:
        # every row padding (the dummy block, the scratch sampler slot) for the warm-up runs
        for ev in self.copied:
            ev.synchronize()
        for h in self.host_np:
            self._fill_padding(h, 0)
        self.dev.copy_(self.host[0])

    def _capture_size(self, B: int, has_a: bool, flag_sets) -> None:
        key = (B, False, has_a)
        if key not in self.graphs:
            if has_a:
                self.additive[:B].zero_()
            self.graphs[key] = self.capture_graph(
                lambda warm, B=B: self._forward(B, False, has_a, warm))
        for flags in flag_sets:
            self._get_head(B, flags)

    def warmup(self, additive_width: int | None, flag_sets, lazy: bool = False,
               load_size: int = LAZY_LOAD_SIZE) -> None:
        """Capture every batch size's forward graph (with additive rows of this width, or none)
        and its head graphs for these SamplingFlags now: at first use a size would stall the
        step for its Triton warm-up and capture (~1-2 s at 7B). lazy: only sizes up to
        load_size now, the others queued for capture_next() (decode_capture_plan).

        NOTE: tensor parallel (before_forward set) captures every size now: each rank
        captures a key when rank 0's step first uses it, and rank 0 alone would know the
        queue."""
        has_a = additive_width is not None
        if not self.capture:
            return
        lazy = lazy and self.before_forward is None
        now, later = decode_capture_plan(self.sizes, lazy, load_size)
        if has_a and self.additive is None:
            self.additive = torch.zeros(self.max_size, additive_width, dtype=self.dtype,
                                        device=self.device)
        self._prepare_capture(has_a)
        self.later.clear()
        for B in now:
            self._capture_size(B, has_a, flag_sets)
        self.lazy = self.lazy or lazy
        self.later_plan = (has_a, list(flag_sets))
        self.later.extend(later)

    def _get_head(self, B: int, flags, L: int = 0) -> _Graph | _EagerGraph | None:
        key = (B, flags, L)
        if key not in self.heads and self._pending(B):  # lazy, not captured yet: eagerly
            return _EagerGraph(lambda warm: self._head(B, flags, L, warm), None)
        if L and self.lp_out is None:
            W = 1 + 2 * self.lp_k
            self.lp_out = torch.zeros(self.max_size, W, device=self.device)
            self.lp_host = torch.zeros(2, self.max_size, W, pin_memory=self.device.type == "cuda")
        if key not in self.heads:
            try:
                self.heads[key] = self.capture_graph(
                    lambda warm: self._head(B, flags, L, warm))
            except RuntimeError as e:  # NOTE: keeps the engine running; the eager sampler is exact
                if flags is None:
                    raise
                warnings.warn(f"sampler graph capture failed ({e}); sampling eagerly",
                              stacklevel=2)
                self.heads[key] = None
        return self.heads[key]

    def residual_rows(self, n: int) -> torch.Tensor | None:
        """A copy (queued now, on the current stream) of the last run's summed residual
        embeddings [n, D]; None when its head did not draw them (eager sampler fallback)."""
        if not self.residual or not self.residual_ran[(self.num_runs - 1) % 2]:
            return None
        return self.residual_embeds[:n].clone()

    def sampled_codes(self, n: int, run: int) -> list[list[int]]:
        """Codebooks 1..K-1 of run `run`'s n rows (after sampled_tokens of that run)."""
        return self.codes_host[run % 2, :n].tolist()

    def sampled_logprobs(self, n: int, run: int) -> np.ndarray:
        """A copy of the packed logprobs (logprobs.pack) of run `run`'s n asking rows [n, W]
        (after sampled_tokens of that run)."""
        self.sampled[run % 2].synchronize()
        return self.lp_host[run % 2, :n].numpy().copy()

    def sampled_tokens(self, n: int, run: int) -> list[int]:
        """The ids of run `run`'s n rows (waits for it; runs after it may be in flight)."""
        if run < self.num_runs - 2:
            raise RuntimeError(f"sampled ids of run {run} were overwritten (now {self.num_runs})")
        k = run % 2
        self.sampled[k].synchronize()
        return self.tokens_host[k, :n].tolist()
