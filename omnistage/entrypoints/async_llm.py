"""AsyncOmniLLM: streaming generation for servers. Each request is an async generator of
OmniRequestOutputs; cancelling the consumer or abort() stops the request in every stage."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from omnistage.entrypoints.base import OmniBase
from omnistage.outputs import OmniRequestOutput


class AsyncOmniLLM(OmniBase):
    async def generate(self, prompt: Any, sampling_params: Any = None,
                       output_modalities: list[str] | None = None,
                       request_id: str | None = None) -> AsyncIterator[OmniRequestOutput]:
        """Yields outputs as the request progresses: cumulative `text`/`token_ids`,
        `text_delta`, `audio` = the new chunk (or None), `finished` on the last one."""
        req = self._prepare([prompt], sampling_params, output_modalities)[0]
        if request_id is not None:
            if not isinstance(request_id, str) or not 0 < len(request_id) <= 128:
                raise ValueError("request_id: must be a string of 1..128 characters")
            req.request_id = request_id
            for stage_req in req.stage_requests.values():
                if hasattr(stage_req, "request_id"):
                    stage_req.request_id = request_id
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[OmniRequestOutput] = asyncio.Queue()
        self.runtime.submit(req, lambda out: loop.call_soon_threadsafe(queue.put_nowait, out))
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finished
                yield out
        finally:
            if not finished:  # consumer went away or was cancelled
                self.runtime.abort(req.request_id, "request cancelled")

    async def abort(self, request_id: str) -> None:
        self.runtime.abort(request_id, "request aborted")

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        self.shutdown()
