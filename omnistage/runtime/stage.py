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

import contextlib

import copy
import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from omnistage.engine.ar.engine import AREngine
from omnistage.engine.ar.sequence import Sequence
from omnistage.engine.step import LaunchedStep, StageEvent, StageStream  # noqa: F401

log = logging.getLogger("omnistage.runtime")


class StageWorker(Protocol):
    """What the runtime needs of a stage (AR: ARStageWorker; non-AR: engine.gen's worker).
    Called from the runtime's thread only; a launched step is collected before the next launch.
    """

    name: str
    device: torch.device
    stalled: bool  # work is pending, but the last launch could run none of it (gated upstream)
    busy_seconds: float  # the runtime adds each step's GPU (or host) time

    def submit(self, request_id: str, request: Any) -> None:
        """Take a new request (what the pipeline's prepare() built for this stage)."""

    def abort(self, request_id: str) -> None:
        """Forget a request; a step in flight may still compute it (collect drops it)."""

    def has_work(self) -> bool: ...

    def launch(self) -> LaunchedStep | None:
        """Queue the next step's work (on CUDA, on the stage's stream) without waiting; None
        when nothing can run now."""

    def collect(self, launched: LaunchedStep) -> list[StageEvent]:
        """The events of a launched step, once launched.done() (blocks until then)."""

    def step(self) -> list[StageEvent]:
        """launch() then collect(): one whole step (the serial loop, tests)."""

    def stats(self) -> dict[str, float]: ...

    def describe(self) -> dict[str, Any]:
        """Device state for a stall report (whether its stream is idle)."""

    def fail_all(self, error: str) -> list[StageEvent]:
        """After a crash: end every request of this stage with `error`, freeing its state."""

    def request_ids(self) -> list[str]:
        """The requests this stage holds, oldest first."""

    def restrict(self, request_ids: frozenset[str] | None) -> None:
        """Until restrict(None), steps run only these requests (StageHost.recover)."""

    def reset_step(self) -> None:
        """After a step raised: forget any step in flight or queued ahead (its work is not
        collected); the requests stay, at their last collected state."""

    def fail(self, request_id: str, error: str) -> list[StageEvent]:
        """End one request with `error` (the others go on), freeing its state."""


class ARStageWorker:
    """An AR stage: one AREngine; its requests are engine Sequences."""

    def __init__(self, name: str, engine: AREngine, priority: int = -1) -> None:
        self.name, self.engine = name, engine
        self.device = engine.runner.device
        # NOTE: each AR stage has a stream of its own, so the talker's short decode steps run
        # beside the thinker's (H100, c1: time to first audio 0.28 -> 0.24 s against one
        # shared stream); the pipeline gives the upstream stage the higher priority (a lower
        # number), as its tokens gate the downstream one. AR stages whose EngineConfig has
        # the same ar_stream name share one stream again.
        self.gpu = StageStream(self.device, priority, share=engine.config.ar_stream)
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
                           codes=u.new_codes, finished=u.finished, finish_reason=u.finish_reason,
                           error=u.error, logprobs=u.logprobs)
                for u in updates]

    def fail_all(self, error: str) -> list[StageEvent]:
        """After a crash: end every request of this stage with `error`, freeing their blocks."""
        self.reset_step()
        return [ev for rid in list(self.engine.seqs) for ev in self.fail(rid, error)]

    def fail(self, request_id: str, error: str) -> list[StageEvent]:
        if self.engine.fail(request_id, error) is None:
            return []
        return [StageEvent(self.name, request_id, finished=True, finish_reason="error",
                           error=error)]

    def request_ids(self) -> list[str]:
        return list(self.engine.seqs)

    def idle_capture(self) -> bool:
        """One decode graph a lazy warm-up queued (EngineConfig.graph_warmup_plan), captured
        now (True). The runtime calls it only when no stage has work (see
        engine/gen/worker.idle_capture for why not beside other stages)."""
        return not self.engine.has_unfinished() and self.engine.runner.idle_capture()

    def close(self) -> None:
        """The runtime stopped: stop the stage's tensor-parallel ranks (idempotent)."""
        self.engine.runner.close()

    def restrict(self, request_ids: frozenset[str] | None) -> None:
        self.engine.scheduler.only = request_ids

    def reset_step(self) -> None:
        self._queued = None
        self.engine.drop_ahead()

    def describe(self) -> dict[str, Any]:
        return self.gpu.describe()

    def stats(self) -> dict[str, float]:
        s = self.engine.stats
        return {"queue": s["num_waiting"], "running": s["num_running"],
                "batch_size": self.last_batch_size, "free_kv_blocks": s["num_free_blocks"],
                "kv_blocks": s["num_kv_blocks"], "busy_seconds": self.busy_seconds,
                "steps": s["num_steps"], "ahead_steps": s["num_ahead_steps"],
                "prefix_cache_hit_tokens": s["prefix_cache_hit_tokens"],
                "preemptions": s["num_preemptions"], "captures_pending": self.captures_pending()}

    def captures_pending(self) -> int:
        """Decode graphs a lazy warm-up left for the idle passes (0: every one captured)."""
        return self.engine.runner.pending_captures()


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
_MOVE_DEPTH = 3  # containers inside a link message searched for tensors
# A link message's field with this metadata holds host data (codes the next stage reads on
# the CPU): move_tensors leaves it where it is, so a GPU stage does not copy it to its device
# and back (a stream sync per request per step)
HOST_DATA = {"host": True}


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Makes `device` the current CUDA device (a no-op off CUDA). Triton kernels and CUDA
    graphs launch on the current device, not their tensors': a stage on cuda:1 driven from a
    thread whose current device is cuda:0 would otherwise launch its kernels on the wrong GPU."""
    if device.type != "cuda" or device.index is None:
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def move_tensors(obj: Any, device: torch.device, depth: int = _MOVE_DEPTH) -> Any:
    """`obj` (a link message: dataclass, tuple, list, dict or tensor) with its tensors on
    `device`; obj itself when none has to move.

    NOTE: between two GPUs of one host this is a device-to-device copy (peer-to-peer over
    NVLink/PCIe, queued without a host sync: non_blocking); a tensor that came from another
    process arrived as a CUDA IPC handle, so it too is copied GPU to GPU, never through host
    memory. Towards the CPU (a Ray object, a CPU stage) the copy is blocking, as a
    non_blocking copy into pageable memory could be read before it lands. A dataclass field
    marked HOST_DATA stays where it is."""
    if isinstance(obj, torch.Tensor):
        if obj.device == device or (device.index is None and obj.device.type == device.type):
            return obj
        return obj.to(device, non_blocking=device.type == "cuda")
    if depth == 0 or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return obj
    if isinstance(obj, (list, tuple)):
        moved = [move_tensors(x, device, depth - 1) for x in obj]
        if all(a is b for a, b in zip(moved, obj)):
            return obj
        return type(obj)(moved) if isinstance(obj, list) or type(obj) is tuple else \
            type(obj)(*moved)
    if isinstance(obj, dict):
        moved_d = {k: move_tensors(v, device, depth - 1) for k, v in obj.items()}
        return obj if all(moved_d[k] is v for k, v in obj.items()) else moved_d
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {}
        for f in dataclasses.fields(obj):
            if f.metadata.get("host"):
                continue
            value = getattr(obj, f.name)
            moved_v = move_tensors(value, device, depth - 1)
            if moved_v is not value:
                changes[f.name] = moved_v
        if not changes:
            return obj
        out = copy.copy(obj)
        for name, value in changes.items():
            object.__setattr__(out, name, value)
        return out
    return obj
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
        with on_device(self.worker.device):
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
        # data from a stage on another device: moved next to this one (see move_tensors)
        with on_device(self.worker.device):
            links[index].adapter.receive(request_id, move_tensors(msg, self.worker.device),
                                         self.worker)

    def abort(self, request_id: str) -> None:
        with on_device(self.worker.device):
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
        return self.worker.stalled

    def step(self) -> list[StageEvent]:
        with on_device(self.worker.device):
            return self._forward(self.worker.step())

    def launch(self) -> LaunchedStep | None:
        """Queue a step's GPU work (collect() gives its events)."""
        with on_device(self.worker.device):
            return self.worker.launch()

    def collect(self, launched: LaunchedStep) -> list[StageEvent]:
        with on_device(self.worker.device):
            return self._forward(self.worker.collect(launched))

    def fail_all(self, error: str) -> list[StageEvent]:
        with on_device(self.worker.device):
            return self._forward(self.worker.fail_all(error))

    def recover(self, exc: Exception) -> list[StageEvent]:
        """After a step raised `exc`: find the requests that make it raise, fail those alone,
        and go on with the rest (their events of the probe steps are returned too).

        NOTE (request-fatal vs stage-fatal): each request the stage holds runs one step
        alone. A request whose step raises alone is a culprit: it fails with its own error,
        and no other request sees it. When every request fails alone (a broken device, a
        bad weight), the stage itself is broken and all of them have failed, as before. A
        step that no longer raises once split (a transient fault) costs only the probe."""
        with on_device(self.worker.device):
            return self._recover(exc)

    def _recover(self, exc: Exception) -> list[StageEvent]:
        cause = f"{type(exc).__name__}: {exc}"
        self.worker.reset_step()
        suspects = self.worker.request_ids()
        events: list[StageEvent] = []
        culprits = 0
        for rid in suspects:
            self.worker.restrict(frozenset((rid,)))
            try:
                events += self._forward(self.worker.step())
            except Exception as e:  # noqa: BLE001 - this request's own step fails it alone
                self.worker.reset_step()
                culprits += 1
                log.warning("stage %s: request %s fails alone: %s: %s", self.name, rid,
                            type(e).__name__, e)
                events += self._forward(self.worker.fail(
                    rid, f"stage {self.name} failed on this request: {type(e).__name__}: {e}"))
            finally:
                self.worker.restrict(None)
        log.error("stage %s: a step raised (%s); %d of its %d requests fail alone, the rest go "
                  "on", self.name, cause, culprits, len(suspects))
        return events

    def _forward(self, events: list[StageEvent]) -> list[StageEvent]:
        for i, ev in enumerate(events):
            try:
                for index, link in enumerate(self.links.get(ev.request_id, ())):
                    if link.upstream != self.name:
                        continue
                    msg = link.adapter.send(ev, self.worker)
                    if msg is not None:
                        self.deliver(link.downstream, ev.request_id, index, msg)
            except Exception as e:  # noqa: BLE001 - a handoff that fails fails its request
                log.exception("stage %s: the handoff of request %s failed", self.name,
                              ev.request_id)
                # (the orchestrator's failure of the request aborts it in every stage)
                ev = events[i] = StageEvent(self.name, ev.request_id, finished=True,
                                            finish_reason="error", error=f"stage {self.name}: "
                                            f"handoff failed: {type(e).__name__}: {e}")
            ev.hidden = ev.payload = None  # went to the links; the orchestrator gets control
            if ev.finished:
                self._forget(ev.request_id)
        return events

    def stats(self) -> dict[str, float]:
        return self.worker.stats()
