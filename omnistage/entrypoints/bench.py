"""`omnistage bench`: latency and throughput of a RUNNING OpenAI-compatible server (omnistage's,
or any that speaks chat completions with pcm16 audio deltas), as vLLM's benchmark_serving
drives one.

Workload: streamed chat completions of one text prompt, text (`--modalities text`) or text +
audio as pcm16 deltas (`--modalities audio`), greedy, seeded per request. For each concurrency
level, `--num-prompts` requests (default: as many as the level) with at most that many in
flight; `--warmup-rounds` rounds of the largest level first, not counted.

Per level: requests, errors (count and the first messages), request and token throughput,
audio seconds per second, TTFT (first text delta) and TTFA (first audio delta) p50/p90/p99 as
the client sees them, TPOT (time per text token after the first) and RTF (e2e / audio
seconds) p50/p90/p99. Token counts come from the stream's usage chunk.

benchmarks/serving.py runs the same client beside the engine driven in-process."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import numpy as np

from omnistage.entrypoints.sse_client import HTTPStatusError, SSEClient

PCM16_RATE = 24000  # the server's pcm16 audio deltas: int16 mono at 24 kHz
DEFAULT_PROMPT = "Tell me a short story about a lighthouse keeper and a storm."
MAX_CONCURRENCY = 4096
MAX_NUM_PROMPTS = 1_000_000
QUANTILES = (50, 90, 99)
MAX_ERRORS_SHOWN = 3


@dataclass
class BenchConfig:
    base_url: str
    model: str
    concurrency: list[int] = field(default_factory=lambda: [1])
    num_prompts: int | None = None  # per level; None: as many as the level's concurrency
    max_tokens: int = 128
    modalities: str = "text"  # "text" or "audio" (text + audio)
    warmup_rounds: int = 1
    api_key: str | None = None
    prompt: str = DEFAULT_PROMPT
    ignore_eos: bool = False
    codes: int | None = None  # audio: the codec stage's max tokens (talker codes)
    codec_stage: str = "talker"
    voice: str | None = None
    request_timeout: float = 600.0
    seed: int = 0

    def validate(self) -> None:
        url = urlparse(self.base_url)
        if url.scheme not in ("http", "https") or not url.netloc:
            raise ValueError(f"--base-url: expected http(s)://host:port, got {self.base_url!r}")
        if not self.model:
            raise ValueError("--model: must not be empty")
        if not self.concurrency:
            raise ValueError("--concurrency: give at least one level")
        for c in self.concurrency:
            if not 1 <= c <= MAX_CONCURRENCY:
                raise ValueError(f"--concurrency: {c} is outside [1, {MAX_CONCURRENCY}]")
        checks = {"--num-prompts": (self.num_prompts, MAX_NUM_PROMPTS),
                  "--max-tokens": (self.max_tokens, 1 << 31), "--codes": (self.codes, 1 << 31)}
        for flag, (value, limit) in checks.items():
            if value is not None and not 1 <= value <= limit:
                raise ValueError(f"{flag}: {value} is outside [1, {limit}]")
        if self.modalities not in ("text", "audio"):
            raise ValueError(f"--modalities: text or audio, got {self.modalities!r}")
        if self.codes is not None and self.modalities != "audio":
            raise ValueError("--codes: only with --modalities audio")
        if self.warmup_rounds < 0:
            raise ValueError(f"--warmup-rounds: must be >= 0, got {self.warmup_rounds}")
        if not self.request_timeout > 0:
            raise ValueError(f"--request-timeout: must be > 0, got {self.request_timeout}")


# ------------------------------------------------------------------ one request
def chat_body(cfg: BenchConfig, seed: int) -> dict[str, Any]:
    """The streamed chat request number `seed`."""
    body: dict[str, Any] = {"model": cfg.model, "stream": True,
                            "stream_options": {"include_usage": True},
                            "messages": [{"role": "user", "content": cfg.prompt}],
                            "max_tokens": cfg.max_tokens, "temperature": 0.0, "seed": seed}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.modalities == "audio":
        body["modalities"] = ["text", "audio"]
        body["audio"] = {"format": "pcm16", **({"voice": cfg.voice} if cfg.voice else {})}
        if cfg.codes is not None:
            body["stage_sampling_params"] = {cfg.codec_stage: {
                "max_tokens": cfg.codes, **({"ignore_eos": True} if cfg.ignore_eos else {})}}
    return body


def b64_bytes(data: str) -> int:
    """The decoded length of base64 text, without decoding it (one client loop reads every
    stream: decoding 32 streams of audio there would delay their timestamps)."""
    if len(data) % 4:
        raise ValueError(f"audio data: base64 of {len(data)} characters (not a multiple of 4)")
    return len(data) // 4 * 3 - len(data[-2:]) + len(data[-2:].rstrip("="))


async def one_request(client: SSEClient, body: dict[str, Any], timeout: float
                      ) -> dict[str, Any]:
    """Stream one chat completion: client-side ttft, ttfa, e2e (s), audio seconds and the
    usage's token counts; {"error": ...} when it fails (or outlasts `timeout` seconds)."""
    t0 = time.perf_counter()
    ttft = ttfa = None
    samples = 0
    usage: dict[str, Any] = {}
    try:
        async with asyncio.timeout(timeout), \
                client.post_events("/v1/chat/completions", body) as lines:
            async for line in lines:
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return {"error": str(chunk["error"])[:300]}
                usage = chunk.get("usage") or usage
                now = time.perf_counter() - t0
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta") or {}
                    audio = delta.get("audio") or {}
                    if ttft is None and (delta.get("content") or audio.get("transcript")):
                        ttft = now
                    if audio.get("data"):
                        ttfa = now if ttfa is None else ttfa
                        samples += b64_bytes(audio["data"]) // 2
    except HTTPStatusError as e:
        return {"error": str(e)[:300]}
    except TimeoutError:
        return {"error": f"timed out after {timeout} s"}
    except (OSError, EOFError, asyncio.LimitOverrunError, ValueError) as e:
        # (a dropped connection, a cut body, a malformed answer; JSONDecodeError: ValueError)
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    details = usage.get("completion_tokens_details") or {}
    return {"ttft": ttft, "ttfa": ttfa, "e2e": time.perf_counter() - t0,
            "audio_s": samples / PCM16_RATE,
            "text_tokens": details.get("text_tokens", usage.get("completion_tokens")),
            "output_tokens": usage.get("completion_tokens")}


# ------------------------------------------------------------------ statistics
def quantiles(xs: list[float], name: str) -> dict[str, float | None]:
    """{name_p50: ..., name_p90: ..., name_p99: ...} (None without samples)."""
    arr = np.asarray([x for x in xs if x is not None], np.float64)
    return {f"{name}_p{q}": round(float(np.percentile(arr, q)), 4) if arr.size else None
            for q in QUANTILES}


def summarize(rows: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    """One level's numbers from its requests' rows (one_request's) and its wall time."""
    ok = [r for r in rows if "error" not in r]
    errors = [r["error"] for r in rows if "error" in r]
    audio = sum(r["audio_s"] for r in ok)
    text_tokens = sum(r.get("text_tokens") or 0 for r in ok)
    output_tokens = sum(r.get("output_tokens") or 0 for r in ok)
    tpot = [(r["e2e"] - r["ttft"]) / (r["text_tokens"] - 1) for r in ok
            if r["ttft"] is not None and (r.get("text_tokens") or 0) > 1]
    out: dict[str, Any] = {
        "requests": len(rows), "completed": len(ok), "errors": len(errors),
        "error_messages": errors[:MAX_ERRORS_SHOWN], "wall_s": round(wall, 3),
        "requests_per_second": round(len(ok) / wall, 3) if wall else None,
        "text_tokens": text_tokens, "output_tokens": output_tokens,
        "text_tokens_per_second": round(text_tokens / wall, 3) if wall else None,
        "output_tokens_per_second": round(output_tokens / wall, 3) if wall else None,
        "audio_seconds": round(audio, 3),
        "audio_seconds_per_second": round(audio / wall, 3) if wall else None}
    out.update(quantiles([r["ttft"] for r in ok], "ttft"))
    out.update(quantiles([r["ttfa"] for r in ok], "ttfa"))
    out.update(quantiles(tpot, "tpot"))
    out.update(quantiles([r["e2e"] / r["audio_s"] for r in ok if r["audio_s"]], "rtf"))
    out.update(quantiles([r["e2e"] for r in ok], "e2e"))
    return out


async def run_level(send: Callable[[int], Awaitable[dict[str, Any]]], concurrency: int,
                    num_prompts: int) -> dict[str, Any]:
    """`num_prompts` requests `send(i)`, at most `concurrency` in flight: summarize()'s dict."""
    gate = asyncio.Semaphore(concurrency)

    async def gated(i: int) -> dict[str, Any]:
        async with gate:
            return await send(i)

    t0 = time.perf_counter()
    rows = await asyncio.gather(*(gated(i) for i in range(num_prompts)))
    return {"concurrency": concurrency, **summarize(list(rows), time.perf_counter() - t0)}


# ------------------------------------------------------------------ a running server
class ServerUnreachable(Exception):
    """The server did not answer, or does not serve the model."""


def _headers(cfg: BenchConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}


async def check_server(client: httpx.AsyncClient, cfg: BenchConfig) -> None:
    """GET /v1/models: the server answers, the key is accepted and it serves `cfg.model`."""
    try:
        resp = await client.get(cfg.base_url + "/v1/models", timeout=10.0)
    except httpx.HTTPError as e:
        raise ServerUnreachable(f"cannot reach {cfg.base_url}: {type(e).__name__}: {e}") from e
    if resp.status_code != 200:
        raise ServerUnreachable(f"GET {cfg.base_url}/v1/models answered HTTP "
                                f"{resp.status_code}: {resp.text[:300]}")
    try:
        served = [m["id"] for m in resp.json()["data"]]
    except (ValueError, KeyError, TypeError) as e:
        raise ServerUnreachable(f"GET {cfg.base_url}/v1/models: not an OpenAI model list: "
                                f"{resp.text[:300]}") from e
    if cfg.model not in served:
        raise ServerUnreachable(f"--model: {cfg.model!r} is not served by {cfg.base_url}; it "
                                f"serves {served}")


async def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Warm-up rounds, then every level: {"config": ..., "levels": {"c1": ..., ...}}."""
    cfg.validate()
    biggest = max(cfg.concurrency)
    async with httpx.AsyncClient(timeout=cfg.request_timeout, headers=_headers(cfg)) as client:
        await check_server(client, cfg)
    streams = SSEClient(cfg.base_url, _headers(cfg))  # the streamed requests (sse_client)
    seeds = itertools.count(cfg.seed)  # every request its own seed

    async def send(_: int) -> dict[str, Any]:
        return await one_request(streams, chat_body(cfg, next(seeds)), cfg.request_timeout)

    try:
        warmup = [await run_level(send, biggest, biggest) for _ in range(cfg.warmup_rounds)]
        levels = {}
        for c in cfg.concurrency:
            levels[f"c{c}"] = await run_level(send, c, cfg.num_prompts or c)
    finally:
        await streams.aclose()
    config = {k: v for k, v in asdict(cfg).items() if k != "api_key"}
    return {"config": config, "warmup_errors": sum(w["errors"] for w in warmup),
            "levels": levels}


# ------------------------------------------------------------------ output
_COLUMNS = [("conc", "concurrency", "d"), ("reqs", "requests", "d"), ("err", "errors", "d"),
            ("req/s", "requests_per_second", ".2f"), ("tok/s", "text_tokens_per_second", ".1f"),
            ("audio-s/s", "audio_seconds_per_second", ".2f"), ("TTFT p50", "ttft_p50", ".3f"),
            ("p90", "ttft_p90", ".3f"), ("p99", "ttft_p99", ".3f"),
            ("TTFA p50", "ttfa_p50", ".3f"), ("p90", "ttfa_p90", ".3f"),
            ("p99", "ttfa_p99", ".3f"), ("RTF p50", "rtf_p50", ".3f"),
            ("TPOT p50", "tpot_p50", ".4f")]


def format_table(levels: dict[str, dict[str, Any]]) -> str:
    """The levels as a fixed-width table (seconds; '-' where a number does not apply)."""
    def cell(value: Any, fmt: str) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "-"
        return format(value, fmt)

    widths = [max(len(title), 9) for title, _, _ in _COLUMNS]
    lines = ["  ".join(t.rjust(w) for (t, _, _), w in zip(_COLUMNS, widths))]
    for row in levels.values():
        lines.append("  ".join(cell(row.get(key), fmt).rjust(w)
                               for (_, key, fmt), w in zip(_COLUMNS, widths)))
    return "\n".join(lines)


def _concurrency(text: str) -> list[int]:
    try:
        return [int(c) for c in text.split(",") if c.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected integers like 1,4,16, got {text!r}") from e


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="the running server (default: %(default)s)")
    p.add_argument("--model", required=True, help="a model name the server serves")
    p.add_argument("--concurrency", type=_concurrency, nargs="+", default=[[1]],
                   help="requests in flight, one or several levels: 1,4,16 or 1 4 16")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="requests per level (default: the level's concurrency)")
    p.add_argument("--max-tokens", type=int, default=128, help="text tokens per reply")
    p.add_argument("--modalities", choices=["text", "audio"], default="text",
                   help="text, or text + audio (pcm16 stream)")
    p.add_argument("--warmup-rounds", type=int, default=1,
                   help="rounds of the largest level before measuring (not counted)")
    p.add_argument("--output", default=None, help="write the results as JSON to this path")
    p.add_argument("--api-key", default=None,
                   help="sent as 'Authorization: Bearer KEY' (default: $OMNISTAGE_API_KEY)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="the user message")
    p.add_argument("--ignore-eos", action="store_true",
                   help="every reply runs to --max-tokens (and --codes): fixed lengths")
    p.add_argument("--codes", type=int, default=None,
                   help="audio: the codec stage's max tokens (talker codes)")
    p.add_argument("--codec-stage", default="talker", help="the stage --codes applies to")
    p.add_argument("--voice", default=None, help="audio: the speaker")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds")
    p.add_argument("--seed", type=int, default=0, help="request i is seeded with seed + i")


def config_from_args(args: argparse.Namespace, api_key: str | None) -> BenchConfig:
    return BenchConfig(
        base_url=args.base_url.rstrip("/"), model=args.model,
        concurrency=[c for group in args.concurrency for c in group],
        num_prompts=args.num_prompts, max_tokens=args.max_tokens, modalities=args.modalities,
        warmup_rounds=args.warmup_rounds, api_key=args.api_key or api_key, prompt=args.prompt,
        ignore_eos=args.ignore_eos, codes=args.codes, codec_stage=args.codec_stage,
        voice=args.voice, request_timeout=args.request_timeout, seed=args.seed)


def cmd_bench(args: argparse.Namespace, api_key: str | None) -> int:
    """Run, print the table, write --output; 1 when the server cannot be used or a request
    failed, else 0."""
    cfg = config_from_args(args, api_key)
    cfg.validate()  # (a ValueError: the CLI prints it, exit 2)
    try:
        result = asyncio.run(run_bench(cfg))
    except ServerUnreachable as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    result["config"]["loadavg_1min"] = round(os.getloadavg()[0], 2)
    print(f"omnistage bench: {cfg.base_url} model {cfg.model!r}, {cfg.modalities}, "
          f"max_tokens {cfg.max_tokens}; seconds")
    print(format_table(result["levels"]))
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.output}")
    errors = sum(level["errors"] for level in result["levels"].values())
    for name, level in result["levels"].items():
        for message in level["error_messages"]:
            print(f"error ({name}): {message}", file=sys.stderr)
    return 1 if errors else 0
