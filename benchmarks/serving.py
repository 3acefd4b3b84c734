"""The product path: `omnistage serve` over HTTP, driven by concurrent streaming clients (as
vLLM's benchmark_serving drives its server), beside the engine driven directly
(AsyncOmniLLM in this process) on the same workload, in one run.

Workload: a chat request with a text prompt, text + audio out (pcm16 SSE), a fixed reply length
(`--max-tokens` text tokens, `--codes` talker codes; eos ignored so every request has the same
length), `--concurrency` levels, each a closed round of that many requests submitted at once.

Per level and side: TTFT (first text delta) and TTFA (first audio delta) p50 / p90 / p99 seen
by the client (the engine side: from its submit), RTF = e2e / audio seconds, audio-seconds per
second of the round; for the server, start-up to /health and the first request's TTFA against
a warm one. The client and the statistics are `omnistage bench`'s (omnistage/entrypoints/
bench.py), which drives an already running server.

    python -m benchmarks.serving --model /path/to/ckpt --device cuda --concurrency 1,16,32 \\
        --out benchmarks/results/serving_h100.json
    python -m benchmarks.serving   # the embedded tiny model on CPU (a smoke test)"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from benchmarks.common import write_result
from omnistage.entrypoints import bench


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_config(args, url: str) -> bench.BenchConfig:
    """The workload as `omnistage bench` sends it: text + pcm16 audio, eos ignored in the
    thinker (top-level ignore_eos) and the talker (`--codes` codes)."""
    return bench.BenchConfig(base_url=url, model="bench", concurrency=args.concurrency,
                             max_tokens=args.max_tokens, modalities="audio", ignore_eos=True,
                             codes=args.codes, warmup_rounds=0,
                             request_timeout=args.request_timeout)


async def engine_request(llm, args, seed: int) -> dict:
    """The same request through AsyncOmniLLM directly."""
    from omnistage import SamplingParams
    params = {"thinker": SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                        ignore_eos=True, seed=seed),
              "talker": SamplingParams(**{**llm.pipeline.default_params["talker"].__dict__,
                                          "max_tokens": args.codes, "ignore_eos": True})}
    t0 = time.perf_counter()
    ttft = ttfa = None
    samples = 0
    out = None
    prompt = {"messages": [{"role": "user", "content": bench.DEFAULT_PROMPT}]}
    async for out in llm.generate(prompt, params):
        now = time.perf_counter() - t0
        if ttft is None and out.text_delta:
            ttft = now
        if out.audio is not None and len(out.audio):
            ttfa = now if ttfa is None else ttfa
            samples += len(out.audio)
        if out.error:
            return {"error": out.error}
    text = len(out.token_ids) if out is not None else 0
    codes = out.metrics.tokens_per_stage.get("talker", 0) if out is not None else 0
    return {"ttft": ttft, "ttfa": ttfa, "e2e": time.perf_counter() - t0,
            "audio_s": samples / bench.PCM16_RATE, "text_tokens": text,
            "output_tokens": text + codes}


async def rounds(send, levels: list[int]) -> dict:
    """Per level c: one closed round of c requests at once (bench.run_level's numbers)."""
    return {f"c{c}": await bench.run_level(send, c, c) for c in levels}


def run_server_side(args) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "omnistage.entrypoints.cli", "serve", args.model,
           "--port", str(port), "--served-model-name", "bench", "--max-queue", "1024",
           *(["--device", args.device] if args.device else []), *args.server_arg]
    log = open(args.server_log, "w")  # noqa: SIM115 - closed below
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited {proc.returncode}: see {args.server_log}")
            try:
                if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - t0 > args.startup_timeout:
                raise RuntimeError(f"server not up after {args.startup_timeout} s")
            time.sleep(0.2)
        result: dict = {"startup_to_health_s": round(time.perf_counter() - t0, 2)}

        cfg = bench_config(args, url)

        async def go() -> None:
            limits = httpx.Limits(max_connections=2048, max_keepalive_connections=2048)
            async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as client:
                first = await bench.one_request(client, url, bench.chat_body(cfg, 0))
                warm = await bench.one_request(client, url, bench.chat_body(cfg, 0))
                result["first_request"] = first
                result["warm_request"] = warm
                if first.get("ttfa") and warm.get("ttfa"):
                    result["first_over_warm_ttfa"] = round(first["ttfa"] / warm["ttfa"], 3)
                result.update(await rounds(
                    lambda i: bench.one_request(client, url, bench.chat_body(cfg, i)),
                    args.concurrency))

        asyncio.run(go())
        return result
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def run_engine_side(args) -> dict:
    from omnistage import AsyncOmniLLM
    from omnistage.entrypoints.cli import EMBEDDED_MODELS
    model = args.model
    if model in EMBEDDED_MODELS:
        model = str(EMBEDDED_MODELS[model][1]())
    t0 = time.perf_counter()
    result: dict = {}

    async def go() -> None:
        llm = AsyncOmniLLM(model=model, device=args.device)
        result["load_s"] = round(time.perf_counter() - t0, 2)
        try:
            await engine_request(llm, args, 0)  # warm-up
            result.update(await rounds(lambda i: engine_request(llm, args, i),
                                       args.concurrency))
        finally:
            llm.shutdown()

    asyncio.run(go())
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-qwen2.5-omni", help="checkpoint or embedded name")
    ap.add_argument("--device", default=None)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--codes", type=int, default=1024)
    ap.add_argument("--side", choices=["both", "server", "engine"], default="both")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra `omnistage serve` argument (repeatable, e.g. --server-arg=--x)")
    ap.add_argument("--server-log", default="/tmp/omnistage_serving_bench.log")
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    load = os.getloadavg()
    result: dict = {"config": {k: v for k, v in vars(args).items() if k != "out"}}
    if args.side in ("both", "engine"):  # first: its memory is gone before the server starts
        result["engine"] = run_engine_side(args)
        write_result(result, args.out, load)  # (kept if the server side does not finish)
    if args.side in ("both", "server"):
        result["server"] = run_server_side(args)
    if args.side == "both":
        result["server_over_engine"] = {
            f"c{c}": {k: round(result["server"][f"c{c}"][k] / result["engine"][f"c{c}"][k], 3)
                      for k in ("ttft_p50", "ttfa_p50", "audio_seconds_per_second")
                      if result["server"][f"c{c}"][k] and result["engine"][f"c{c}"][k]}
            for c in args.concurrency}
    write_result(result, args.out, load)
    if Path(args.server_log).is_file() and args.side != "engine":
        print(f"server log: {args.server_log}")


if __name__ == "__main__":
    main()
