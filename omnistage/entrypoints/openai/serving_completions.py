"""POST /v1/completions: OpenAI's (legacy) text completions, as vLLM serves them, on the first
stage's text: one choice per prompt (a string or token ids), `echo`, `logprobs` (the engine's
processed logprobs, OpenAI's legacy shape), `stream` (SSE). n > 1, best_of and suffix are
refused with a 400 naming the field; so is echo with logprobs (prompt logprobs are not kept)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from omnistage.entrypoints.openai.metrics import mark_outcome
from omnistage.entrypoints.openai.protocol import APIError, CompletionRequest
from omnistage.entrypoints.openai.serving import (finish_reason, token_logprob,
                                                  ClientGone, ManagedStreamingResponse,
                                                  RequestStream, ServerShuttingDown,
                                                  ServerState, build_sampling, client_gone,
                                                  close_stream, collect, first_output, log,
                                                  release_unless_handed_over, runtime_error,
                                                  sse, start_request, usage)
from omnistage.outputs import OmniRequestOutput


class OpenAIServingCompletions:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def create(self, body: CompletionRequest, request: Request) -> Response:
        st = self.state
        st.check_model(body.model)
        for name, refused in (("n", body.n != 1), ("best_of", body.best_of not in (None, 1)),
                              ("suffix", body.suffix is not None)):
            if refused:
                raise APIError(400, f"{name}: not supported (one choice per prompt, no "
                               "insertion)", param=name)
        if body.echo and body.logprobs is not None:
            raise APIError(400, "echo: cannot be combined with logprobs (the prompt's logprobs "
                           "are not computed)", param="echo")
        prompts = body.prompts()
        if body.stream and len(prompts) > 1:
            raise APIError(400, "prompt: a streamed request takes one prompt", param="prompt")
        params = build_sampling(st, body.sampling_fields(body.max_tokens, body.logprobs),
                                body.stage_sampling_params, body.seed)
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if body.stream:
            return await self._stream(body, prompts[0], params, rid, created, request)
        tasks = [asyncio.ensure_future(self._one(body, p, params, f"{rid}-{i}", request))
                 for i, p in enumerate(prompts)]
        try:
            outs = await asyncio.gather(*tasks)
        except BaseException:  # one prompt failed (or the handler was cancelled): stop the rest
            for task in tasks:
                task.cancel()
            raise
        if any(out is None for out in outs):
            return client_gone(st, rid, "completions")
        choices = [{"index": i, "text": self._echo(body, p) + out.text,
                    "logprobs": self._logprobs(body, out.token_ids, out.logprobs),
                    "finish_reason": self._reason(out)}
                   for i, (p, out) in enumerate(zip(prompts, outs))]
        total = [usage(out, None) for out in outs]
        return JSONResponse({"id": rid, "object": "text_completion", "created": created,
                             "model": body.model, "system_fingerprint": None,
                             "choices": choices,
                             "usage": {k: sum(u[k] for u in total) for k in
                                       ("prompt_tokens", "completion_tokens", "total_tokens")}},
                            headers={"X-Request-Id": rid})

    async def _one(self, body: CompletionRequest, prompt: str | list[int], params: Any,
                   rid: str, request: Request) -> OmniRequestOutput | None:
        """One prompt to its last output (None: the client went away)."""
        st = self.state
        st.acquire()
        stream = None
        try:
            stream = await start_request(st, request, self._prompt(prompt), params, ["text"],
                                         rid)
            last = await first_output(stream)
            if not last.finished:
                last, _ = await collect(stream)
            if last.error:
                raise runtime_error(last.error, produced=bool(last.token_ids))
            self._finished(last, rid)
            return last
        except ClientGone:
            return None
        finally:
            release_unless_handed_over(st, stream, False)

    async def _stream(self, body: CompletionRequest, prompt: str | list[int], params: Any,
                      rid: str, created: int, request: Request) -> Response:
        st = self.state
        st.acquire()
        stream = None
        handed_over = False
        try:
            stream = await start_request(st, request, self._prompt(prompt), params, ["text"],
                                         rid)
            first = await first_output(stream)
            handed_over = True
            return ManagedStreamingResponse(
                self._sse(body, prompt, stream, first, rid, created),
                lambda: close_stream(st, stream, rid, "completions"),
                media_type="text/event-stream", headers={"X-Request-Id": rid})
        except ClientGone:
            return client_gone(st, rid, "completions")
        finally:
            release_unless_handed_over(st, stream, handed_over)

    async def _sse(self, body: CompletionRequest, prompt: str | list[int],
                   stream: RequestStream, first: OmniRequestOutput, rid: str,
                   created: int) -> AsyncIterator[str]:
        def chunk(text: str, logprobs: Any = None, finish: str | None = None) -> str:
            return sse({"id": rid, "object": "text_completion", "created": created,
                        "model": body.model, "choices": [{"index": 0, "text": text,
                                                          "logprobs": logprobs,
                                                          "finish_reason": finish}]})
        out, pending = first, []
        try:
            if body.echo:
                yield chunk(self._echo(body, prompt))
            while out is not None:
                if out.error:
                    mark_outcome(stream.scope, "error")
                    yield sse(runtime_error(out.error, produced=bool(out.token_ids)).body())
                    break
                pending += out.logprobs_delta or []
                if out.text_delta:
                    yield chunk(out.text_delta, self._logprobs(body, out.token_ids, pending))
                    pending = []
                if out.finished:
                    self._finished(out, rid)
                    yield chunk("", None, self._reason(out))
                    break
                out = await stream.next()
        except ClientGone:
            mark_outcome(stream.scope, "499")
            return
        except ServerShuttingDown as e:
            mark_outcome(stream.scope, "error")
            yield sse(e.body())
        yield sse("[DONE]")

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _prompt(prompt: str | list[int]) -> Any:
        return prompt if isinstance(prompt, str) else {"prompt_token_ids": list(prompt)}

    def _echo(self, body: CompletionRequest, prompt: str | list[int]) -> str:
        if not body.echo:
            return ""
        return prompt if isinstance(prompt, str) else \
            self.state.llm.tokenizer.decode(prompt, skip_special_tokens=False)

    def _logprobs(self, body: CompletionRequest, token_ids: list[int],
                  logprobs: list[dict[int, float]] | None) -> dict[str, Any] | None:
        """OpenAI's legacy shape for the last len(logprobs) tokens: tokens, token_logprobs,
        top_logprobs ({token: logprob} of the top `logprobs` ones), text_offset."""
        if body.logprobs is None or logprobs is None:
            return None
        tok = self.state.llm.tokenizer
        tokens, token_lps, tops, offsets, at = [], [], [], [], 0
        for token, lps in zip(token_ids[len(token_ids) - len(logprobs):], logprobs):
            text, lp = token_logprob(tok, token, lps[token])
            tokens.append(text)
            token_lps.append(lp)
            top = sorted(lps.items(), key=lambda item: -item[1])[:body.logprobs]
            tops.append(dict(token_logprob(tok, t, v) for t, v in top))
            offsets.append(at)
            at += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}

    def _reason(self, out: OmniRequestOutput) -> str:
        return finish_reason(self.state, out)

    def _finished(self, out: OmniRequestOutput, rid: str) -> None:
        self.state.metrics.observe_finished("completions", out)
        log.info("%s: completion finished tokens=%s", rid, out.metrics.tokens_per_stage)
