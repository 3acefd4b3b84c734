"""POST /v1/images/generations: OpenAI's Images API on a diffusers image pipeline. One request
= one AsyncOmniLLM request of `n` images (one noise stream from `seed`); the answer is OpenAI's
`{"created", "data": [{"b64_json"}], "output_format", "size"}` once every image is decoded.
Only base64 data is returned (no hosted URLs) and the response is not streamed."""

from __future__ import annotations

import asyncio
import base64
import io
import re
import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from omnistage.entrypoints.openai.protocol import APIError
from omnistage.entrypoints.openai.protocol_images import ImageGenerationRequest
from omnistage.entrypoints.openai.serving import (ClientGone, RequestStream, ServerState,
                                                  client_gone, log, release_unless_handed_over,
                                                  runtime_error, seconds, start_request,
                                                  value_error)
from omnistage.outputs import OmniRequestOutput
from omnistage.sampling_params import DiffusionParams

DEFAULT_SIZE = "1024x1024"  # also what "auto" means
_SIZE = re.compile(r"(\d{1,6})[xX](\d{1,6})")
# output_format -> (PIL format, save options)
_IMAGE_ENCODINGS: dict[str, tuple[str, dict[str, Any]]] = {
    "png": ("PNG", {}),
    "jpeg": ("JPEG", {"quality": 95}),
    "webp": ("WEBP", {"quality": 95}),
}
# DiffusionParams field -> the request field that set it
_HTTP_NAMES = {"height": "size", "width": "size", "num_images": "n"}
_PARAM_ERROR = re.compile(r"(?:sampling_params|prompts\[0\])\.(\w+): (.*)", re.DOTALL)


def parse_size(size: str, pipeline: Any) -> tuple[int, int]:
    """'WxH' (or 'auto') -> (width, height) within the pipeline's limits, else a 400 on size."""
    m = _SIZE.fullmatch(DEFAULT_SIZE if size == "auto" else size)
    if m is None:
        raise APIError(400, f"size: {size!r} is not 'WIDTHxHEIGHT' (e.g. '1024x1024') or "
                       "'auto'", param="size")
    width, height = int(m[1]), int(m[2])
    multiple = pipeline.size_multiple
    if min(width, height) < multiple or width % multiple or height % multiple:
        raise APIError(400, f"size: width and height must be positive multiples of {multiple}, "
                       f"got {width}x{height}", param="size")
    if max(width, height) > pipeline.max_side or width * height > pipeline.max_pixels:
        raise APIError(400, f"size: {width}x{height} is too large for this model (sides at most "
                       f"{pipeline.max_side}, at most {pipeline.max_pixels} pixels)",
                       param="size")
    return width, height


def params_error(e: ValueError) -> APIError:
    """prepare()'s ValueError ('sampling_params.guidance_scale: ...') -> a 400 whose `param` is
    the request field (height/width -> size, num_images -> n)."""
    m = _PARAM_ERROR.fullmatch(str(e))
    if m is None:
        return value_error(e)
    field, why = m[1], m[2]
    param = _HTTP_NAMES.get(field, field)
    return APIError(400, f"{param}: {why}" if param == field else f"{param}: {field} {why}",
                    param=param)


def encode_image(image: Any, fmt: str) -> bytes:
    """A PIL image -> the bytes of a `fmt` file (png, jpeg, webp)."""
    pil_format, options = _IMAGE_ENCODINGS[fmt]
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format=pil_format, **options)
    return buf.getvalue()


class OpenAIServingImages:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    async def create(self, body: ImageGenerationRequest, request: Request) -> Response:
        st = self.state
        if body.model is not None:
            st.check_model(body.model)
        if "image" not in st.output_modalities:
            raise APIError(400, "model: this model does not generate images; use "
                           "/v1/chat/completions", param="model")
        if body.response_format == "url":
            raise APIError(400, "response_format: 'url' is not supported (this server hosts no "
                           "images); use 'b64_json'", param="response_format")
        if body.stream:
            raise APIError(400, "stream: streaming is not supported", param="stream")
        width, height = parse_size(body.size, st.llm.pipeline)
        params = DiffusionParams(
            height=height, width=width, num_inference_steps=body.num_inference_steps,
            guidance_scale=body.guidance_scale, true_cfg_scale=body.true_cfg_scale,
            negative_prompt=body.negative_prompt, num_images=body.n, seed=body.seed)
        rid = f"img-{uuid.uuid4().hex}"
        st.acquire()
        stream = None
        try:
            stream = await start_request(st, request, body.prompt, params, None, rid,
                                         bad_request=params_error)
            out = await self._last(stream, rid)
            log.info("%s: images n=%d size=%dx%d format=%s e2e=%s", rid, body.n, width, height,
                     body.output_format, seconds(out.metrics.e2e))
            # encoding (PNG: zlib) takes a while at large sizes: off the event loop
            files = await asyncio.to_thread(
                lambda: [encode_image(img, body.output_format) for img in out.images])
            return JSONResponse(
                {"created": int(time.time()),
                 "data": [{"b64_json": base64.b64encode(f).decode()} for f in files],
                 "output_format": body.output_format, "size": f"{width}x{height}"},
                headers={"X-Request-Id": rid})
        except ClientGone:
            return client_gone(st, rid, "images")
        finally:
            release_unless_handed_over(st, stream, handed_over=False)

    async def _last(self, stream: RequestStream, rid: str) -> OmniRequestOutput:
        """Run the request to its end (progress outputs come first): its last output, with
        every image; a rejected or failed request raises APIError."""
        stepped = False
        while True:
            try:
                out = await stream.next()
            except ValueError as e:
                raise params_error(e) from e
            if out is None:
                raise APIError(500, "the request ended without output", type_="server_error")
            stepped = stepped or out.progress is not None
            if out.finished:
                break
        self.state.metrics.observe_finished("images", out)
        if out.error:
            log.info("%s: failed: %s", rid, out.error)
            raise runtime_error(out.error, produced=stepped)
        if not out.images:
            raise APIError(500, "the request finished without images", type_="server_error")
        return out
