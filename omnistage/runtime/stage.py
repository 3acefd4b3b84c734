"""Stage workers: the uniform face every stage shows the orchestrator (submit, abort, step),
and the typed event a step produces for one request."""

from __future__ import annotations

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


class ARStageWorker:
    """An AR stage: one AREngine; its requests are engine Sequences."""

    def __init__(self, name: str, engine: AREngine) -> None:
        self.name, self.engine = name, engine
        self.last_batch_size = 0
        self.busy_seconds = 0.0

    def submit(self, request_id: str, request: Sequence) -> None:
        self.engine.add_request(request)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def has_work(self) -> bool:
        return self.engine.has_unfinished()

    def step(self) -> list[StageEvent]:
        updates = self.engine.step()
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
