"""The engine in a process of its own, for the server (`omnistage serve --engine-process`).

A spawned process builds an AsyncOmniLLM (every stage, the runtime loop, the preparation pool)
and serves it over one duplex pipe; the server's process keeps HTTP, JSON and SSE encoding. What
it gives is isolation: an engine that dies (a driver fault, the OOM killer) leaves the HTTP side
answering, /health says "dead" and every open stream ends with an error event.

NOTE (why it is not the default): it was built to take the event loop's work off the runtime's
interpreter lock at c32. Once a request crossed the pipe once (PrepareCall.run) and this process
ran at the server's GIL switch interval, it was as fast as one process at c32 on the H200, but
its start took 8-10 s longer (benchmarks/results/
serving_h200_same_machine_engine_process_session32_issue24_2026-11-29.json).

EngineClient (engine_client.py) has the surface of AsyncOmniLLM that the server uses
(prepare, run, abort, preparing, warmup, shutdown, runtime for /health and /metrics, the
pipeline's front-end facts, tokenizer, startup_seconds). prepare() returns an EngineRequest, a
handle: the RuntimeRequest stays in the engine process until run(handle) submits it there, and
is dropped there when the handle is dropped unrun. start() is one message: the engine prepares
the request and submits it at once (PrepareCall.run). Messages are the typed dataclasses below,
pickled; outputs of one runtime pass go up in one message (_Outbox), as AsyncOmniLLM's mailbox
does."""

from __future__ import annotations

import logging
import pickle
import signal
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from omnistage.entrypoints.async_llm import (AsyncOmniLLM)
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
    run: bool = False  # start(): run it as soon as it is prepared (no RunCall follows)


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


def send_message(conn: Connection, lock: threading.Lock, msg: Any) -> None:
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
        send_message(self.conn, self.send_lock, msg)

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
                if isinstance(msg, ShutdownCall):
                    return "shutdown"
                self.handle(msg)
            except (EOFError, OSError) as e:  # (a reply's send too)
                return f"the server's end of the pipe closed ({type(e).__name__})"

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
            self._run(msg.handle, req)
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

    def _run(self, handle: int, req: Any) -> None:
        self.llm.runtime.submit(req, lambda out: self.outbox.put(handle, req.arrival, out))

    def _prepare(self, msg: PrepareCall) -> None:  # (on a preparation thread)
        req = None
        try:
            req = self.llm.prepare_now(msg.prompt, msg.params, msg.modalities, msg.request_id)
        except Exception as e:  # noqa: BLE001 - ValueError is the client's 400; others its 500
            if not isinstance(e, ValueError):
                log.exception("engine: preparing a request failed")
            reply = Reply(msg.call, error=(type(e).__name__, str(e)))
        else:
            if not msg.run:
                with self.prepared_lock:
                    self.prepared[msg.handle] = req
            reply = Reply(msg.call, Prepared(req.request_id, list(req.prompt_token_ids)))
        try:
            self.send(reply)
        except OSError as e:  # the server is gone (the main thread stops the engine)
            log.warning("engine: a preparation's answer not sent, the server's pipe is closed "
                        "(%s)", e)
            return
        if req is not None and msg.run:
            # after its answer, from this thread: the pipe keeps order, so the server knows
            # the request before any output of it comes (and no RunCall round trip waits for
            # the server's busy loop and reader thread)
            self._run(msg.handle, req)


def snapshot(runtime, prepared: int) -> RuntimeSnapshot:
    return RuntimeSnapshot(runtime.alive, runtime.stats(), runtime.replica_stats(),
                           dict(runtime.stage_errors), dict(runtime.unit_errors),
                           runtime.num_active(), prepared)


def engine_main(conn: Connection, model: str, options: dict[str, Any], log_level: str,
                switch_interval_ms: float | None = None) -> None:
    """The engine process: build, say Ready (or StartFailed), serve, stop in order.
    switch_interval_ms: this process's GIL switch interval once built (None: Python's)."""
    # Ctrl-C in a terminal reaches the whole process group: the server drains and then stops
    # this process; it must not die first
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT)
    lock = threading.Lock()
    try:
        llm = AsyncOmniLLM(model, **options)
    except Exception as e:  # noqa: BLE001 - told to the server, which raises it there
        log.exception("engine: start-up failed")
        send_message(conn, lock, StartFailed(f"{type(e).__name__}: {e}"))
        return
    from omnistage.entrypoints.openai.server import (freeze_startup_heap, log_placement,
                                                     set_switch_interval)
    # (this process serves until the server stops it)
    llm.startup_seconds["engine_gc_freeze"] = freeze_startup_heap()
    if switch_interval_ms is not None:  # its runtime thread shares this interpreter with the
        # pipe's reader, the outbox and the preparation pool: the server's reason, here too
        set_switch_interval(switch_interval_ms)
    server = _EngineServer(conn, lock, llm)
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
        except OSError as e:  # the server is gone: nobody to tell
            log.info("engine: stopped, the server's pipe is closed (%s)", e)
