"""The orchestrator: one control loop that keeps every stage busy.

NOTE: each loop iteration drains control messages (submit, abort), then steps every stage
that has work, in pipeline order. A stage's step batches all of its ready requests, so the
thinker decodes request A while the talker speaks request B and code2wav renders request C.
Stage-to-stage data (hidden rows, codes) moves through per-request routes set up by the
model's adapters, by reference (same device, no host copy); only small control messages and
the user's outputs (text deltas, audio chunks) pass through here."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from omnistage.outputs import OmniRequestOutput, StageOutput
from omnistage.runtime.stage import StageEvent, StageWorker

log = logging.getLogger("omnistage.runtime")


@dataclass
class RuntimeRequest:
    """One request as the runtime tracks it. Built by a pipeline's prepare()."""

    request_id: str
    path: list[str]  # stages it goes through, in order (the last one finishes it)
    stage_requests: dict[str, Any]  # stage -> what that stage's submit() gets
    text_stage: str
    audio_stage: str | None = None
    sample_rate: int | None = None
    seed: int | None = None
    # upstream stage -> hooks fed with its events (the adapters' side of the handoff)
    routes: dict[str, list[Callable[[StageEvent], None]]] = field(default_factory=dict)
    finalize: Callable[[OmniRequestOutput], None] | None = None
    deadline: float | None = None  # monotonic seconds
    prompt_token_ids: list[int] = field(default_factory=list)
    # state
    sink: Callable[[OmniRequestOutput], None] | None = None
    stream: bool = True  # deliver every delta (False: only the final output)
    arrival: float = 0.0
    stage_tokens: dict[str, list[int]] = field(default_factory=dict)
    stage_reasons: dict[str, str | None] = field(default_factory=dict)
    text: str = ""
    audio_chunks: list[np.ndarray] = field(default_factory=list)
    ttft: float | None = None
    ttfa: float | None = None
    thinker_tokens_at_audio: list[int] = field(default_factory=list)
    done: bool = False


class Orchestrator:
    """background=True: the loop runs in its own thread (AsyncOmniLLM, servers).
    background=False: the caller drives it with run_until() (OmniLLM), which keeps torch's
    CPU work on the calling thread (a second thread costs ~15% on CPU via its own OpenMP team)."""

    def __init__(self, workers: dict[str, StageWorker], background: bool = True) -> None:
        self.workers = workers  # in pipeline order
        self.requests: dict[str, RuntimeRequest] = {}
        self.control: queue.Queue = queue.Queue()
        self.step_delay: dict[str, float] = {}  # test hook: slow a stage down
        # test hook: (stage, request id, tokens so far, audio chunk?) per event
        self.trace: list[tuple[str, str, int, bool]] | None = None
        self.stage_errors: dict[str, int] = {name: 0 for name in workers}
        self.finished_requests = 0
        self._torch_threads = torch.get_num_threads()  # intra-op threads are per OS thread
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._loop, name="omnistage-runtime",
                                            daemon=True)
            self._thread.start()

    # ---------------------------------------------------------------- control (any thread)
    def submit(self, req: RuntimeRequest, sink: Callable[[OmniRequestOutput], None],
               stream: bool = True) -> None:
        req.sink, req.stream = sink, stream
        self.control.put(("submit", req))

    def abort(self, request_id: str, error: str | None = None) -> None:
        self.control.put(("abort", request_id, error))

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.control.put(("wake",))
        if self._thread is not None:
            self._thread.join(timeout)
        else:
            self._drain_control(block=False)
            self._fail_all_requests()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() if self._thread is not None else not self._stop.is_set()

    def run_until(self, done: Callable[[], bool]) -> None:
        """Drive the loop in the calling thread until done() (foreground mode)."""
        if self._thread is not None:
            raise RuntimeError("run_until: this runtime runs in its own thread")
        torch.set_num_threads(self._torch_threads)
        while not done():
            if self._stop.is_set():
                raise RuntimeError("the omnistage runtime was shut down")
            self._iteration()

    def num_active(self) -> int:
        return len(self.requests)

    def stats(self) -> dict[str, dict[str, float]]:
        return {name: w.stats() for name, w in self.workers.items()}

    # ---------------------------------------------------------------- loop (runtime thread)
    def _loop(self) -> None:
        torch.set_num_threads(self._torch_threads)
        while not self._stop.is_set():
            self._iteration()
        self._fail_all_requests()

    def _fail_all_requests(self) -> None:
        for rid in list(self.requests):  # shutdown: nothing is left running
            self._fail(rid, "runtime shut down")

    def _iteration(self) -> None:
        """One pass: control messages, deadlines, then a step of every stage with work."""
        busy = any(w.has_work() for w in self.workers.values())
        self._drain_control(block=not busy)
        self._expire()
        for name, worker in self.workers.items():
            if not worker.has_work():
                continue
            if name in self.step_delay:
                time.sleep(self.step_delay[name])
            t0 = time.perf_counter()
            try:
                events = worker.step()
            except Exception as e:  # noqa: BLE001 - a stage crash fails its requests only
                log.exception("stage %s crashed; failing its requests and restarting it", name)
                self.stage_errors[name] += 1
                events = worker.fail_all(f"stage {name} failed: {type(e).__name__}: {e}")
            if hasattr(worker, "busy_seconds"):
                worker.busy_seconds += time.perf_counter() - t0
            for ev in events:
                self._route(ev)

    def _drain_control(self, block: bool) -> None:
        try:
            msg = self.control.get(timeout=0.05) if block else self.control.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(msg)
            try:
                msg = self.control.get_nowait()
            except queue.Empty:
                return

    def _handle(self, msg: tuple) -> None:
        if msg[0] == "submit":
            req: RuntimeRequest = msg[1]
            req.arrival = time.monotonic()
            self.requests[req.request_id] = req
            try:
                for stage in req.path:
                    self.workers[stage].submit(req.request_id, req.stage_requests[stage])
            except ValueError as e:  # rejected by a stage: fails alone
                self._fail(req.request_id, str(e))
        elif msg[0] == "abort":
            self._fail(msg[1], msg[2] or "request aborted", reason="abort")

    def _expire(self) -> None:
        now = time.monotonic()
        for rid, req in list(self.requests.items()):
            if req.deadline is not None and now > req.deadline:
                self._fail(rid, "request timed out")

    # ---------------------------------------------------------------- events
    def _route(self, ev: StageEvent) -> None:
        req = self.requests.get(ev.request_id)
        if req is None:
            return
        for hook in req.routes.get(ev.stage, ()):
            hook(ev)
        now = time.monotonic() - req.arrival
        req.stage_tokens.setdefault(ev.stage, []).extend(ev.token_ids)
        if self.trace is not None:
            self.trace.append((ev.stage, ev.request_id, len(req.stage_tokens[ev.stage]),
                               ev.audio is not None))
        delta = OmniRequestOutput(req.request_id)
        if ev.stage == req.text_stage and (ev.token_ids or ev.text):
            req.text += ev.text
            delta.text_delta = ev.text
            if req.ttft is None and ev.token_ids:
                req.ttft = now
        if ev.stage == req.audio_stage and ev.audio is not None and len(ev.audio):
            req.audio_chunks.append(ev.audio)
            delta.audio = ev.audio
            req.thinker_tokens_at_audio.append(len(req.stage_tokens.get(req.text_stage, [])))
            if req.ttfa is None:
                req.ttfa = now
        if ev.finished:
            req.stage_reasons[ev.stage] = ev.finish_reason
        if ev.error:
            self._fail(req.request_id, ev.error)
            return
        last = ev.finished and all(stage in req.stage_reasons for stage in req.path)
        if last or (req.stream and (delta.text_delta or delta.audio is not None)):
            self._emit(req, delta, finished=last)

    def _emit(self, req: RuntimeRequest, out: OmniRequestOutput, finished: bool,
              error: str | None = None) -> None:
        out.text = req.text
        out.token_ids = list(req.stage_tokens.get(req.text_stage, []))
        out.prompt_token_ids = req.prompt_token_ids
        out.sample_rate = req.sample_rate
        out.finished, out.error = finished, error
        m = out.metrics
        m.ttft, m.ttfa, m.seed = req.ttft, req.ttfa, req.seed
        if finished:
            m.e2e = time.monotonic() - req.arrival
            m.num_cached_tokens = getattr(req.stage_requests.get(req.text_stage),
                                          "num_cached_tokens", 0)
            for stage in req.path:
                m.tokens_per_stage[stage] = len(req.stage_tokens.get(stage, []))
                out.stages[stage] = StageOutput(stage, list(req.stage_tokens.get(stage, [])),
                                                req.text if stage == req.text_stage else "",
                                                req.stage_reasons.get(stage))
            if req.audio_stage is not None:
                audio = (np.concatenate(req.audio_chunks) if req.audio_chunks
                         else np.zeros(0, dtype=np.float32))
                out.stages[req.audio_stage].audio = audio
            if req.finalize is not None:
                req.finalize(out)
            req.done = True
            self.requests.pop(req.request_id, None)
            self.finished_requests += 1
        if req.sink is not None:
            req.sink(out)

    def _fail(self, request_id: str, error: str, reason: str = "error") -> None:
        req = self.requests.get(request_id)
        if req is None:
            return
        for stage in req.path:
            self.workers[stage].abort(request_id)
        for stage in req.path:
            req.stage_reasons.setdefault(stage, reason)
        self._emit(req, OmniRequestOutput(request_id), finished=True, error=error)
