"""The orchestrator: one control loop that keeps every stage busy.

NOTE: each loop iteration drains control messages (submit, abort), then steps every stage
that has work, in pipeline order. A stage's step batches all of its ready requests, so the
thinker decodes request A while the talker speaks request B and code2wav renders request C.
A stage runs here (a StageHost stepped by this loop) or in a process of its own (process.py),
which steps itself; this loop then only polls its events. Stage-to-stage data (hidden rows,
codes) moves through each request's links, set up by the model's adapters: by reference
within a process, over a pipe of their own between stage processes; only small control
messages and the user's outputs (text deltas, audio chunks) pass through here."""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from PIL import Image

from omnistage.outputs import OmniRequestOutput, StageOutput
from omnistage.runtime.process import ProcessStage, StageProcessSpec, unpack_events
from omnistage.runtime.replicas import ReplicaSet
from omnistage.runtime.stage import (LaunchedStep, StageEvent, StageHost, StageLink,
                                     StageWorker, on_device)

log = logging.getLogger("omnistage.runtime")
STALL_WARNING_SECONDS = 60.0  # a launched step this long unfinished is logged (with streams)


@dataclass
class RuntimeRequest:
    """One request as the runtime tracks it. Built by a pipeline's prepare()."""

    request_id: str
    path: list[str]  # stages it goes through, in order (the last one finishes it)
    stage_requests: dict[str, Any]  # stage -> what that stage's submit() gets
    text_stage: str
    audio_stage: str | None = None
    image_stage: str | None = None  # the stage whose events carry the images (uint8 HWC)
    progress_total: int | None = None  # iterative requests: the steps their progress counts
    sample_rate: int | None = None
    seed: int | None = None
    # stage -> stage handoffs of this request (the adapters), run beside the stages
    links: list[StageLink] = field(default_factory=list)
    finalize: Callable[[OmniRequestOutput], None] | None = None
    deadline: float | None = None  # monotonic seconds
    prompt_token_ids: list[int] = field(default_factory=list)
    # state
    sink: Callable[[OmniRequestOutput], None] | None = None
    stream: bool = True  # deliver every delta (False: only the final output)
    arrival: float = 0.0
    stage_tokens: dict[str, list[int]] = field(default_factory=dict)
    stage_codes: dict[str, list[list[int]]] = field(default_factory=dict)
    stage_logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)
    logprobs_sent: int = 0  # the text stage's logprobs already in a streamed output
    stage_reasons: dict[str, str | None] = field(default_factory=dict)
    text: str = ""
    audio_chunks: list[np.ndarray] = field(default_factory=list)
    images: list[np.ndarray] = field(default_factory=list)
    progress: tuple[int, int] | None = None
    ttft: float | None = None
    ttfa: float | None = None
    thinker_tokens_at_audio: list[int] = field(default_factory=list)
    done: bool = False


class Orchestrator:
    """background=True: the loop runs in its own thread (AsyncOmniLLM, servers).
    background=False: the caller drives it with run_until() (OmniLLM), which keeps torch's
    CPU work on the calling thread (a second thread costs ~15% on CPU via its own OpenMP team)."""

    def __init__(self, workers: dict[str, StageWorker], background: bool = True,
                 process_stages: dict[str, StageProcessSpec] | None = None,
                 order: list[str] | None = None, startup_timeout: float = 600.0,
                 overlap: bool | None = None) -> None:
        # NOTE: keys of `workers` / `process_stages` are units: a stage, or one replica of a
        # replicated stage ("code2wav/1", replicas.unit_name); `hosts` has one entry per stage
        # (a ReplicaSet where a stage has several replicas), the loop steps every unit
        process_stages = process_stages or {}
        self.workers = workers  # the stage units in this process
        if overlap is None:  # auto: on when a stage here runs on a GPU
            overlap = any(w.device.type == "cuda" for w in workers.values())
        self.overlap = overlap
        self.inflight: dict[str, LaunchedStep] = {}  # overlap: launched, not collected yet
        self.local = {n: StageHost(w, self._deliver) for n, w in workers.items()}
        self.remote = {n: self._remote_stage(spec) for n, spec in process_stages.items()}
        self.units: dict[str, Any] = {**self.local, **self.remote}
        by_stage: dict[str, list[Any]] = {}
        for unit in sorted(self.units, key=lambda u: (u.split("/")[0], len(u), u)):
            by_stage.setdefault(self.units[unit].name, []).append(self.units[unit])
        order = order or list(by_stage)
        self.hosts: dict[str, Any] = {
            n: by_stage[n][0] if len(by_stage[n]) == 1 else ReplicaSet(n, by_stage[n])
            for n in order}
        self.unit_stage = {u: h.name for u, h in self.units.items()}
        specs = list(process_stages.values())
        self.edges = [(i.upstream, s.name) for s in (specs[0].pipeline.stages if specs else ())
                      for i in s.inputs if i.upstream in self.hosts and s.name in self.hosts]
        self.requests: dict[str, RuntimeRequest] = {}
        self.control: queue.Queue = queue.Queue()
        self.step_delay: dict[str, float] = {}  # test hook: slow a stage down
        # test hook: (stage, request id, tokens so far, audio chunk?) per event
        self.trace: list[tuple[str, str, int, bool]] | None = None
        self.stage_errors: dict[str, int] = {name: 0 for name in self.hosts}
        self.unit_errors: dict[str, int] = {unit: 0 for unit in self.units}
        self.finished_requests = 0
        self._torch_threads = torch.get_num_threads()  # intra-op threads are per OS thread
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = mp.Pipe(duplex=False) if self.remote else (None, None)
        # idle: how long to wait on stage processes' pipes (a Ray actor has none to wake us:
        # its events are polled, so the wait is short)
        self._idle_wait = 0.005 if any(s.spec.worker == "ray" for s in self.remote.values()) \
            else 0.05
        if self.remote:
            self._start_remote(startup_timeout)
        if background:
            self._thread = threading.Thread(target=self._loop, name="omnistage-runtime",
                                            daemon=True)
            self._thread.start()

    # ---------------------------------------------------------------- control (any thread)
    def submit(self, req: RuntimeRequest, sink: Callable[[OmniRequestOutput], None],
               stream: bool = True) -> None:
        req.sink, req.stream = sink, stream
        self._put(("submit", req))

    def abort(self, request_id: str, error: str | None = None) -> None:
        self._put(("abort", request_id, error))

    def _put(self, msg: tuple) -> None:
        self.control.put(msg)
        if self._wake_w is not None:  # the loop may be waiting on stage processes
            self._wake_w.send_bytes(b"")

    def set_step_delay(self, stage: str, seconds: float) -> None:
        """Test hook: slow a stage (every replica of it) down, here or in its process."""
        for unit, name in self.unit_stage.items():
            if name != stage:
                continue
            if unit in self.remote:
                self.remote[unit].set_step_delay(seconds)
            else:
                self.step_delay[unit] = seconds

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop after its current step: requests still running end with the error
        'runtime shut down' (their sinks are called from the loop's thread), stage processes
        stop. Waits up to `timeout` s for the loop's thread; safe to call again."""
        self._stop.set()
        self._put(("wake",))
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("the runtime thread did not stop within %.0f s (a stage step still "
                          "running?)", timeout)
        else:
            self._drain_control(block=False)
            self._fail_all_requests()
            self._stop_remote()
            self._close_local()

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
        """Per stage (a replicated stage's replicas added up: replica_stats)."""
        return {name: h.stats() for name, h in self.hosts.items()}

    def replica_stats(self) -> dict[str, list[dict[str, float]]]:
        """Per stage, each replica's stats (one entry for a stage of one replica)."""
        return {name: h.replica_stats() if isinstance(h, ReplicaSet) else [h.stats()]
                for name, h in self.hosts.items()}

    def replica_of(self, stage: str, request_id: str) -> int | None:
        """Which replica of `stage` holds the request now (0 for a stage of one replica)."""
        host = self.hosts[stage]
        return host.replica_of(request_id) if isinstance(host, ReplicaSet) else 0

    # ---------------------------------------------------------------- stage processes
    @staticmethod
    def _remote_stage(spec: StageProcessSpec) -> Any:
        if spec.worker == "ray":
            from omnistage.runtime.ray_placement import RayStage
            return RayStage(spec)
        return ProcessStage(spec)

    def _direct(self, up: str, down: str) -> bool:
        """Whether an edge's data goes stage to stage without this process: both ends one
        unit of the same kind outside it (a pipe between stage processes, a Ray call between
        actors); else through here (a replicated end: the ReplicaSet routes it)."""
        a, b = self.hosts[up], self.hosts[down]
        return (up in self.remote and down in self.remote
                and type(a) is type(b) and not isinstance(a, ReplicaSet))

    def _start_remote(self, timeout: float) -> None:
        direct = [(u, d) for u, d in self.edges if self._direct(u, d)]
        pipes = {(u, d): mp.get_context("spawn").Pipe(duplex=False) for u, d in direct
                 if isinstance(self.remote[u], ProcessStage)}
        for stage in reversed(list(self.remote.values())):  # Ray: downstream handles first
            name = stage.name
            if isinstance(stage, ProcessStage):
                stage.start({u: pipes[(u, d)][0] for u, d in pipes if d == name},
                            {d: pipes[(u, d)][1] if (u, d) in pipes else None
                             for u, d in self.edges if u == name})
            else:
                stage.start({d: self.remote[d] if (name, d) in direct else None
                             for u, d in self.edges if u == name})
        deadline = time.monotonic() + timeout
        while not all(s.ready for s in self.remote.values()):
            for unit, stage in self.remote.items():
                for msg in stage.poll():
                    if msg[0] == "ready":
                        stage.ready = True
                    elif msg[0] == "failed":
                        self._stop_remote()
                        raise RuntimeError(f"stage {unit}: its process failed to start: {msg[1]}")
                if stage.dead:
                    self._stop_remote()
                    raise RuntimeError(f"stage {unit}: {stage.death()} while starting")
            if time.monotonic() > deadline:
                self._stop_remote()
                raise RuntimeError(f"stage processes not ready after {timeout} s")
            time.sleep(0.01)

    def _restart(self, unit: str) -> None:
        """A stage unit's process (or Ray actor) died: fail the requests it held, start a new
        one, relink its neighbours."""
        stage = self.remote[unit]
        name = stage.name
        cause = stage.death()
        log.error("stage %s: %s; restarting it", unit, cause)
        self.stage_errors[name] += 1
        self.unit_errors[unit] += 1
        host = self.hosts[name]
        held = set(host.requests_on(host.replicas.index(stage))) \
            if isinstance(host, ReplicaSet) else None
        for rid, req in list(self.requests.items()):
            if name in req.path and (held is None or rid in held):
                self._fail(rid, f"stage {unit}: {cause}")
        if not isinstance(stage, ProcessStage):  # a Ray actor: re-placed, relinked by handle
            stage.restarts += 1
            stage.restart()
            for up, down in self.edges:
                if down == name and self._direct(up, down):
                    self.remote[up].send(("relink_out", name, stage))
            return
        stage.conn = None
        ctx = mp.get_context("spawn")
        in_edges, out_edges = {}, {}
        for up, down in self.edges:
            if down == name and self._direct(up, down):
                r, w = ctx.Pipe(duplex=False)
                in_edges[up] = r
                self.remote[up].send(("relink_out", name, w))
                w.close()
            elif up == name:
                out_edges[down] = None
                if self._direct(up, down):
                    r, w = ctx.Pipe(duplex=False)
                    out_edges[down] = w
                    self.remote[down].send(("relink_in", name, r))
                    r.close()
        stage.restarts += 1
        stage.start(in_edges, out_edges)

    def _poll_remote(self, unit: str) -> None:
        stage = self.remote[unit]
        for msg in stage.poll():
            kind = msg[0]
            if kind == "events":
                for ev in unpack_events(stage.name, msg[1]):
                    self._route(ev)
            elif kind == "data":  # a link into a stage of this process
                self.hosts[msg[1]].receive(*msg[2:])
            elif kind == "stats":
                stage.last_stats = msg[1]
                stage.stats_replies += 1
            elif kind == "ready":
                stage.ready = True
            elif kind == "failed":
                log.error("stage %s: its process failed to start: %s", unit, msg[1])
        if stage.dead and not self._stop.is_set():
            self._restart(unit)

    def refresh_stats(self, timeout: float = 5.0) -> dict[str, dict[str, float]]:
        """stats() with fresh numbers from every stage process (foreground runtimes only)."""
        if self._thread is not None:
            raise RuntimeError("refresh_stats: this runtime polls in its own thread")
        want = {n: s.stats_replies + 1 for n, s in self.remote.items()}
        for s in self.remote.values():
            s.send(("stats",))
        deadline = time.monotonic() + timeout
        while any(self.remote[n].stats_replies < k for n, k in want.items()) \
                and time.monotonic() < deadline:
            self._wait_remote(0.05)
            for name in self.remote:
                self._poll_remote(name)
        return self.stats()

    def _wait_remote(self, timeout: float) -> None:
        conns = [self._wake_r, *(s.conn for s in self.remote.values() if s.conn is not None)]
        if mp.connection.wait(conns, timeout=timeout):
            while self._wake_r.poll():
                self._wake_r.recv_bytes()

    def _stop_remote(self) -> None:
        for stage in self.remote.values():
            stage.stop(timeout=5.0)

    def _close_local(self) -> None:
        """Shutdown, in the thread that steps the stages: each stage of this process frees
        what outlives its requests (an AR stage's tensor-parallel ranks: engine/ar/tp_workers.py).
        Stage workers without a close() hold nothing of the kind."""
        for unit, host in self.local.items():
            close = getattr(host.worker, "close", None)
            if close is None:
                continue
            try:
                with on_device(host.worker.device):  # its collectives on its own GPU
                    close()
            except Exception:  # noqa: BLE001 - one stage's failure must not stop the others'
                log.exception("stage %s: close failed", unit)

    def _deliver(self, downstream: str, request_id: str, index: int, msg: Any) -> None:
        self.hosts[downstream].receive(request_id, index, msg)

    # ---------------------------------------------------------------- loop (runtime thread)
    def _loop(self) -> None:
        torch.set_num_threads(self._torch_threads)
        while not self._stop.is_set():
            self._iteration()
        self._fail_all_requests()
        self._stop_remote()
        self._close_local()

    def _fail_all_requests(self) -> None:
        for rid in list(self.requests):  # shutdown: nothing is left running
            self._fail(rid, "runtime shut down")

    def _iteration(self) -> None:
        """One pass: control messages, deadlines, then a step of every stage with work."""
        busy = bool(self.inflight) or any(h.has_work() for h in self.local.values())
        if self.remote:
            self._wait_remote(0.0 if busy else self._idle_wait)
            self._drain_control(block=False)
        else:
            self._drain_control(block=not busy)
        self._expire()
        alone = any(launched.exclusive for launched in self.inflight.values())
        for name, host in self.units.items():
            if name in self.remote:
                self._poll_remote(name)
            elif host.has_work() and name not in self.inflight and not alone:
                if name in self.step_delay:
                    time.sleep(self.step_delay[name])
                if self.overlap:
                    self._launch(name, host)
                else:
                    self._sync_step(name, host)
        if self.inflight:
            self._collect_finished()
        elif not busy and not any(h.has_work() for h in self.local.values()):
            self._idle_capture()

    def _idle_capture(self) -> None:
        """Nothing runs: one graph a lazy warm-up left (engine/gen/worker.idle_capture)."""
        for name, host in self.local.items():
            capture = getattr(host.worker, "idle_capture", None)
            if capture is None:
                continue
            try:
                with on_device(host.worker.device):
                    if capture():
                        return
            except Exception:  # noqa: BLE001 - the shape stays uncaptured (eager/padded); it
                # left the queue before its capture, so it is not retried
                log.exception("stage %s: an idle-time graph capture failed", name)

    def _sync_step(self, name: str, host: StageHost) -> None:
        t0 = time.perf_counter()
        try:
            events = host.step()
        except Exception as e:  # noqa: BLE001 - a stage crash fails its requests only
            events = self._crashed(name, host, e)
        host.worker.busy_seconds += time.perf_counter() - t0
        for ev in events:
            self._route(ev)

    def _launch(self, name: str, host: StageHost) -> None:
        # NOTE (overlap): every stage queues its step (StageStream) before any is collected,
        # so code2wav's chunks run on the GPU beside the thinker's and talker's decode steps
        try:
            launched = host.launch()
        except Exception as e:  # noqa: BLE001 - a stage crash fails its requests only
            for ev in self._crashed(name, host, e):
                self._route(ev)
            return
        if launched is not None:
            self.inflight[name] = launched

    def _collect_finished(self) -> None:
        """Wait until a launched step is done; collect every done one and route its events."""
        done = [n for n, launched in self.inflight.items() if launched.done()]
        t0, warned = time.monotonic(), False
        while not done:
            time.sleep(0)  # lets other threads (the API server) run while polling
            done = [n for n, launched in self.inflight.items() if launched.done()]
            if not warned and time.monotonic() - t0 > STALL_WARNING_SECONDS:
                warned = True
                log.error("no stage step finished in %.0f s: %s", STALL_WARNING_SECONDS,
                          {n: self.local[n].worker.describe() for n in self.inflight})
        for name in done:
            launched, host = self.inflight.pop(name), self.local[name]
            try:
                events = host.collect(launched)
            except Exception as e:  # noqa: BLE001 - a stage crash fails its requests only
                events = self._crashed(name, host, e)
            host.worker.busy_seconds += launched.busy_seconds()
            for ev in events:
                self._route(ev)

    def _crashed(self, name: str, host: StageHost, e: Exception) -> list[StageEvent]:
        """A step of stage `name` raised: its culprits fail alone (StageHost.recover)."""
        log.error("stage %s: a step raised; finding the requests that make it raise", name,
                  exc_info=e)
        self.stage_errors[host.name] += 1
        self.unit_errors[name] += 1
        self.inflight.pop(name, None)
        return host.recover(e)

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
            try:  # downstream first: a stage process is set up before data reaches it
                for stage in reversed(req.path):
                    self.hosts[stage].submit(req.request_id, req.stage_requests[stage],
                                             req.links)
            except ValueError as e:  # rejected by a stage: fails alone
                self._fail(req.request_id, str(e))
            except Exception as e:  # noqa: BLE001 - a request that breaks a submit fails alone
                log.exception("request %s: a stage's submit raised", req.request_id)
                self._fail(req.request_id, f"request failed at submit: {type(e).__name__}: {e}")
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
        now = time.monotonic() - req.arrival
        req.stage_tokens.setdefault(ev.stage, []).extend(ev.token_ids)
        if ev.codes:
            req.stage_codes.setdefault(ev.stage, []).extend(ev.codes)
        if ev.logprobs:
            req.stage_logprobs.setdefault(ev.stage, []).extend(ev.logprobs)
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
        if ev.stage == req.image_stage and ev.images:
            req.images.extend(ev.images)
        if ev.progress is not None:
            req.progress = delta.progress = ev.progress
        if ev.finished:
            req.stage_reasons[ev.stage] = ev.finish_reason
            host = self.hosts.get(ev.stage)
            if isinstance(host, ReplicaSet):
                host.release(req.request_id, failed=bool(ev.error))
        if ev.error:
            self._fail(req.request_id, ev.error)
            return
        last = ev.finished and all(stage in req.stage_reasons for stage in req.path)
        if last or (req.stream and (delta.text_delta or delta.audio is not None
                                    or delta.progress is not None)):
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
        out.progress = out.progress or req.progress
        lps = req.stage_logprobs.get(req.text_stage)
        if lps is not None:
            out.logprobs, out.logprobs_delta = list(lps), lps[req.logprobs_sent:]
            req.logprobs_sent = len(lps)
        if finished:
            m.e2e = time.monotonic() - req.arrival
            m.num_cached_tokens = getattr(req.stage_requests.get(req.text_stage),
                                          "num_cached_tokens", 0)
            for stage in req.path:
                m.tokens_per_stage[stage] = len(req.stage_tokens.get(stage, []))
                out.stages[stage] = StageOutput(stage, list(req.stage_tokens.get(stage, [])),
                                                req.text if stage == req.text_stage else "",
                                                req.stage_reasons.get(stage))
                if stage in req.stage_codes:
                    out.stages[stage].codes = np.asarray(req.stage_codes[stage], dtype=np.int64)
                if stage in req.stage_logprobs:
                    out.stages[stage].logprobs = list(req.stage_logprobs[stage])
            if req.audio_stage is not None:
                audio = (np.concatenate(req.audio_chunks) if req.audio_chunks
                         else np.zeros(0, dtype=np.float32))
                out.stages[req.audio_stage].audio = audio
            if req.image_stage is not None:
                out.images = [Image.fromarray(a) for a in req.images]
                out.stages[req.image_stage].images = out.images
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
            self.hosts[stage].abort(request_id)
        for stage in req.path:
            req.stage_reasons.setdefault(stage, reason)
        self._emit(req, OmniRequestOutput(request_id), finished=True, error=error)
