"""The engine in a process of its own, for the server.

A spawned process builds an AsyncOmniLLM (every stage, the runtime loop, the preparation pool)
and serves it over one duplex pipe; the server's process keeps HTTP, JSON and SSE encoding.
Each process then has an interpreter (GIL) of its own: at c32 the event loop's work no longer
delays the runtime thread's launches, nor the runtime the streams.

EngineClient has the surface of AsyncOmniLLM that the server uses (prepare, run, abort,
preparing, warmup, shutdown, runtime for /health and /metrics, pipeline's front-end facts,
tokenizer, startup_seconds). prepare() returns an EngineRequest, a handle: the RuntimeRequest
stays in the engine process until run(handle) submits it there, and is dropped there when the
handle is dropped unrun. Messages are the typed dataclasses below, pickled; outputs of one
runtime pass go up in one message (the engine's _Outbox), as AsyncOmniLLM's mailbox does."""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import multiprocessing as mp
import pickle
import signal
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from omnistage.entrypoints.async_llm import (AsyncOmniLLM, RuntimeShutDown, _Mailbox,
                                             check_request_id)
from omnistage.entrypoints.base import WARMUP_TIMEOUT_S
from omnistage.outputs import OmniRequestOutput
from omnistage.sampling_params import SamplingParams

log = logging.getLogger("omnistage.engine")

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
START_TIMEOUT_S = 3600.0  # a cold 7B start with every graph is minutes, never an hour
CALL_TIMEOUT_S = 10.0  # stats and options: answered by the engine's message thread at once
STOP_TIMEOUT_S = 60.0
POLL_S = 0.5  # the engine's check that its runtime lives, between messages
# the processor's facts the server reads (serving_transcriptions, realtime) and the one it sets
PROCESSOR_FACTS = ("placeholders", "max_audio_seconds", "audio_system_prompt")
PROCESSOR_OPTIONS = ("allow_local_paths",)
PIPELINE_FACTS = ("size_multiple", "max_side", "max_pixels")  # image pipelines' size limits


# ------------------------------------------------------------------------- messages
@dataclass
class PrepareCall:
    call: int
    handle: int
    prompt: Any
    params: Any
    modalities: list[str] | None
    request_id: str | None


@dataclass
class RunCall:
    handle: int


@dataclass
class DropCall:  # a prepared request that will never run
    handle: int


@dataclass
class AbortCall:
    request_id: str
    reason: str


@dataclass
class StatsCall:
    call: int


@dataclass
class WarmupCall:
    call: int


@dataclass
class SetProcessorOption:
    call: int
    name: str
    value: Any


@dataclass
class ShutdownCall:
    pass


@dataclass
class Prepared:
    """What the server learns of a prepared request."""

    request_id: str
    prompt_token_ids: list[int]


@dataclass
class RuntimeSnapshot:
    """The runtime's state for /health and /metrics."""

    alive: bool = True
    stats: dict[str, dict[str, float]] = field(default_factory=dict)
    replica_stats: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    stage_errors: dict[str, int] = field(default_factory=dict)
    unit_errors: dict[str, int] = field(default_factory=dict)
    num_active: int = 0
    prepared: int = 0  # prepared requests the engine holds for a run() not called yet


@dataclass
class FrontEnd:
    """The pipeline's facts the server's front-end reads (Pipeline protocol's fields)."""

    stage_names: list[str]
    output_modalities: list[str]
    voices: list[str]
    max_model_len: int
    default_params: dict[str, SamplingParams]
    tokenizer: Any
    processor: dict[str, Any] | None  # PROCESSOR_FACTS and PROCESSOR_OPTIONS it has
    facts: dict[str, Any]  # PIPELINE_FACTS it has
    device: str
    startup_seconds: dict[str, float]


@dataclass
class Ready:
    front: FrontEnd


@dataclass
class StartFailed:
    error: str


@dataclass
class Reply:
    call: int
    value: Any = None
    error: tuple[str, str] | None = None  # (exception class name, message)


@dataclass
class Outputs:
    items: list[tuple[int, float, OmniRequestOutput]]  # (handle, runtime arrival, output)


@dataclass
class Stopped:
    reason: str


def _send(conn: Connection, lock: threading.Lock, msg: Any) -> None:
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    with lock:
        conn.send_bytes(data)


# ------------------------------------------------------------------------- engine side
class _Outbox:
    """Outputs from the runtime's thread, sent up by a thread of their own: every output that
    came while the previous message was being sent goes in the next one."""

    def __init__(self, send) -> None:
        self._send = send
        self._items: list = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="omnistage-engine-outbox",
                                        daemon=True)
        self._thread.start()

    def put(self, handle: int, arrival: float, out: OmniRequestOutput) -> None:
        out.prompt_token_ids = []  # (the client has them from Prepared: not sent every delta)
        with self._cond:
            self._items.append((handle, arrival, out))
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._items and not self._closed:
                    self._cond.wait()
                items, self._items = self._items, []
                if not items:
                    return
            try:
                self._send(Outputs(items))
            except OSError as e:  # the server is gone: nobody reads these any more
                log.warning("engine: outputs not sent, the server's pipe is closed (%s)", e)
                return

    def close(self, timeout: float) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout)


class _EngineServer:
    """The engine process's side: the AsyncOmniLLM and the messages from its client."""

    def __init__(self, conn: Connection, send_lock: threading.Lock, llm: AsyncOmniLLM) -> None:
        self.conn, self.send_lock, self.llm = conn, send_lock, llm
        self.prepared: dict[int, Any] = {}  # handle -> RuntimeRequest, until run or dropped
        self.prepared_lock = threading.Lock()
        self.outbox = _Outbox(self.send)

    def send(self, msg: Any) -> None:
        _send(self.conn, self.send_lock, msg)

    def front_end(self) -> FrontEnd:
        llm, pipeline = self.llm, self.llm.pipeline
        processor = getattr(pipeline, "processor", None)
        facts = None if processor is None else {
            name: getattr(processor, name) for name in PROCESSOR_FACTS + PROCESSOR_OPTIONS
            if hasattr(processor, name)}
        return FrontEnd(list(llm.stage_names), list(pipeline.output_modalities),
                        sorted(pipeline.voices), pipeline.max_model_len,
                        dict(pipeline.default_params), llm.tokenizer, facts,
                        {name: getattr(pipeline, name) for name in PIPELINE_FACTS
                         if hasattr(pipeline, name)},
                        str(llm.device), dict(llm.startup_seconds))

    def serve(self) -> str:
        """Answer messages until shutdown, the client's end closing or the runtime dying;
        returns why it stopped."""
        while True:
            try:
                if not self.conn.poll(POLL_S):
                    if not self.llm.runtime.alive:
                        return "the runtime stopped"
                    continue
                msg = pickle.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                return "the server's end of the pipe closed"
            if isinstance(msg, ShutdownCall):
                return "shutdown"
            self.handle(msg)

    def handle(self, msg: Any) -> None:
        llm = self.llm
        if isinstance(msg, PrepareCall):
            try:
                llm._prepare_pool.submit(self._prepare, msg)
            except RuntimeError:  # the pool is shut down
                self.send(Reply(msg.call, error=("RuntimeShutDown", "the runtime was shut down")))
        elif isinstance(msg, RunCall):
            with self.prepared_lock:
                req = self.prepared.pop(msg.handle, None)
            if req is None:  # (the client never sends it twice: a defect if it comes)
                out = OmniRequestOutput(f"handle-{msg.handle}", finished=True,
                                        error="internal error: no prepared request to run")
                self.outbox.put(msg.handle, 0.0, out)
                return
            handle = msg.handle
            llm.runtime.submit(req, lambda out: self.outbox.put(handle, req.arrival, out))
        elif isinstance(msg, DropCall):
            with self.prepared_lock:
                self.prepared.pop(msg.handle, None)
        elif isinstance(msg, AbortCall):
            llm.runtime.abort(msg.request_id, msg.reason)
        elif isinstance(msg, StatsCall):
            with self.prepared_lock:
                prepared = len(self.prepared)
            self.send(Reply(msg.call, snapshot(llm.runtime, prepared)))
        elif isinstance(msg, WarmupCall):
            self._answer(msg.call, llm.warmup)
        elif isinstance(msg, SetProcessorOption):
            self._answer(msg.call, lambda: self._set_processor_option(msg.name, msg.value))
        else:
            raise TypeError(f"engine: unknown message {type(msg).__name__}")

    def _set_processor_option(self, name: str, value: Any) -> None:
        if name not in PROCESSOR_OPTIONS:
            raise ValueError(f"processor option {name!r}: one of {PROCESSOR_OPTIONS}")
        setattr(self.llm.pipeline.processor, name, value)

    def _answer(self, call: int, fn) -> None:
        try:
            value = fn()
        except Exception as e:  # noqa: BLE001 - the caller's error, raised again over there
            log.exception("engine: call %d failed", call)
            self.send(Reply(call, error=(type(e).__name__, str(e))))
            return
        self.send(Reply(call, value))

    def _prepare(self, msg: PrepareCall) -> None:  # (on a preparation thread)
        try:
            req = self.llm.prepare_now(msg.prompt, msg.params, msg.modalities, msg.request_id)
        except Exception as e:  # noqa: BLE001 - ValueError is the client's 400; others its 500
            if not isinstance(e, ValueError):
                log.exception("engine: preparing a request failed")
            self.send(Reply(msg.call, error=(type(e).__name__, str(e))))
            return
        with self.prepared_lock:
            self.prepared[msg.handle] = req
        self.send(Reply(msg.call, Prepared(req.request_id, list(req.prompt_token_ids))))


def snapshot(runtime, prepared: int) -> RuntimeSnapshot:
    return RuntimeSnapshot(runtime.alive, runtime.stats(), runtime.replica_stats(),
                           dict(runtime.stage_errors), dict(runtime.unit_errors),
                           runtime.num_active(), prepared)


def engine_main(conn: Connection, model: str, options: dict[str, Any], log_level: str) -> None:
    """The engine process: build, say Ready (or StartFailed), serve, stop in order."""
    # Ctrl-C in a terminal reaches the whole process group: the server drains and then stops
    # this process; it must not die first
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT)
    lock = threading.Lock()
    try:
        llm = AsyncOmniLLM(model, **options)
    except Exception as e:  # noqa: BLE001 - told to the server, which raises it there
        log.exception("engine: start-up failed")
        _send(conn, lock, StartFailed(f"{type(e).__name__}: {e}"))
        return
    server = _EngineServer(conn, lock, llm)
    from omnistage.entrypoints.openai.server import log_placement
    log_placement(llm)
    reason = "start-up"
    try:
        server.send(Ready(server.front_end()))
        reason = server.serve()
    finally:
        log.info("engine: stopping (%s)", reason)
        llm.shutdown()  # requests still running end with an error output...
        server.outbox.close(STOP_TIMEOUT_S)  # ...which reach the server before Stopped
        try:
            server.send(Stopped(reason))
        except OSError:
            pass  # (the server is gone: nobody to tell)


# ------------------------------------------------------------------------- server side
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
                 start_timeout: float = START_TIMEOUT_S, **options: Any) -> None:
        """options: AsyncOmniLLM's keyword arguments (picklable), used in the engine process."""
        ctx = mp.get_context("spawn")  # (CUDA cannot be forked)
        self._conn, child = ctx.Pipe(duplex=True)
        self._process = ctx.Process(target=engine_main, args=(child, model, options, log_level),
                                    name="omnistage-engine")
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
        self._pending: dict[int, tuple[Future, int | None]] = {}  # call -> (future, handle)
        self._running: dict[int, tuple[_Mailbox, asyncio.Queue, EngineRequest]] = {}
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

    def mailbox(self, loop: asyncio.AbstractEventLoop) -> _Mailbox:
        box = self._mailboxes.get(loop)
        if box is None:
            box = self._mailboxes[loop] = _Mailbox(loop)
        return box

    # ------------------------------------------------------------------ messages
    def _send(self, msg: Any) -> None:
        if self._dead is not None:
            raise RuntimeShutDown(f"the omnistage engine is gone ({self._dead})")
        try:
            _send(self._conn, self._send_lock, msg)
        except OSError as e:
            raise RuntimeShutDown(f"the omnistage engine is gone ({e})") from e

    def _send_quietly(self, msg: Any) -> None:
        """For messages whose loss does not matter once the engine is gone (drop, abort)."""
        try:
            self._send(msg)
        except RuntimeShutDown as e:
            log.debug("engine: %s not sent: %s", type(msg).__name__, e)

    def _call(self, make, handle: int | None = None) -> Future:
        """Send make(call id); the future gets its Reply's value or error."""
        fut: Future = Future()
        with self._lock:
            call = next(self._calls)
            self._pending[call] = (fut, handle)
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
            fut, handle = self._pending.pop(msg.call, (None, None))
        if fut is None:
            return
        if msg.error is not None:
            name, text = msg.error
            cls = {"ValueError": ValueError, "RuntimeShutDown": RuntimeShutDown}.get(
                name, RuntimeError)
            fut.set_exception(cls(text if cls is not RuntimeError else f"{name}: {text}"))
            return
        if handle is not None:  # a preparation: its handle, made here so that it is never lost
            msg.value = EngineRequest(self, handle, msg.value)
        fut.set_result(msg.value)

    def _gone(self, reason: str) -> None:
        """The engine stopped: every call and stream still waiting ends now."""
        with self._lock:
            self._dead = reason
            pending, self._pending = self._pending, {}
            running, self._running = self._running, {}
        if not self._closing:
            log.error("engine: %s", reason)
        for fut, _ in pending.values():
            fut.set_exception(RuntimeShutDown(f"the omnistage engine is gone ({reason})"))
        for box, queue, req in running.values():
            box.post(queue, OmniRequestOutput(req.request_id, finished=True,
                                              error=f"the omnistage engine is gone ({reason})"))

    # ------------------------------------------------------------------ requests
    async def prepare(self, prompt: Any, sampling_params: Any = None,
                      output_modalities: list[str] | None = None,
                      request_id: str | None = None) -> EngineRequest:
        """AsyncOmniLLM.prepare() in the engine process; returns its handle."""
        check_request_id(request_id)
        if self._closing:
            raise RuntimeShutDown("the omnistage runtime was shut down")
        handle = next(self._handles)
        with self._lock:
            self._preparing += 1
        fut = self._call(lambda call: PrepareCall(call, handle, prompt, sampling_params,
                                                  output_modalities, request_id), handle)
        fut.add_done_callback(self._prepare_done)
        # shielded: a cancelled caller leaves the future to the reader, and the handle it
        # makes is dropped (and so forgotten in the engine) with nobody holding it
        return await asyncio.shield(asyncio.wrap_future(fut))

    def _prepare_done(self, _: Future) -> None:
        with self._lock:
            self._preparing -= 1

    async def run(self, req: EngineRequest):
        """Submit a prepared request in the engine and yield its outputs (AsyncOmniLLM.run)."""
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
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finished
                yield out
        finally:
            if not finished:  # consumer went away or was cancelled
                with self._lock:
                    self._running.pop(req.handle, None)
                self._send_quietly(AbortCall(req.request_id, "request cancelled"))

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

    def __del__(self) -> None:
        process = getattr(self, "_process", None)
        if process is not None and process.is_alive() and hasattr(self, "_reader"):
            self.shutdown()

