"""Engine-level step types: the typed event a stage step produces for one request, a step
whose GPU work is queued (launch -> collect), and the CUDA stream a stage launches on. Every
engine (AR, gen) produces them; the runtime (runtime/stage.py) re-exports them."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from omnistage.engine.streams import private_stream


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
    # multi-codebook AR stages: one row per new token, all its codebooks (token_ids = the first)
    codes: list[list[int]] = field(default_factory=list)
    images: list[np.ndarray] | None = None  # image stages: uint8 [H, W, 3] per image, host
    progress: tuple[int, int] | None = None  # iterative stages: (steps done, steps in all)
    # data for the downstream stages' links only (latents, text embeddings); never reaches the
    # orchestrator (StageHost drops it once the links have it, as it does `hidden`)
    payload: Any = None
    # SamplingParams.logprobs: per new token, {token id: logprob}: the emitted token's, then
    # the top k (OmniRequestOutput.logprobs)
    logprobs: list[dict[int, float]] | None = None


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
            # end is recorded once the thread has queued the work; a launch that failed on
            # that thread recorded none (its error reached collect, which failed the stage)
            if self.pending.exception() is not None:
                return self.wall_seconds
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
