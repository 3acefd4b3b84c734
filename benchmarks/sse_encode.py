"""The server's cost of one streamed audio event (chat completions, pcm16): float32 chunk ->
int16 -> base64 -> the chunk's JSON -> SSE text, as the HTTP event loop does it for every chunk
of every stream (a code2wav step hands it one chunk per stream at once, while the runtime's
thread waits for the GIL). Two ways side by side on the same chunks: json.dumps scanning the
base64 string (the reference), and sse()'s splice of the base64 into the JSON text. Both give
the same bytes (checked here too).

    python -m benchmarks.sse_encode --out benchmarks/results/sse_encode_cpu.json"""

from __future__ import annotations

import argparse
import base64
import json
import os
import time

import numpy as np

from benchmarks.common import write_result
from omnistage.entrypoints.openai.serving import sse, to_pcm16

SAMPLE_RATE = 24_000  # Qwen2.5-Omni's code2wav


def chunk(data: str, model: str = "bench") -> dict:
    """A streamed chat chunk carrying one audio delta, as the server writes it."""
    return {"id": "chatcmpl-" + "0" * 32, "object": "chat.completion.chunk", "created": 0,
            "model": model, "system_fingerprint": None,
            "choices": [{"index": 0, "delta": {"audio": {"id": "audio_" + "0" * 32,
                                                         "data": data}},
                         "logprobs": None, "finish_reason": None}]}


def per_event_us(fn, repeats: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return round((time.perf_counter() - t0) / repeats * 1e6, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", default="0.1,0.5,1.0", help="chunk lengths in audio seconds")
    ap.add_argument("--streams", type=int, default=32, help="chunks handed over at once")
    ap.add_argument("--repeats", type=int, default=2000)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lengths = [float(s) for s in args.seconds.split(",") if s]
    if not lengths or min(lengths) <= 0 or max(lengths) > 60 or args.repeats < 1 \
            or args.streams < 1:
        ap.error("--seconds: lengths in (0, 60]; --repeats, --streams: positive")
    load = os.getloadavg()
    rng = np.random.default_rng(0)
    result: dict = {"config": vars(args), "rows": []}
    for seconds in lengths:
        wave = (rng.random(int(seconds * SAMPLE_RATE), dtype=np.float32) - 0.5)

        def scanned(wave: np.ndarray = wave) -> str:
            return sse(chunk(base64.b64encode(to_pcm16(wave).tobytes()).decode()))

        def spliced(wave: np.ndarray = wave) -> str:
            return sse(chunk(""), base64.b64encode(to_pcm16(wave).tobytes()).decode())
        if scanned() != spliced() or not json.loads(spliced()[6:]):
            raise RuntimeError("the spliced event differs from json.dumps's")
        a, b = per_event_us(scanned, args.repeats), per_event_us(spliced, args.repeats)
        result["rows"].append({"chunk_seconds": seconds, "json_scanned_us": a,
                               "spliced_us": b, "speedup": round(a / b, 2),
                               f"burst_of_{args.streams}_ms": [round(a * args.streams / 1e3, 2),
                                                               round(b * args.streams / 1e3, 2)]})
    write_result(result, args.out, load)


if __name__ == "__main__":
    main()
