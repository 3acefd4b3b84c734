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

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

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

    def __init__(self, name: str, engine: AREngine) -> None:
        self.name, self.engine = name, engine
        self.last_batch_size = 0
        self.busy_seconds = 0.0
        self.stalled = False  # the last step scheduled nothing (e.g. gated on upstream rows)

    def submit(self, request_id: str, request: Sequence) -> None:
        self.engine.add_request(request)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def step(self) -> list[StageEvent]:
        steps = self.engine.num_steps
        updates = self.engine.step()
        self.stalled = self.engine.num_steps == steps
        self.last_batch_size = len(updates)
        return [StageEvent(self.name, u.request_id, u.new_token_ids, u.new_text, u.hidden,
                           finished=u.finished, finish_reason=u.finish_reason, error=u.error)
                for u in updates]

    def fail_all(self, error: str) -> list[StageEvent]:
        """After a crash: end every request of this stage with `error`, freeing their blocks."""
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
                "steps": s["num_steps"], "prefix_cache_hit_tokens": s["prefix_cache_hit_tokens"],
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
