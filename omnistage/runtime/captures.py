"""Captures under load: the graphs a lazy warm-up queued, taken while requests run.

A lazy start (EngineConfig.graph_warmup_plan, GenEngineConfig.warmup_plan = "lazy") captures
at load only what first requests need. The rest used to wait for idle passes, so sustained load
right after a start never got its graphs and ran padded or eagerly. Now a step that runs
without its own graph marks that graph wanted (wants_capture()); the runtime then drains every
stage of its process, captures the most wanted graph, and resumes.

Draining: no stage starts a step; steps in flight, an AR stage's step queued ahead and a
code2wav step in parts finish (each worker's `draining` flag; drained() says when).

NOTE (why every stage drains, not only the one that captures): capturing a new shape compiles
it, and torch.compile's FX tracing patches nn.Module.__call__ for the whole process while it
traces (engine/gen/worker.idle_capture); a step on another thread meanwhile fails.

Rate: after a capture of t seconds the next waits at least t * (1 - SHARE) / SHARE, so captures
take at most SHARE of the time under load, and the requests in flight stall for one capture at
a time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from omnistage.runtime.stage import StageHost, on_device

log = logging.getLogger(__name__)

SHARE = 0.25  # the most of the time under load that captures may take
MIN_GAP_S = 0.1  # between two captures under load, however short


class LoadCaptures:
    """One runtime loop's captures under load (the orchestrator's, a stage process's)."""

    def __init__(self, share: float = SHARE, min_gap_s: float = MIN_GAP_S) -> None:
        if not 0 < share < 1:
            raise ValueError(f"share: in (0, 1), got {share}")
        self.share, self.min_gap_s = share, min_gap_s
        self.target: str | None = None  # the stage that captures once every stage drained
        self.not_before = 0.0  # time.monotonic() of the next allowed capture
        self.captures, self.seconds = 0, 0.0

    @property
    def draining(self) -> bool:
        return self.target is not None

    def start(self, hosts: Mapping[str, StageHost]) -> bool:
        """Before a pass launches steps: if a stage wants a graph and the rate allows, every
        stage starts draining (True while they drain)."""
        if self.target is not None:
            return True
        if time.monotonic() < self.not_before:
            return False
        for name, host in hosts.items():
            wants = getattr(host.worker, "wants_capture", None)
            if wants is not None and wants():
                self.target = name
                break
        if self.target is None:
            return False
        for host in hosts.values():
            if hasattr(host.worker, "draining"):
                host.worker.draining = True
        return True

    def finish(self, hosts: Mapping[str, StageHost], in_flight: bool) -> bool:
        """After a pass collected its steps: with nothing in flight and every stage drained,
        the target stage captures its most wanted graph and every stage resumes (True: a
        capture ran or failed; the caller skips its idle capture this pass)."""
        if self.target is None or in_flight or not all(
                getattr(h.worker, "drained", lambda: True)() for h in hosts.values()):
            return False
        name, self.target = self.target, None
        host = hosts.get(name)
        t0 = time.perf_counter()
        try:
            if host is not None:
                with on_device(host.worker.device):
                    if host.worker.capture_wanted():
                        self.captures += 1
        except Exception:  # noqa: BLE001 - the graph stays uncaptured (padded/eager steps); it
            # left the queue before its capture, so it is not retried
            log.exception("stage %s: a graph capture under load failed", name)
        finally:
            for h in hosts.values():
                if hasattr(h.worker, "draining"):
                    h.worker.draining = False
        took = time.perf_counter() - t0
        self.seconds += took
        self.not_before = time.monotonic() + max(self.min_gap_s,
                                                 took * (1 - self.share) / self.share)
        return True

    def stats(self) -> dict[str, float]:
        return {"captures_under_load": self.captures,
                "captures_under_load_seconds": round(self.seconds, 3)}
