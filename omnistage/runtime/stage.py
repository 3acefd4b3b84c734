"""Stage workers: the uniform face every stage shows the orchestrator (submit, abort, step),
the typed event a step produces for one request, and the links that carry a request's data
from one stage to the next.

NOTE: a StageHost runs one worker together with its requests' links, the same way whether it
lives in the orchestrator's process or in a stage process of its own: after each step it
hands the step's events to the links leaving this stage (their `send` runs here, next to the
upstream model), delivers what they return to the downstream stage (directly, or through a
pipe to that stage's process), and applies what arrives for its own requests (`receive` runs
next to the downstream model). Hidden rows never reach the orchestrator."""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from omnistage.engine.ar.cuda_graphs import private_stream
from omnistage.engine.ar.engine import AREngine
from omnistage.engine.ar.sequence import Sequence


@dataclass
class StageEvent:
    """What one stage step produced for one request (crosses from a stage to the runtime)."""

    stage: str
    request_id: str
    token_ids: list[int] = field(default_factory=list)  # new tokens / codes this step
    text: str = ""  # new text this step
    hidden: tuple[int, torch.Tensor] | None = None  # (first position, rows [n, D]) on device
    audio: np.ndarray | None = None  # new audio chunk, float32 [samples], host
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class LaunchedStep:
    """A stage step whose GPU work is queued (launch); its events come with collect, which
    the orchestrator calls once done() so the stages' GPU work overlaps."""

    state: Any  # what the worker's collect() needs; None: finished at launch
    events: list[StageEvent] = field(default_factory=list)  # known at launch (collect adds them)
    start: torch.cuda.Event | None = None
    end: torch.cuda.Event | None = None
    wall_seconds: float = 0.0  # host time of the launch
    # the GPU runs this step alone: the orchestrator launches no other stage's step until it
    # is collected (a latency-critical step that contention with the others would slow down)
    exclusive: bool = False
    # the launch still queueing on a thread of the stage's own (whose result collect reads);
    # end is recorded by that thread once the work is queued
    pending: Future | None = None

    def done(self) -> bool:
        if self.pending is not None and not self.pending.done():
            return False
        return self.end is None or self.end.query()

    def busy_seconds(self) -> float:
        """GPU time from launch to the end of its work (once done), else the launch's host
        time."""
        if self.end is None:
            return self.wall_seconds
        if self.pending is not None:
            self.pending.result()  # end is recorded once the thread has queued the work
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1e3


class StageStream:
    """The CUDA stream a stage launches its work on (a no-op on the CPU). AR stages take a
    high priority (priority < 0): their small latency-bound decode kernels go ahead of
    code2wav's big ones.

    NOTE: the orchestrator moves data between stages on the default stream (links), so each
    launch first waits for the default stream's queued work; tensors a launch reads from other
    streams are kept alive by its LaunchedStep until collect."""

    _shared: dict[tuple[torch.device, str], torch.cuda.Stream] = {}

    def __init__(self, device: torch.device, priority: int = 0,
                 share: str | None = None) -> None:
        # share: stages of one share name queue on one stream (in launch order, no contention)
        self.stream = None
        if device.type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device() if device.index is None
                                  else device.index)
            key = (device, share or "")
            stream = self._shared.get(key) if share else None
            if stream is None:
                stream = private_stream(device, priority)
                if share:
                    self._shared[key] = stream
            self.stream = stream

    @contextmanager
    def active(self, launch: bool) -> Iterator[None]:
        if self.stream is None:
            yield
            return
        if launch:
            self.stream.wait_stream(torch.cuda.default_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            yield

    def describe(self) -> dict[str, Any]:
        """Whether this stream and the default stream have finished their queued work."""
        if self.stream is None:
            return {}
        return {"stream_idle": self.stream.query(), "priority": self.stream.priority,
                "default_stream_idle": torch.cuda.default_stream(self.stream.device).query()}

    def event(self) -> torch.cuda.Event | None:
        """A timing event recorded on this stream now (None on the CPU)."""
        if self.stream is None:
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(self.stream)
        return ev

    def launched(self, state: Any, start: torch.cuda.Event | None, t0: float,
                 events: list[StageEvent] | None = None, exclusive: bool = False
                 ) -> LaunchedStep:
        return LaunchedStep(state, events or [], start, self.event(), time.perf_counter() - t0,
                            exclusive)


class StageWorker(Protocol):
    name: str

    def submit(self, request_id: str, request: Any) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def has_work(self) -> bool: ...

    def step(self) -> list[StageEvent]: ...

    def stats(self) -> dict[str, float]: ...

    def fail_all(self, error: str) -> list[StageEvent]: ...


class ARStageWorker:
    """An AR stage: one AREngine; its requests are engine Sequences."""

    def __init__(self, name: str, engine: AREngine, priority: int = -1) -> None:
        self.name, self.engine = name, engine
        self.device = engine.runner.device
        # NOTE: each AR stage has a stream of its own, so the talker's short decode steps run
        # beside the thinker's (H100, c1: time to first audio 0.28 -> 0.24 s against one
        # shared stream); the pipeline gives the upstream stage the higher priority (a lower
        # number), as its tokens gate the downstream one. OMNISTAGE_AR_STREAM=NAME: the AR
        # stages share one stream again.
        self.gpu = StageStream(self.device, priority,
                               share=os.environ.get("OMNISTAGE_AR_STREAM") or None)
        self.last_batch_size = 0
        self.busy_seconds = 0.0
        self.stalled = False  # the last step scheduled nothing (e.g. gated on upstream rows)
        self._queued: LaunchedStep | None = None  # the engine's step launched ahead

    def submit(self, request_id: str, request: Sequence) -> None:
        self.engine.add_request(request)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def step(self) -> list[StageEvent]:
        launched = self.launch()
        return [] if launched is None else self.collect(launched)

    def launch(self) -> LaunchedStep | None:
        """The engine's next step, then (async scheduling) the one after it queued behind it;
        each step gets its own end event, so this one is collected as soon as it is done."""
        t0 = time.perf_counter()
        with self.gpu.active(launch=True):
            queued, self._queued = self._queued, None
            start = self.gpu.event()
            batch = self.engine.launch()
            self.stalled = batch is None
            if batch is None:
                return None
            step = queued if queued is not None and queued.state is batch else \
                self.gpu.launched(batch, start, t0)
            t1, start = time.perf_counter(), self.gpu.event()
            ahead = self.engine.launch_ahead(batch)
            if ahead is not None:
                self._queued = self.gpu.launched(ahead, start, t1)
            return step

    def collect(self, launched: LaunchedStep) -> list[StageEvent]:
        with self.gpu.active(launch=False):
            updates = self.engine.collect(launched.state)
        self.last_batch_size = len(updates)
        return [StageEvent(self.name, u.request_id, u.new_token_ids, u.new_text, u.hidden,
                           finished=u.finished, finish_reason=u.finish_reason, error=u.error)
                for u in updates]

    def fail_all(self, error: str) -> list[StageEvent]:
        """After a crash: end every request of this stage with `error`, freeing their blocks."""
        self._queued = None
        self.engine.drop_ahead()
        events = []
        for rid in list(self.engine.seqs):
            u = self.engine.fail(rid, error)
            if u is not None:
                events.append(StageEvent(self.name, rid, finished=True, finish_reason="error",
                                         error=error))
        return events

    def stats(self) -> dict[str, float]:
        s = self.engine.stats
        return {"queue": s["num_waiting"], "running": s["num_running"],
                "batch_size": self.last_batch_size, "free_kv_blocks": s["num_free_blocks"],
                "kv_blocks": s["num_kv_blocks"], "busy_seconds": self.busy_seconds,
                "steps": s["num_steps"], "ahead_steps": s["num_ahead_steps"],
                "prefix_cache_hit_tokens": s["prefix_cache_hit_tokens"],
                "preemptions": s["num_preemptions"]}


class LinkAdapter(Protocol):
    """One request's handoff from an upstream stage to a downstream one (a registered adapter).
    Holds plain data only, so it can be pickled to stage processes."""

    def send(self, ev: StageEvent, upstream: StageWorker) -> Any | None: ...

    def receive(self, request_id: str, msg: Any, downstream: StageWorker) -> None: ...


@dataclass
class StageLink:
    upstream: str
    downstream: str
    adapter: LinkAdapter


# deliver(downstream stage, request id, link index, message)
Deliver = Callable[[str, str, int, Any], None]
MAX_EARLY_MESSAGES = 4096  # link messages held for requests whose submit has not arrived yet
DONE_MEMORY = 4096  # finished request ids remembered, so their late messages are dropped


class StageHost:
    """A worker plus the links of its requests (see the module note)."""

    def __init__(self, worker: StageWorker, deliver: Deliver) -> None:
        self.worker, self.deliver = worker, deliver
        self.name = worker.name
        self.links: dict[str, list[StageLink]] = {}  # request id -> its links (all stages)
        self.early: dict[str, list[tuple[int, Any]]] = {}  # messages that beat the submit
        self.num_early = 0
        self.done: OrderedDict[str, None] = OrderedDict()

    def submit(self, request_id: str, request: Any, links: list[StageLink]) -> None:
        self.links[request_id] = links
        self.worker.submit(request_id, request)
        for index, msg in self.early.pop(request_id, ()):
            self.num_early -= 1
            self.receive(request_id, index, msg)

    def receive(self, request_id: str, index: int, msg: Any) -> None:
        links = self.links.get(request_id)
        if links is None:
            if request_id in self.done or self.num_early >= MAX_EARLY_MESSAGES:
                return  # late message of a finished request (or a flood): nothing to feed
            self.early.setdefault(request_id, []).append((index, msg))
            self.num_early += 1
            return
        links[index].adapter.receive(request_id, msg, self.worker)

    def abort(self, request_id: str) -> None:
        self.worker.abort(request_id)
        self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        self.links.pop(request_id, None)
        self.num_early -= len(self.early.pop(request_id, ()))
        self.done[request_id] = None
        if len(self.done) > DONE_MEMORY:
            self.done.popitem(last=False)

    def has_work(self) -> bool:
        return self.worker.has_work()

    @property
    def stalled(self) -> bool:
        """Work is pending but the last step could not run any of it (waiting on upstream)."""
        return getattr(self.worker, "stalled", False)

    def step(self) -> list[StageEvent]:
        return self._forward(self.worker.step())

    def launch(self) -> LaunchedStep | None:
        """Queue a step's GPU work (workers without launch/collect step at once)."""
        launch = getattr(self.worker, "launch", None)
        if launch is None:
            t0 = time.perf_counter()
            events = self.worker.step()
            return LaunchedStep(None, events, wall_seconds=time.perf_counter() - t0)
        return launch()

    def collect(self, launched: LaunchedStep) -> list[StageEvent]:
        collect = getattr(self.worker, "collect", None)
        return self._forward(list(launched.events) if collect is None else collect(launched))

    def fail_all(self, error: str) -> list[StageEvent]:
        return self._forward(self.worker.fail_all(error))

    def _forward(self, events: list[StageEvent]) -> list[StageEvent]:
        for ev in events:
            for index, link in enumerate(self.links.get(ev.request_id, ())):
                if link.upstream != self.name:
                    continue
                msg = link.adapter.send(ev, self.worker)
                if msg is not None:
                    self.deliver(link.downstream, ev.request_id, index, msg)
            ev.hidden = None  # rows went to the links; the orchestrator gets control only
            if ev.finished:
                self._forget(ev.request_id)
        return events

    def stats(self) -> dict[str, float]:
        return self.worker.stats()
