"""The non-AR stage worker: a queue of work per request, step-level continuous batching,
first outputs first, steps in parts preemptible between parts, and the launcher thread.

A step runs the next output of up to max_batch ready requests, earliest output first (a new
request's first output goes ahead of later outputs of older ones); requests join and leave
between steps. The runtime drives it through the StageWorker contract (runtime/stage.py):
submit / abort / has_work / step / stats / fail_all, fail / restrict / reset_step (a step that
raised), and launch() / collect() when it overlaps the stages' GPU work."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from omnistage.engine.gen.config import MAX_BATCH, GenEngineConfig
from omnistage.engine.gen.graphs import BUCKETS, bucket_for
from omnistage.engine.gen.model import GenModel, GenRequest
from omnistage.engine.step import LaunchedStep, StageEvent, StageStream
from omnistage.layers.compile import persist_compile_caches

log = logging.getLogger("omnistage.engine.gen")

Ready = list[tuple[str, GenRequest]]


@dataclass
class StepJob:
    """A step of later outputs run in parts (preempt_parts intervals each)."""

    ready: Ready
    intervals: int  # the step's intervals (GenModel.intervals)
    # an upstream stage still sends input (of some request): the step runs beside it
    beside: bool = False
    decode: Any = None  # the model's job, begun by the first part (on the launcher thread)
    parts: int = 0  # parts launched


class GenStageWorker:
    """One non-AR stage: a GenModel driven by the engine (see the module docstring)."""

    def __init__(self, name: str, model: GenModel, device: torch.device,
                 config: GenEngineConfig | None = None) -> None:
        self.name, self.model, self.device = name, model, device
        self.config = (config or GenEngineConfig()).resolve(device)
        self.max_batch = self.config.max_batch
        self.requests: dict[str, GenRequest] = {}
        # step sizes so far, as running figures (a list would grow with every step)
        self.last_batch = self.max_batch_seen = self.num_chunks = self.num_steps = 0
        self.shared_steps = 0  # steps that ran more than one request
        self.alone_steps = 0  # steps of first outputs that ran with the GPU to themselves
        self.busy_seconds = 0.0
        self.stalled = False
        self.gpu = StageStream(device)
        # a step with a request's first output runs ahead of the AR stages: it is that
        # request's time to first output (later outputs have the first ones out as slack)
        self.gpu_first = StageStream(device, priority=-1)
        self.first_alone = bool(self.config.first_output_alone)
        self.preempt = int(self.config.preempt_parts)
        self.job: StepJob | None = None  # the later-output step in progress (preempt > 0)
        self.only: frozenset[str] | None = None  # restrict(): the requests steps may run
        # one worker: the orchestrator never launches this stage again before collecting it
        self.launcher = (ThreadPoolExecutor(1, thread_name_prefix=f"{name}-launch")
                         if self.config.launch_thread else None)
        # warmup_plan="lazy": the model queues graphs the runtime's idle passes capture
        # (idle_capture)
        self.lazy = self.config.warmup_plan == "lazy" and hasattr(self.model, "capture_next")
        self.idle_captures = 0
        if device.type == "cuda":  # compiled kernels outlive the process (a warm start)
            persist_compile_caches()
        if self.config.warmup:  # (the stage's builder times it as its "graphs" phase)
            self.warmup(lazy=self.lazy)

    def warmup(self, buckets: tuple[int, ...] | None = None, lazy: bool = False) -> None:
        """Capture the model's graphs of these batch buckets (default: those a batch of at most
        max_batch rows uses) now; lazy: only those first requests need, the rest one per idle
        gap of this worker (a model without lazy capture captures them all)."""
        if buckets is None and self.max_batch < MAX_BATCH:  # no graph (pool) for larger ones
            top = bucket_for(self.max_batch, BUCKETS)
            buckets = tuple(b for b in BUCKETS if b <= top)
        if lazy and hasattr(self.model, "capture_next"):
            self.model.warmup(buckets, lazy=True)
        else:
            self.model.warmup(buckets)

    def captures_pending(self) -> int:
        """Graphs a lazy warm-up left for idle gaps (0 without lazy capture)."""
        return self.model.pending_captures() if self.lazy else 0

    def _idle(self) -> bool:
        # nothing to run now: no step in parts, no request ready (the runtime collected this
        # stage's last launch before calling launch again, so none is in flight either)
        return self.job is None and not any(self._ready(r) for r in self.requests.values())

    # ---------------------------------------------------------------- requests
    def submit(self, request_id: str, request: Any) -> None:
        state = self.model.new_state(request)
        state.input_lock = threading.Lock()  # (a lock does not pickle: made here, not upstream)
        self.requests[request_id] = state

    def add_input(self, request_id: str, data: Any, finished: bool) -> None:
        """Input from the upstream stage for a request (dropped once it is gone). NOTE: with
        the launcher thread a step may be taking this request's input meanwhile: the model
        reads it holding state.inputs_held()."""
        state = self.requests.get(request_id)
        if state is not None:
            with state.inputs_held():
                self.model.add_input(state, data, finished)

    def abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)  # (a job computes its output still; collect drops it)

    def _ready(self, state: GenRequest) -> bool:
        return not state.in_job and self.model.ready(state)

    def has_work(self) -> bool:
        return self.job is not None or any(self._ready(r) for r in self.requests.values())

    # ---------------------------------------------------------------- steps
    def step(self) -> list[StageEvent]:
        launched = self.launch()
        return [] if launched is None else self.collect(launched)

    def launch(self) -> LaunchedStep | None:
        """Queue the next output of up to max_batch ready requests, earliest output first."""
        t0 = time.perf_counter()
        model = self.model
        ready = self._pick(sorted(((rid, r) for rid, r in self.requests.items()
                                   if self._ready(r) and (self.only is None or rid in self.only)),
                                  key=lambda item: item[1].outputs))
        events = []
        for rid, r in ready:
            if model.empty(r):  # nothing to compute: it ends without an output
                del self.requests[rid]
                events.append(StageEvent(self.name, rid, finished=True, finish_reason="stop"))
        ready = [(rid, r) for rid, r in ready if rid in self.requests]
        first = [(rid, r) for rid, r in ready if r.outputs == 0]
        # only first outputs go ahead of the next part of a step in progress, and only where
        # their graphed shape is not the one that step holds
        if self.job is not None and (not first or model.is_held([r for _, r in first])):
            return self._launch_part(t0, events)
        if not ready:
            return LaunchedStep(None, events) if events else None
        # NOTE: alone only when every request still waiting for its first output waits for
        # this stage alone (its first output is ready: in this step, or in the next when they
        # exceed a step): the pause of the other stages would delay any other's input (with
        # arrivals spread out, that cost more than it saved). measured: benchmarks/results/
        # qwen2_5_omni_pipeline_gpu_h100_chunk24_staggered_2026-11-23.json
        alone = bool(first) and self.first_alone and all(
            self._ready(r) for r in self.requests.values() if r.outputs == 0)
        if alone:  # later outputs wait for the next step: theirs are already out
            ready = first
            self.alone_steps += 1
        elif self.job is not None:
            ready = first
        if not first and self.preempt and model.streaming:
            return self._launch_part(t0, events, ready)
        self._count_step(len(ready))
        gpu = self.gpu_first if first else self.gpu
        with gpu.active(launch=True):  # (the previous step was collected: done on the GPU)
            start = gpu.event()
            if not model.streaming:
                return LaunchedStep(None, events + self._run_now(ready), start, gpu.event(),
                                    time.perf_counter() - t0)
            batch = [r for _, r in ready]
            if self.launcher is None:
                state = (ready, self._queue_run(batch), False)
                return gpu.launched(state, start, t0, events, exclusive=alone)
        # (the stream already waits for the default stream's work queued before this launch)
        end = torch.cuda.Event(enable_timing=True) if gpu.stream is not None else None
        pending = self.launcher.submit(self._queue_run, batch, gpu, end)
        return LaunchedStep((ready, None, False), events, start, end, time.perf_counter() - t0,
                            exclusive=alone, pending=pending)

    def idle_capture(self) -> bool:
        """One graph a lazy warm-up queued, captured now (True) if any is left and this stage
        is idle. The runtime calls it only when no stage of the process has work, on its own
        thread.

        NOTE (why not in the background): capturing a new shape compiles it, and torch.compile's
        FX tracing patches nn.Module.__call__ for the whole process while it traces: a stage
        running a module on another thread meanwhile fails ("FX to symbolically trace a
        dynamo-optimized function": a talker step on the H200). So the capture waits until
        nothing else runs, and a request arriving meanwhile waits for this one graph."""
        if not (self.lazy and self.captures_pending() and self._idle()):
            return False
        self.idle_captures += 1
        self._capture_one()
        return True

    def _capture_one(self) -> None:
        t0 = time.perf_counter()
        key = self.model.capture_next()
        if key is not None:
            log.debug("%s: captured %s in an idle gap (%.2f s; %d left)", self.name, key,
                      time.perf_counter() - t0, self.model.pending_captures())

    def _count_step(self, size: int) -> None:
        self.last_batch, self.max_batch_seen = size, max(self.max_batch_seen, size)
        self.num_chunks += size
        self.num_steps += 1
        self.shared_steps += size > 1

    def _pick(self, ready: Ready) -> Ready:
        """The step's batch: in order, the requests whose batch_key is the first one's, while
        their rows fit max_batch (the first always runs)."""
        if not ready:
            return ready
        key = self.model.batch_key(ready[0][1])
        picked, rows = [], 0
        for rid, r in ready:
            n = self.model.batch_rows(r)
            if picked and (rows + n > self.max_batch or self.model.batch_key(r) != key):
                continue
            picked.append((rid, r))
            rows += n
        return picked

    def _launch_part(self, t0: float, events: list[StageEvent],
                     ready: Ready | None = None) -> LaunchedStep:
        """Queue the next part of the step in progress, or the first part of a new one of
        `ready` (later outputs only)."""
        if self.job is None:
            batch = [r for _, r in ready]
            self.job = StepJob(ready, self.model.intervals(batch), any(
                self.model.input_pending(r) for r in self.requests.values()))
            self._count_step(len(ready))
            for _, r in ready:
                r.in_job = True
        job = self.job
        job.parts += 1
        last = job.parts * self.preempt >= job.intervals
        # collect emits the step's outputs after its last part (and frees its requests)
        ready = job.ready if last else []
        gpu = self.gpu
        with gpu.active(launch=True):
            start = gpu.event()
            if self.launcher is None:
                return gpu.launched((ready, self._queue_part(job), last), start, t0, events)
        end = torch.cuda.Event(enable_timing=True) if gpu.stream is not None else None
        pending = self.launcher.submit(self._queue_part, job, gpu, end)
        return LaunchedStep((ready, None, last), events, start, end, time.perf_counter() - t0,
                            pending=pending)

    def _queue_run(self, batch: list[GenRequest], gpu: StageStream | None = None,
                   end: torch.cuda.Event | None = None) -> Any:
        """Queue a whole step (what collect reads once the GPU is done). On the launcher
        thread: gpu's stream is made current there, and end is recorded on it after the work."""
        with gpu.active(launch=False) if gpu is not None else nullcontext():
            out = self.model.run(batch)
            if end is not None:
                end.record()
        return out

    def _queue_part(self, job: StepJob, gpu: StageStream | None = None,
                    end: torch.cuda.Event | None = None) -> Any:
        """_queue_run for one part of a step run in parts: None until its last part."""
        with gpu.active(launch=False) if gpu is not None else nullcontext():
            if job.decode is None:
                job.decode = self.model.begin([r for _, r in job.ready], job.beside)
            out = None
            if self.model.advance(job.decode, self.preempt):
                out = self.model.finish(job.decode)
            if end is not None:
                end.record()
        return out

    def collect(self, launched: LaunchedStep) -> list[StageEvent]:
        """The launched step's events (its outputs once the GPU is done)."""
        events = list(launched.events)
        if launched.state is None:  # finished at launch (whole steps, empty requests)
            return events
        ready, queued, ends_job = launched.state
        out = launched.pending.result() if launched.pending is not None else queued
        if launched.end is not None:
            launched.end.synchronize()
        if ends_job:
            self.job = None
            for _, r in ready:
                r.in_job = False
        if out is None:  # a part of a step: its outputs come with the last part
            return events
        for (rid, r), fields in zip(ready, self.model.outputs(out), strict=True):
            if self.requests.get(rid) is not r:  # aborted while the step ran
                continue
            r.outputs += 1
            last = self.model.done(r)
            if last:
                del self.requests[rid]
            if fields is not None or last:
                events.append(StageEvent(self.name, rid, **(fields or {}), finished=last,
                                         finish_reason="stop" if last else None))
        return events

    def _run_now(self, ready: Ready) -> list[StageEvent]:
        """A whole step of a non-streaming model: its outputs, on the host, now."""
        fields = self.model.outputs(self.model.run([r for _, r in ready]))
        for rid, _ in ready:
            del self.requests[rid]
        return [StageEvent(self.name, rid, **(f or {}), finished=True, finish_reason="stop")
                for (rid, _), f in zip(ready, fields, strict=True)]

    def fail_all(self, error: str) -> list[StageEvent]:
        self.reset_step()
        return [ev for rid in list(self.requests) for ev in self.fail(rid, error)]

    def fail(self, request_id: str, error: str) -> list[StageEvent]:
        if self.requests.pop(request_id, None) is None:
            return []
        return [StageEvent(self.name, request_id, finished=True, finish_reason="error",
                           error=error)]

    def request_ids(self) -> list[str]:
        return list(self.requests)

    def restrict(self, request_ids: frozenset[str] | None) -> None:
        self.only = request_ids

    def reset_step(self) -> None:
        """After a step raised: its job is dropped, its requests are free for a new step."""
        self.job = None
        for r in self.requests.values():
            r.in_job = False
        self.model.drop_jobs()

    def describe(self) -> dict[str, Any]:
        """Its streams' state (a stall report)."""
        return {"later": self.gpu.describe(), "first": self.gpu_first.describe(),
                "job_in_parts": self.job is not None}

    def stats(self) -> dict[str, float]:
        return {"queue": len(self.requests),
                "batch_size": self.last_batch, "max_batch_size": self.max_batch_seen,
                "chunks": self.num_chunks, "steps": self.num_steps,
                "shared_steps": self.shared_steps,
                "alone_steps": self.alone_steps, "preempt_intervals": self.preempt,
                "busy_seconds": self.busy_seconds, "idle_captures": self.idle_captures,
                **self.model.stats(), "captures_pending": self.captures_pending()}
