"""The server's front end per request, on the CPU: what the HTTP app does on its event loop for
a streamed chat request (ASGI middleware, routing, body validation, the handler, the SSE
response), against the engine's own start() of the same request, in one run.

Why: at c32 a server's requests reach the runtime later than the engine's, and its TTFT is
later by about that much (benchmarks.serving on the H200, session 32). Each round is a burst of
`--requests` streamed chat requests at once (the c32 round's shape), each `--max-tokens` text
tokens. Per side and round:
  - ingestion: from the burst's start until its last request entered AsyncOmniLLM.start()
    (the engine side: until its last start() call);
  - first event, p50 over the burst: from the burst's start until a request's first body
    bytes were sent (its role event, which waits for the first token; the engine side: its
    first output);
  - the event loop's thread CPU time per request over the whole round (the streams included);
  - wall time of the round.
A third side, `fastapi_routes`, is the same app with its POST requests served through
FastAPI's middleware and route handling (server._App's direct path taken out; its streamed
responses are the same as the app's).
The app is called as uvicorn calls it, without sockets (uvicorn's HTTP parsing is not in it);
both sides share one engine on the embedded tiny model. As under `omnistage serve`: the GIL
switch interval is the server's (ServerConfig.switch_interval_ms), and INFO log records are
written (to `--log-file`, /dev/null by default).

    python -m benchmarks.server_front --out benchmarks/results/server_front_cpu.json"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import time

from benchmarks.common import write_result
from omnistage import SamplingParams
from omnistage.entrypoints import bench
from omnistage.entrypoints.openai.server import post_in_process


async def app_request(app, body: dict) -> float:
    """One request through the ASGI app; returns when its first body bytes were sent."""
    firsts: list[float] = []

    def first(_: bytes) -> None:
        if not firsts:
            firsts.append(time.perf_counter())

    status, answer = await post_in_process(app, "/v1/chat/completions", body, on_chunk=first)
    if status != 200:
        raise RuntimeError(f"status {status}: {answer[-300:]!r}")
    return firsts[0]


async def engine_request(llm, body: dict) -> float:
    """The same request through AsyncOmniLLM.start() directly; returns when its first output
    came."""
    params = {"thinker": SamplingParams(temperature=0.0, max_tokens=body["max_tokens"],
                                        ignore_eos=True, seed=body["seed"])}
    _, outputs = await llm.start({"messages": body["messages"]}, params, ["text"])
    first = None
    async for _ in outputs:
        first = first or time.perf_counter()
    if first is None:
        raise RuntimeError("no output")
    return first


async def measure(send, args, starts: list[float]) -> dict:
    rounds = []
    for r in range(args.warmup + args.rounds):
        starts.clear()
        cpu, t0 = time.thread_time(), time.perf_counter()
        firsts = await asyncio.gather(*[send(i) for i in range(args.requests)])
        wall, cpu = time.perf_counter() - t0, time.thread_time() - cpu
        if r >= args.warmup:
            rounds.append({"ingestion_ms": (max(starts) - t0) * 1e3,
                           "first_event_p50_ms": (statistics.median(firsts) - t0) * 1e3,
                           "loop_cpu_ms_per_request": cpu / args.requests * 1e3,
                           "wall_ms": wall * 1e3})
    return {k: round(statistics.median([r[k] for r in rounds]), 3) for k in rounds[0]} | {
        "rounds": [{k: round(v, 3) for k, v in r.items()} for r in rounds]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=32, help="requests per burst")
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3, help="rounds not counted")
    ap.add_argument("--log-file", default=os.devnull, help="where the INFO records go")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not 1 <= args.requests <= 256 or args.rounds < 1 or args.warmup < 0:
        ap.error("--requests: 1..256; --rounds: >= 1; --warmup: >= 0")
    from omnistage import AsyncOmniLLM
    from omnistage.entrypoints.cli import EMBEDDED_MODELS
    from omnistage.entrypoints.engine_process import LOG_FORMAT
    from omnistage.entrypoints.openai.server import build_app, set_switch_interval
    from omnistage.entrypoints.openai.serving import ServerConfig
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, filename=args.log_file)
    load = os.getloadavg()
    llm = AsyncOmniLLM(model=str(EMBEDDED_MODELS["tiny-qwen2.5-omni"][1]()), device="cpu")
    cfg = bench.BenchConfig(base_url="", model="bench", concurrency=[args.requests],
                            max_tokens=args.max_tokens, modalities="text", ignore_eos=True,
                            codes=None, warmup_rounds=0, request_timeout=60.0)
    starts: list[float] = []
    start = llm.start

    async def timed_start(*a, **k):  # (when each request reached the engine)
        starts.append(time.perf_counter())
        return await start(*a, **k)

    llm.start = timed_start
    config = ServerConfig(served_model_names=["bench"], max_queue=1024)
    set_switch_interval(config.switch_interval_ms)
    result: dict = {"config": {k: v for k, v in vars(args).items() if k != "out"}
                    | {"switch_interval_ms": config.switch_interval_ms}}

    async def run() -> None:
        app, fastapi_routes = build_app(llm, config), build_app(llm, config)
        fastapi_routes.posts = {}  # (every request through FastAPI's stack and routes)
        async with app.router.lifespan_context(app), \
                fastapi_routes.router.lifespan_context(fastapi_routes):
            result["server_app"] = await measure(
                lambda i: app_request(app, bench.chat_body(cfg, i)), args, starts)
            result["fastapi_routes"] = await measure(
                lambda i: app_request(fastapi_routes, bench.chat_body(cfg, i)), args,
                starts)
        result["engine"] = await measure(
            lambda i: engine_request(llm, bench.chat_body(cfg, i)), args, starts)

    try:
        asyncio.run(run())
    finally:
        llm.shutdown()
    for name, top, bottom in (("server_over_engine", "server_app", "engine"),
                              ("server_over_fastapi_routes", "server_app", "fastapi_routes")):
        result[name] = {k: round(result[top][k] / result[bottom][k], 3)
                        for k in ("ingestion_ms", "first_event_p50_ms",
                                  "loop_cpu_ms_per_request", "wall_ms")
                        if result[bottom][k]}
    write_result(result, args.out, load)


if __name__ == "__main__":
    main()
