"""The server's side of the engine process (engine_process.py says what it is and why it is
not the default): EngineClient, with the AsyncOmniLLM surface the server uses, over the pipe to
the engine process."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import logging
import multiprocessing as mp
import pickle
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import Any

from omnistage.entrypoints.async_llm import (Mailbox, NotAdmitted, RequestOutputs,
                                             RuntimeShutDown, check_request_id, loop_mailbox)
from omnistage.entrypoints.base import WARMUP_TIMEOUT_S
from omnistage.entrypoints.engine_process import (
    CALL_TIMEOUT_S, PROCESSOR_OPTIONS, START_TIMEOUT_S, STOP_TIMEOUT_S, AbortCall, DropCall,
    FrontEnd, Outputs, PrepareCall, Prepared, Ready, Reply, RunCall, RuntimeSnapshot,
    SetProcessorOption, ShutdownCall, StartFailed, StatsCall, Stopped, WarmupCall, send_message,
    engine_main)
from omnistage.outputs import OmniRequestOutput

log = logging.getLogger("omnistage.engine")


class EngineRequest:
    """A request prepared in the engine process (prepare()'s handle for run())."""

    def __init__(self, client: EngineClient, handle: int, prepared: Prepared) -> None:
        self.handle = handle
        self.request_id = prepared.request_id
        self.prompt_token_ids = prepared.prompt_token_ids
        self.arrival = 0.0  # when the runtime took it in (monotonic; RequestTimeline reads it)
        # dropped unrun (a client gone, a refused start): the engine forgets it too
        self._release = weakref.finalize(self, client._send_quietly, DropCall(handle))


class _ProcessorView:
    """The engine's processor as the server sees it: its facts, and its option set there."""

    def __init__(self, client: EngineClient, facts: dict[str, Any]) -> None:
        object.__setattr__(self, "_client", client)
        for name, value in facts.items():
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in PROCESSOR_OPTIONS:
            raise AttributeError(f"processor: {name!r} is not an option set from the server")
        self._client._call(lambda call: SetProcessorOption(call, name, value)).result(
            CALL_TIMEOUT_S)
        object.__setattr__(self, name, value)


class _PipelineView:
    """The Pipeline protocol's front-end fields (no workers here: the stages live there)."""

    def __init__(self, client: EngineClient, front: FrontEnd) -> None:
        self.stage_names = front.stage_names
        self.output_modalities = front.output_modalities
        self.voices = dict.fromkeys(front.voices)
        self.max_model_len = front.max_model_len
        self.default_params = front.default_params
        self.tokenizer = front.tokenizer
        self.processor = None if front.processor is None else _ProcessorView(client,
                                                                              front.processor)
        self.workers: dict[str, Any] = {}
        for name, value in front.facts.items():
            setattr(self, name, value)


class _RuntimeView:
    """The runtime's state for /health and /metrics: stats() asks the engine, the rest reads
    what that answer said."""

    def __init__(self, client: EngineClient) -> None:
        self._client = client
        self._last = RuntimeSnapshot()

    @property
    def alive(self) -> bool:
        return self._client.alive

    def stats(self) -> dict[str, dict[str, float]]:
        try:
            self._last = self._client._call(StatsCall).result(CALL_TIMEOUT_S)
        except (RuntimeShutDown, TimeoutError) as e:
            log.warning("engine stats: %s (the last ones stand)", e or type(e).__name__)
        return self._last.stats

    def replica_stats(self) -> dict[str, list[dict[str, float]]]:
        return self._last.replica_stats

    @property
    def stage_errors(self) -> dict[str, int]:
        return self._last.stage_errors

    @property
    def unit_errors(self) -> dict[str, int]:
        return self._last.unit_errors

    def num_active(self) -> int:
        return self._last.num_active

    def prepared(self) -> int:
        return self._last.prepared


class EngineClient:
    """AsyncOmniLLM's serving surface over an engine process (module docstring)."""

    def __init__(self, model: str, log_level: str = "info",
                 start_timeout: float = START_TIMEOUT_S, switch_interval_ms: float | None = None,
                 **options: Any) -> None:
        """options: AsyncOmniLLM's keyword arguments (picklable), used in the engine process;
        switch_interval_ms: the engine process's GIL switch interval once built (None: Python's),
        as the server sets its own (ServerConfig.switch_interval_ms)."""
        ctx = mp.get_context("spawn")  # (CUDA cannot be forked)
        self._conn, child = ctx.Pipe(duplex=True)
        self._process = ctx.Process(target=engine_main, name="omnistage-engine",
                                    args=(child, model, options, log_level, switch_interval_ms))
        t0 = time.perf_counter()
        self._process.start()
        log.info("engine process %d: starting", self._process.pid)
        child.close()  # (only the engine holds that end: its exit closes the pipe here)
        front = self._wait_ready(start_timeout)
        self.startup_seconds = dict(front.startup_seconds)
        self.startup_seconds["engine_process"] = time.perf_counter() - t0
        self.device = front.device
        self.pipeline = _PipelineView(self, front)
        self.tokenizer = front.tokenizer
        self.stage_names = front.stage_names
        self.runtime = _RuntimeView(self)
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # the tables below (reader thread and event loops)
        self._calls = itertools.count()
        self._handles = itertools.count()
        # call -> (future, handle, the stream of a start(): its mailbox and queue)
        self._pending: dict[int, tuple[Future, int | None, tuple | None]] = {}
        self._running: dict[int, tuple[Mailbox, asyncio.Queue, EngineRequest]] = {}
        self._mailboxes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._preparing = 0
        self._closing = False
        self._dead: str | None = None  # why the engine is gone
        self._reader = threading.Thread(target=self._read, name="omnistage-engine-reader",
                                        daemon=True)
        self._reader.start()
        atexit.register(self.shutdown)  # (before multiprocessing's exit joins the process)

    def _wait_ready(self, timeout: float) -> FrontEnd:
        deadline = time.monotonic() + timeout
        try:
            while not self._conn.poll(1.0):
                if not self._process.is_alive():
                    raise RuntimeError(f"the engine process exited during start-up (exit code "
                                       f"{self._process.exitcode}); its log says why")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the engine did not start within {timeout:.0f} s")
            msg = pickle.loads(self._conn.recv_bytes())
        except BaseException:
            self._kill()
            raise
        if isinstance(msg, StartFailed):
            self._process.join(STOP_TIMEOUT_S)
            raise RuntimeError(f"the engine failed to start: {msg.error}")
        if not isinstance(msg, Ready):
            self._kill()
            raise RuntimeError(f"engine: expected Ready, got {type(msg).__name__}")
        return msg.front

    # ------------------------------------------------------------------ state
    @property
    def alive(self) -> bool:
        return self._dead is None and self._process.is_alive()

    @property
    def preparing(self) -> int:
        """Preparations sent and not answered (the server's admission bounds it)."""
        return self._preparing

    def mailbox(self, loop: asyncio.AbstractEventLoop) -> Mailbox:
        return loop_mailbox(self._mailboxes, loop)

    # ------------------------------------------------------------------ messages
    def _send(self, msg: Any) -> None:
        if self._dead is not None:
            raise RuntimeShutDown(f"the omnistage engine is gone ({self._dead})")
        try:
            send_message(self._conn, self._send_lock, msg)
        except OSError as e:
            raise RuntimeShutDown(f"the omnistage engine is gone ({e})") from e

    def _send_quietly(self, msg: Any) -> None:
        """For messages whose loss does not matter once the engine is gone (drop, abort)."""
        try:
            self._send(msg)
        except RuntimeShutDown as e:
            log.debug("engine: %s not sent: %s", type(msg).__name__, e)

    def _call(self, make, handle: int | None = None, stream: tuple | None = None) -> Future:
        """Send make(call id); the future gets its Reply's value or error."""
        fut: Future = Future()
        with self._lock:
            call = next(self._calls)
            self._pending[call] = (fut, handle, stream)
        try:
            self._send(make(call))
        except RuntimeShutDown as e:
            with self._lock:
                self._pending.pop(call, None)
            fut.set_exception(e)
        return fut

    def _read(self) -> None:
        """The reader thread: replies to their futures, outputs to their streams."""
        reason = "the engine process exited"
        try:
            while True:
                msg = pickle.loads(self._conn.recv_bytes())
                if isinstance(msg, Outputs):
                    self._deliver(msg.items)
                elif isinstance(msg, Reply):
                    self._reply(msg)
                elif isinstance(msg, Stopped):
                    reason = f"the engine stopped: {msg.reason}"
                    break
                else:
                    log.error("engine: unexpected message %s", type(msg).__name__)
        except (EOFError, OSError) as e:
            reason = f"the engine process exited ({type(e).__name__})"
        self._gone(reason)

    def _deliver(self, items: list[tuple[int, float, OmniRequestOutput]]) -> None:
        for handle, arrival, out in items:
            with self._lock:
                entry = self._running.get(handle)
                if entry is not None and out.finished:
                    del self._running[handle]
            if entry is None:  # (the stream was closed: its abort's output)
                continue
            box, queue, req = entry
            req.arrival = arrival
            out.prompt_token_ids = req.prompt_token_ids
            box.post(queue, out)

    def _reply(self, msg: Reply) -> None:
        with self._lock:
            fut, handle, stream = self._pending.pop(msg.call, (None, None, None))
        if fut is None:
            return
        if msg.error is not None:
            name, text = msg.error
            cls = {"ValueError": ValueError, "RuntimeShutDown": RuntimeShutDown}.get(
                name, RuntimeError)
            fut.set_exception(cls(text if cls is not RuntimeError else f"{name}: {text}"))
            return
        if handle is not None:  # a preparation: its handle, made here so that it is never lost
            req = msg.value = EngineRequest(self, handle, msg.value)
            if stream is not None:  # a start(): it runs there, and its outputs come after this
                req._release.detach()  # (nothing waits there to be dropped)
                with self._lock:
                    self._running[handle] = (*stream, req)
        fut.set_result(msg.value)

    def _gone(self, reason: str) -> None:
        """The engine stopped: every call and stream still waiting ends now."""
        with self._lock:
            self._dead = reason
            pending, self._pending = self._pending, {}
            running, self._running = self._running, {}
        if not self._closing:
            log.error("engine: %s", reason)
        for fut, _, _ in pending.values():
            fut.set_exception(RuntimeShutDown(f"the omnistage engine is gone ({reason})"))
        for box, queue, req in running.values():
            box.post(queue, OmniRequestOutput(req.request_id, finished=True,
                                              error=f"the omnistage engine is gone ({reason})"))

    # ------------------------------------------------------------------ requests
    async def prepare(self, prompt: Any, sampling_params: Any = None,
                      output_modalities: list[str] | None = None,
                      request_id: str | None = None) -> EngineRequest:
        """AsyncOmniLLM.prepare() in the engine process; returns its handle."""
        fut = self._send_preparation(prompt, sampling_params, output_modalities, request_id)
        # shielded: a cancelled caller leaves the future to the reader, and the handle it
        # makes is dropped (and so forgotten in the engine) with nobody holding it
        return await asyncio.shield(asyncio.wrap_future(fut))

    def _send_preparation(self, prompt: Any, sampling_params: Any,
                          output_modalities: list[str] | None, request_id: str | None,
                          stream: tuple | None = None) -> Future:
        """A PrepareCall sent (with a stream, a start()'s: run there once prepared); the
        future gets its EngineRequest."""
        check_request_id(request_id)
        if self._closing:
            raise RuntimeShutDown("the omnistage runtime was shut down")
        handle = next(self._handles)
        with self._lock:
            self._preparing += 1
        fut = self._call(lambda call: PrepareCall(call, handle, prompt, sampling_params,
                                                  output_modalities, request_id,
                                                  run=stream is not None), handle, stream)
        fut.add_done_callback(self._prepare_done)
        return fut

    def _prepare_done(self, _: Future) -> None:
        with self._lock:
            self._preparing -= 1

    async def start(self, prompt: Any, sampling_params: Any = None,
                    output_modalities: list[str] | None = None, request_id: str | None = None,
                    admit: Callable[[EngineRequest], bool] | None = None
                    ) -> tuple[EngineRequest, RequestOutputs]:
        """AsyncOmniLLM.start() in one message: the engine process's preparation thread
        prepares the request, answers, and submits it to the runtime there at once (prepare()
        then run() cost a second round trip through both processes' busy threads). admit(req)
        runs here when the answer comes, so after the submission: a refusal aborts the request
        there and raises NotAdmitted. A caller cancelled before the answer aborts it too."""
        queue: asyncio.Queue[OmniRequestOutput] = asyncio.Queue()
        fut = self._send_preparation(prompt, sampling_params, output_modalities, request_id,
                                     (self.mailbox(asyncio.get_running_loop()), queue))
        try:
            req = await asyncio.shield(asyncio.wrap_future(fut))
        except asyncio.CancelledError:  # it runs there once prepared: abort it when it is
            fut.add_done_callback(self._abandon_started)
            raise
        outputs = RequestOutputs(queue, partial(self._abandon, req))
        if admit is not None and not admit(req):
            outputs.close()
            raise NotAdmitted(f"request {req.request_id}: not admitted")
        return req, outputs

    def _abandon_started(self, fut: Future) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self._abandon(fut.result())

    def _abandon(self, req: EngineRequest) -> None:
        """A running request's stream was closed before its end: abort it in the engine."""
        with self._lock:
            self._running.pop(req.handle, None)
        self._send_quietly(AbortCall(req.request_id, "request cancelled"))

    async def run(self, req: EngineRequest):
        """Submit a prepared request in the engine and yield its outputs (AsyncOmniLLM.run)."""
        async with contextlib.aclosing(self._submit(req)) as outputs:
            async for out in outputs:
                yield out

    def _submit(self, req: EngineRequest) -> RequestOutputs:
        queue: asyncio.Queue[OmniRequestOutput] = asyncio.Queue()
        box = self.mailbox(asyncio.get_running_loop())
        req._release.detach()
        with self._lock:
            dead = self._dead
            if dead is None:
                self._running[req.handle] = (box, queue, req)
        if dead is not None:
            box.post(queue, OmniRequestOutput(req.request_id, finished=True,
                                              error=f"the omnistage engine is gone ({dead})"))
        else:
            self._send_quietly(RunCall(req.handle))  # (a lost engine ends the stream: _gone)
        return RequestOutputs(queue, partial(self._abandon, req))

    async def abort(self, request_id: str) -> None:
        self._send_quietly(AbortCall(request_id, "request aborted"))

    def warmup(self) -> float | None:
        """AsyncOmniLLM.warmup() in the engine process."""
        seconds = self._call(WarmupCall).result(WARMUP_TIMEOUT_S)
        if seconds is not None:
            self.startup_seconds["warmup"] = seconds
        return seconds

    def shutdown(self) -> None:
        """Stop the engine (its requests still running end with an error) and its process."""
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self.shutdown)  # (and the client may be collected)
        if self._dead is None:
            self._send_quietly(ShutdownCall())
        self._reader.join(STOP_TIMEOUT_S)
        self._process.join(STOP_TIMEOUT_S)
        if self._process.is_alive():
            log.error("engine: the process did not stop within %.0f s; killing it",
                      STOP_TIMEOUT_S)
            self._kill()
        self._conn.close()

    def _kill(self) -> None:
        self._process.kill()
        self._process.join(STOP_TIMEOUT_S)
