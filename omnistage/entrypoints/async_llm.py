"""AsyncOmniLLM: streaming generation for servers. Each request is an async generator of
OmniRequestOutputs; cancelling the consumer or abort() stops the request in every stage.

Request preparation (validation, tokenising, media decoding) runs on a small thread pool of its
own, never on the caller's event loop: one large video must not stall /health or other streams."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from omnistage.entrypoints.base import OmniBase
from omnistage.outputs import OmniRequestOutput
from omnistage.runtime.orchestrator import RuntimeRequest

DEFAULT_PREPARE_WORKERS = 4
MAX_REQUEST_ID_CHARS = 128
log = logging.getLogger("omnistage.runtime")


class RuntimeShutDown(RuntimeError):
    """The runtime was shut down before this request could be prepared or run."""


class AsyncOmniLLM(OmniBase):
    def __init__(self, model: str, *args: Any, prepare_workers: int = DEFAULT_PREPARE_WORKERS,
                 **kwargs: Any) -> None:
        """prepare_workers: threads that prepare requests (tokenise, decode media); the other
        arguments are OmniBase's."""
        if isinstance(prepare_workers, bool) or not isinstance(prepare_workers, int) or \
                not 1 <= prepare_workers <= 256:
            raise ValueError(f"prepare_workers: an integer in 1..256, got {prepare_workers!r}")
        super().__init__(model, *args, **kwargs)
        self._prepare_pool = ThreadPoolExecutor(prepare_workers,
                                                thread_name_prefix="omnistage-prepare")
        self._preparing = 0  # submitted to the pool and not done (a cancelled caller's too)
        self._preparing_lock = threading.Lock()

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
        if request_id is not None and (not isinstance(request_id, str)
                                       or not 0 < len(request_id) <= MAX_REQUEST_ID_CHARS):
            raise ValueError(f"request_id: must be a string of 1..{MAX_REQUEST_ID_CHARS} "
                             "characters")
        with self._preparing_lock:
            self._preparing += 1
        try:
            job = self._prepare_pool.submit(self._prepare, [prompt], sampling_params,
                                            output_modalities)
        except RuntimeError as e:  # the pool is shut down
            with self._preparing_lock:
                self._preparing -= 1
            raise RuntimeShutDown("the omnistage runtime was shut down") from e
        # counted until the thread is done, even when the caller stops waiting
        job.add_done_callback(self._prepare_done)
        try:
            req = (await asyncio.wrap_future(job))[0]
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if job.cancelled() and task is not None and not task.cancelling():
                # shutdown() dropped it from the pool's queue; the caller was not cancelled
                raise RuntimeShutDown("the omnistage runtime was shut down") from None
            raise
        if request_id is not None:
            req.request_id = request_id
            for stage_req in req.stage_requests.values():
                if hasattr(stage_req, "request_id"):
                    stage_req.request_id = request_id
        return req

    async def run(self, req: RuntimeRequest) -> AsyncIterator[OmniRequestOutput]:
        """Submit a request from prepare() and yield its outputs (see generate())."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[OmniRequestOutput] = asyncio.Queue()

        def sink(out: OmniRequestOutput) -> None:  # (runs on the runtime's thread)
            try:
                loop.call_soon_threadsafe(queue.put_nowait, out)
            except RuntimeError:
                if not loop.is_closed():
                    raise
                # the server stopped its loop before this runtime: nobody is left to read it
                log.info("request %s: output dropped, its event loop is closed (finished=%s, "
                         "error=%s)", out.request_id, out.finished, out.error)

        self.runtime.submit(req, sink)
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finished
                yield out
        finally:
            if not finished:  # consumer went away or was cancelled
                self.runtime.abort(req.request_id, "request cancelled")

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
