"""AsyncOmniLLM: streaming generation for servers. Each request is an async generator of
OmniRequestOutputs; cancelling the consumer or abort() stops the request in every stage.

Request preparation (validation, tokenising, media decoding) runs on a small thread pool of its
own, never on the caller's event loop: one large video must not stall /health or other streams.

Outputs cross from the runtime's thread to the caller's event loop through one mailbox per loop
(Mailbox): a runtime pass that emits outputs for 32 streams wakes the loop once, not 32 times,
so the loop (SSE encoding, HTTP) takes less of the interpreter from the runtime thread."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import weakref
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any

from omnistage.entrypoints.base import OmniBase
from omnistage.outputs import OmniRequestOutput
from omnistage.runtime.orchestrator import RuntimeRequest

DEFAULT_PREPARE_WORKERS = 4
WARMUP_POOL_TIMEOUT_S = 120.0  # warmup(): the preparation threads' turn
MAX_REQUEST_ID_CHARS = 128
log = logging.getLogger("omnistage.runtime")


class RuntimeShutDown(RuntimeError):
    """The runtime was shut down before this request could be prepared or run."""


class NotAdmitted(RuntimeError):
    """start()'s admit() refused the prepared request: it never reached the runtime."""


class RequestOutputs:
    """A submitted request's outputs, async-iterable up to the finished one. close() (also
    aclose(), and a consumer cancelled while it waits) aborts the request if it has not
    finished: `abandon`, called at most once. Unlike an async generator's cleanup, close()
    works before the first iteration too, so a stream dropped before it ever read its request
    still aborts it."""

    def __init__(self, queue: asyncio.Queue, abandon: Callable[[], None]) -> None:
        self._queue, self._abandon = queue, abandon
        self._done = False  # the finished output was taken, or close() ran

    def __aiter__(self) -> RequestOutputs:
        return self

    async def __anext__(self) -> OmniRequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            out = await self._queue.get()
        except BaseException:  # (cancelled: the consumer went away)
            self.close()
            raise
        self._done = out.finished
        return out

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._abandon()

    async def aclose(self) -> None:
        self.close()


def check_request_id(request_id: str | None) -> None:
    if request_id is not None and (not isinstance(request_id, str)
                                   or not 0 < len(request_id) <= MAX_REQUEST_ID_CHARS):
        raise ValueError(f"request_id: must be a string of 1..{MAX_REQUEST_ID_CHARS} "
                         "characters")


class Mailbox:
    """Outputs from the runtime's thread to one event loop. post() appends (any thread); the
    first post after a flush schedules one flush on the loop, which hands every output to its
    request's queue in the order posted."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        # (weak: AsyncOmniLLM's mailboxes are keyed weakly by their loop, which must not be
        # kept alive by its own mailbox)
        self._loop = weakref.ref(loop)
        self._items: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._scheduled = False
        self.wakeups = 0  # flushes scheduled (tests: fewer than the outputs posted)

    def post(self, queue: asyncio.Queue, out: OmniRequestOutput) -> None:
        with self._lock:
            self._items.append((queue, out))
            if self._scheduled:
                return
            self._scheduled = True
            self.wakeups += 1
        loop = self._loop()
        try:
            if loop is None:
                raise RuntimeError("the event loop is gone")
            loop.call_soon_threadsafe(self._flush)
        except RuntimeError:
            if loop is not None and not loop.is_closed():
                raise
            with self._lock:
                self._items.clear()
                self._scheduled = False
            # the server stopped its loop before this runtime: nobody is left to read it
            log.info("request %s: output dropped, its event loop is closed (finished=%s, "
                     "error=%s)", out.request_id, out.finished, out.error)

    def _flush(self) -> None:  # (on the loop)
        with self._lock:
            items, self._items = self._items, collections.deque()
            self._scheduled = False
        for queue, out in items:
            queue.put_nowait(out)


def loop_mailbox(mailboxes: weakref.WeakKeyDictionary, loop: asyncio.AbstractEventLoop
                 ) -> Mailbox:
    """`loop`'s mailbox in `mailboxes` (one per event loop, keyed weakly; made on first use)."""
    box = mailboxes.get(loop)
    if box is None:
        box = mailboxes[loop] = Mailbox(loop)
    return box


class AsyncOmniLLM(OmniBase):
    def __init__(self, model: str, *args: Any, prepare_workers: int = DEFAULT_PREPARE_WORKERS,
                 **kwargs: Any) -> None:
        """prepare_workers: threads that prepare requests (tokenise, decode media); the other
        arguments are OmniBase's."""
        if isinstance(prepare_workers, bool) or not isinstance(prepare_workers, int) or \
                not 1 <= prepare_workers <= 256:
            raise ValueError(f"prepare_workers: an integer in 1..256, got {prepare_workers!r}")
        super().__init__(model, *args, **kwargs)
        self.prepare_workers = prepare_workers
        self._prepare_pool = ThreadPoolExecutor(prepare_workers,
                                                thread_name_prefix="omnistage-prepare")
        self._preparing = 0  # submitted to the pool and not done (a cancelled caller's too)
        self._preparing_lock = threading.Lock()
        self._mailboxes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.warmed_prepare_threads: set[int] = set()  # warmup(): the threads that prepared

    def mailbox(self, loop: asyncio.AbstractEventLoop) -> Mailbox:
        """The mailbox that carries outputs to `loop` (made on first use)."""
        return loop_mailbox(self._mailboxes, loop)

    @property
    def preparing(self) -> int:
        """Preparations queued or running on the pool (the server's admission bounds it)."""
        return self._preparing

    def _prepare_done(self, _: Future) -> None:
        with self._preparing_lock:  # (runs on a pool thread)
            self._preparing -= 1

    async def prepare(self, prompt: Any, sampling_params: Any = None,
                      output_modalities: list[str] | None = None,
                      request_id: str | None = None) -> RuntimeRequest:
        """Validate and build one request on the preparation pool. Raises ValueError (naming the
        field) for a bad prompt or parameter, RuntimeShutDown after shutdown(); nothing reaches
        the runtime until run()."""
        check_request_id(request_id)
        return await self._await_preparation(self._submit_preparation(
            partial(self.prepare_now, prompt, sampling_params, output_modalities, request_id)))

    def _submit_preparation(self, work: Callable[[], Any]) -> Future:
        """`work` queued on the preparation pool, counted in `preparing` until it is done
        (even when its caller stops waiting)."""
        with self._preparing_lock:
            self._preparing += 1
        try:
            job = self._prepare_pool.submit(work)
        except RuntimeError as e:  # the pool is shut down
            with self._preparing_lock:
                self._preparing -= 1
            raise RuntimeShutDown("the omnistage runtime was shut down") from e
        job.add_done_callback(self._prepare_done)
        return job

    @staticmethod
    async def _await_preparation(job: Future) -> Any:
        try:
            return await asyncio.wrap_future(job)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if job.cancelled() and task is not None and not task.cancelling():
                # shutdown() dropped it from the pool's queue; the caller was not cancelled
                raise RuntimeShutDown("the omnistage runtime was shut down") from None
            raise

    def prepare_now(self, prompt: Any, sampling_params: Any = None,
                    output_modalities: list[str] | None = None,
                    request_id: str | None = None) -> RuntimeRequest:
        """prepare()'s work, on the calling thread (a preparation pool's)."""
        req = self._prepare([prompt], sampling_params, output_modalities)[0]
        if request_id is not None:
            req.request_id = request_id
            for stage_req in req.stage_requests.values():
                if hasattr(stage_req, "request_id"):
                    stage_req.request_id = request_id
        return req

    async def start(self, prompt: Any, sampling_params: Any = None,
                    output_modalities: list[str] | None = None, request_id: str | None = None,
                    admit: Callable[[RuntimeRequest], bool] | None = None
                    ) -> tuple[RuntimeRequest, RequestOutputs]:
        """prepare() and run() as one job: the preparation thread submits the request to the
        runtime as soon as it is built. (prepare() then run() hand the request back to the
        event loop twice before the runtime sees it: under a burst the loop is busy taking in
        the other requests, and those passes delayed every first token.) admit(req), called on
        that thread first, may refuse it: NotAdmitted, nothing submitted. Raises as prepare()
        does. The outputs must be iterated to their end or closed (close() aborts)."""
        check_request_id(request_id)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[OmniRequestOutput] = asyncio.Queue()
        box = self.mailbox(loop)
        lock = threading.Lock()
        state = {"abandoned": False, "submitted": None}  # (submitted: its request id)

        def prepare_and_submit() -> RuntimeRequest:
            req = self.prepare_now(prompt, sampling_params, output_modalities, request_id)
            if admit is not None and not admit(req):
                raise NotAdmitted(f"request {req.request_id}: not admitted")
            with lock:  # (the caller may have gone meanwhile: then it is not submitted)
                if not state["abandoned"]:
                    self.runtime.submit(req, lambda out: box.post(queue, out))
                    state["submitted"] = req.request_id
            return req

        job = self._submit_preparation(prepare_and_submit)
        try:
            req = await self._await_preparation(job)
        except BaseException:
            with lock:
                state["abandoned"] = True
                submitted = state["submitted"]
            if submitted is not None:  # (cancelled after the thread had submitted it)
                self.runtime.abort(submitted, "request cancelled")
            raise
        return req, RequestOutputs(queue, partial(self.runtime.abort, req.request_id,
                                           "request cancelled"))

    async def run(self, req: RuntimeRequest) -> AsyncIterator[OmniRequestOutput]:
        """Submit a request from prepare() and yield its outputs (see generate())."""
        queue: asyncio.Queue[OmniRequestOutput] = asyncio.Queue()
        box = self.mailbox(asyncio.get_running_loop())
        self.runtime.submit(req, lambda out: box.post(queue, out))  # (on the runtime's thread)
        abandon = partial(self.runtime.abort, req.request_id, "request cancelled")
        async with contextlib.aclosing(RequestOutputs(queue, abandon)) as outputs:
            async for out in outputs:
                yield out

    async def generate(self, prompt: Any, sampling_params: Any = None,
                       output_modalities: list[str] | None = None,
                       request_id: str | None = None) -> AsyncIterator[OmniRequestOutput]:
        """Yields outputs as the request progresses: cumulative `text`/`token_ids`,
        `text_delta`, `audio` = the new chunk (or None), `finished` on the last one. A bad
        prompt or parameter raises ValueError at the first await."""
        req = await self.prepare(prompt, sampling_params, output_modalities, request_id)
        # closed with this generator, so that a consumer going away aborts the request at once
        async with contextlib.aclosing(self.run(req)) as outputs:
            async for out in outputs:
                yield out

    def warmup(self) -> float | None:
        """OmniBase.warmup() (a short request through every stage), after every preparation
        thread has prepared the warm-up prompt once: the pool's threads are started, and
        whatever a thread sets up on its first preparation (the template, tokenizer and
        processor state, a device's per-thread handles) is done before the first request
        comes, rather than on the first requests of each thread."""
        if self._warmup_request() is None:  # (nothing to warm: image pipelines)
            return None
        workers = self.prepare_workers
        # each job holds its thread until all have started: one preparation per thread
        barrier = threading.Barrier(workers)

        def prepare_once() -> int:
            barrier.wait(WARMUP_POOL_TIMEOUT_S)
            self._warmup_request()
            return threading.get_ident()

        jobs = [self._prepare_pool.submit(prepare_once) for _ in range(workers)]
        self.warmed_prepare_threads = {job.result(WARMUP_POOL_TIMEOUT_S) for job in jobs}
        return super().warmup()

    async def abort(self, request_id: str) -> None:
        self.runtime.abort(request_id, "request aborted")

    def shutdown(self) -> None:
        # preparations still queued are dropped: their callers get CancelledError
        pool = getattr(self, "_prepare_pool", None)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        super().shutdown()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        self.shutdown()
