"""The product path: `omnistage serve` over HTTP, driven by concurrent streaming clients (as
vLLM's benchmark_serving drives its server), beside the engine driven directly
(AsyncOmniLLM in this process) on the same workload, in one run.

Workload: a chat request with a text prompt, text + audio out (pcm16 SSE), a fixed reply length
(`--max-tokens` text tokens, `--codes` talker codes; eos ignored so every request has the same
length), `--concurrency` levels, each a closed round of that many requests submitted at once.

Each side first runs one request right after start (the server: after /health, the client
connected; the engine: after loading), then one warm request, then `--warmup-rounds` rounds at
the largest concurrency (not counted: every batch shape a measured round brings is compiled or
captured by then, on both sides alike), then the measured levels.

Per level and side: TTFT (first text delta) and TTFA (first audio delta) p50 / p90 / p99 seen
by the client (the engine side: from its generate() call), RTF = e2e / audio seconds,
audio-seconds per second of the round; the runtime's own TTFT / TTFA means (from the request's
arrival in the runtime loop; the engine side: the outputs' metrics, the server: /metrics); for
the server, where its path spends the time (means over the level from /metrics: received ->
prepared, prepared -> admitted by the runtime, received -> first text / audio event written),
start-up to /health, and the first request after start against a warm one. The client and the
statistics are `omnistage bench`'s (omnistage/entrypoints/bench.py), which drives an already
running server.

A load generator on the server's machine takes CPU time the server would have: `--server-cpus
0-7 --client-cpus 8-15` gives each its own CPUs, as a client on another machine would be (the
engine side then runs on the client's CPUs). `--repeats N` measures each level N times on one
start, and their median; `--starts N` starts each side N times, alternating (server, engine,
engine, server, ...; the engine side then in a process of its own per start), and reports the
median over starts and each pair's ratios: one start's numbers moved by more than the gap. A
start on empty compile caches (a fresh machine's first) is kept but not in the medians.
`--side server --starts N --server-arg-b ARG` is an A/B of server arguments the same way.
`--no-stream` asks the server for whole answers, an A/B of the SSE path (the runtime's TTFT /
TTFA still come from /metrics).

    python -m benchmarks.serving --model /path/to/ckpt --device cuda --concurrency 1,32 \\
        --max-tokens 128 --codes 1024 --out benchmarks/results/serving_h100.json
    python -m benchmarks.serving   # the embedded tiny model on CPU (a smoke test)
    python -m benchmarks.serving --concurrency 1,32 --max-tokens 32 --codes 128  # CPU, c32"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from prometheus_client.parser import text_string_to_metric_families

from benchmarks.common import free_port, stop_server, write_result
from omnistage.entrypoints import bench
from omnistage.entrypoints.openai.serving import SWITCH_INTERVAL_MS
from omnistage.entrypoints.sse_client import HTTPStatusError, SSEClient

# /metrics histograms -> the level's mean, in seconds (the server's path, and its runtime's)
SERVER_MEANS = {"server_prepare_mean": "omnistage_server_prepare_seconds",
                "server_admission_mean": "omnistage_server_admission_seconds",
                "server_ttft_mean": "omnistage_server_time_to_first_text_seconds",
                "server_ttfa_mean": "omnistage_server_time_to_first_audio_seconds",
                "runtime_ttft_mean": "omnistage_time_to_first_token_seconds",
                "runtime_ttfa_mean": "omnistage_time_to_first_audio_seconds"}


# a repeated level's numbers kept per round (--repeats)
ROUND_KEYS = ("ttft_p50", "ttfa_p50", "audio_seconds_per_second", "runtime_ttft_mean",
              "runtime_ttfa_mean")


def bench_config(args, url: str) -> bench.BenchConfig:
    """The workload as `omnistage bench` sends it: text + pcm16 audio, eos ignored in the
    thinker (top-level ignore_eos) and the talker (`--codes` codes)."""
    return bench.BenchConfig(base_url=url, model="bench", concurrency=args.concurrency,
                             max_tokens=args.max_tokens, modalities="audio", ignore_eos=True,
                             codes=args.codes, warmup_rounds=args.warmup_rounds,
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
    if out is None:
        return {"error": "no output"}
    text = len(out.token_ids)
    codes = out.metrics.tokens_per_stage.get("talker", 0)
    return {"ttft": ttft, "ttfa": ttfa, "e2e": time.perf_counter() - t0,
            "audio_s": samples / bench.PCM16_RATE, "text_tokens": text,
            "output_tokens": text + codes, "runtime_ttft": out.metrics.ttft,
            "runtime_ttfa": out.metrics.ttfa}


async def unstreamed_request(client: SSEClient, body: dict, timeout: float) -> dict:
    """`body` not streamed (`--no-stream`): the answer in one JSON body. The client sees no
    first text or audio; the runtime's own TTFT / TTFA (from /metrics) still come."""
    body = {k: v for k, v in body.items() if k != "stream_options"} | {"stream": False}
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(timeout), \
                client.post_events("/v1/chat/completions", body) as lines:
            answer = json.loads("".join([line async for line in lines]))
        data = (answer["choices"][0]["message"].get("audio") or {}).get("data") or ""
        usage = answer.get("usage") or {}
    except (HTTPStatusError, TimeoutError, OSError, EOFError, ValueError, KeyError, IndexError,
            AttributeError) as e:  # (AttributeError, KeyError, IndexError: not a chat answer)
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    details = usage.get("completion_tokens_details") or {}
    return {"ttft": None, "ttfa": None, "e2e": time.perf_counter() - t0,
            "audio_s": bench.b64_bytes(data) // 2 / bench.PCM16_RATE,
            "text_tokens": details.get("text_tokens", usage.get("completion_tokens")),
            "output_tokens": usage.get("completion_tokens")}


def cpu_list(text: str) -> set[int]:
    """`0-7,12` -> {0, ..., 7, 12}: CPUs of this machine (ValueError names the bad part)."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or int(hi or lo) < int(lo):
            raise ValueError(f"{part!r} is not a CPU number or range like 0-7")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    missing = cpus - os.sched_getaffinity(0)
    if missing:
        raise ValueError(f"CPUs {sorted(missing)} are not available here "
                         f"({sorted(os.sched_getaffinity(0))} are)")
    return cpus


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(sum(xs) / len(xs), 4) if xs else None


async def warm_then_measure(send, args, result: dict, snapshot, since,
                            profiled: tuple[str, int] | None = None) -> None:
    """`--warmup-rounds` rounds at the largest level (not counted), then each level: one closed
    round of c requests at once (bench.run_level's numbers, and `since(snapshot())`'s: what the
    side measured itself over the round). profiled: (side, process id) whose Python stacks
    `--py-spy` samples over the largest measured level."""
    biggest = max(args.concurrency)
    result["warmup_rounds"] = []
    for _ in range(args.warmup_rounds):
        w = await bench.run_level(send, biggest, biggest)
        result["warmup_rounds"].append({k: w[k] for k in ("concurrency", "errors", "wall_s",
                                                          "ttft_p50", "ttfa_p50")})
    for c in args.concurrency:
        name = f"c{c}"
        before = snapshot()
        spy = start_py_spy(args, *profiled) if profiled and c == biggest else None
        if spy is not None:
            await asyncio.sleep(0.5)  # (py-spy attaches first: the level's start is sampled)
        try:
            result[name] = await bench.run_level(send, c, c)
        finally:
            if spy is not None:
                result["py_spy"] = stop_py_spy(spy)
        result[name].update(since(before))
        rounds = [result[name]]
        for _ in range(args.repeats - 1):  # (the same level again: its spread on one start)
            before = snapshot()
            rounds.append(await bench.run_level(send, c, c))
            rounds[-1].update(since(before))
        if args.repeats > 1:
            result[name]["rounds"] = [{k: r.get(k) for k in ROUND_KEYS} for r in rounds]
            result[name]["median_of_rounds"] = median_numbers(rounds)


def median_numbers(rows: list[dict]) -> dict:
    """The median of each ROUND_KEYS number over the rows that have it."""
    return {k: statistics.median(vals) for k in ROUND_KEYS
            if (vals := [r[k] for r in rows if r.get(k) is not None])}


def start_py_spy(args, side: str, pid: int) -> tuple[subprocess.Popen, str] | None:
    """py-spy sampling process `pid` (every thread, 200 Hz, without pausing it), its stacks
    folded into `<--py-spy>_<side>.txt` when stopped; None without --py-spy."""
    if not args.py_spy:
        return None
    out = f"{args.py_spy}_{side}.txt"
    cmd = [args.py_spy_exe, "record", "--pid", str(pid), "--format", "raw", "--threads",
           "--nonblocking", "--rate", str(args.py_spy_rate), "--subprocesses", "--output", out,
           *(["--duration", str(args.py_spy_seconds)] if args.py_spy_seconds else []),
           *(["--gil"] if args.py_spy_gil else []), *(["--idle"] if args.py_spy_idle else [])]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True), out


def stop_py_spy(spy: tuple[subprocess.Popen, str]) -> dict:
    """Stop the sampler (SIGINT: it writes its file) and say where the stacks are."""
    proc, out = spy
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return {"stacks": out, "exit": proc.returncode, "stderr": (err or "")[-500:]}


def first_and_warm(result: dict, first: dict, warm: dict) -> None:
    """The first request after start against a warm one (same request)."""
    result["first_request"], result["warm_request"] = first, warm
    for key in ("ttft", "ttfa", "e2e"):
        if first.get(key) and warm.get(key):
            result[f"first_over_warm_{key}"] = round(first[key] / warm[key], 3)


def scrape_histograms(url: str) -> dict[str, tuple[float, float]]:
    """/metrics: every histogram as {name: (sum, count)}."""
    text = httpx.get(url + "/metrics", timeout=10.0).text
    out: dict[str, list[float]] = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            for suffix, i in (("_sum", 0), ("_count", 1)):
                if sample.name.endswith(suffix) and not sample.labels:
                    out.setdefault(sample.name.removesuffix(suffix), [0.0, 0.0])[i] = sample.value
    return {k: (v[0], v[1]) for k, v in out.items()}


def startup_phases(url: str) -> dict[str, float]:
    """The server's omnistage_startup_seconds gauge: seconds per start-up phase."""
    text = httpx.get(url + "/metrics", timeout=10.0).text
    return {sample.labels["phase"]: sample.value
            for fam in text_string_to_metric_families(text)
            if fam.name == "omnistage_startup_seconds" for sample in fam.samples}


def run_server_side(args) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "omnistage.entrypoints.cli", "serve", args.model,
           "--port", str(port), "--served-model-name", "bench", "--max-queue", "1024",
           *(["--device", args.device] if args.device else []), *args.server_arg]
    log = open(args.server_log, "w")  # noqa: SIM115 - closed below
    t0 = time.perf_counter()
    cpus = args.server_cpus
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=(
        (lambda: os.sched_setaffinity(0, cpus)) if cpus else None))  # noqa: PLW1509
    startup_spy = None
    if args.py_spy_startup:
        time.sleep(0.5)  # (py-spy finds no interpreter in a process still being exec'd)
        startup_spy = start_py_spy(args, "server_startup", proc.pid)
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
        result: dict = {"startup_to_health_s": round(time.perf_counter() - t0, 2),
                        "cpus": sorted(os.sched_getaffinity(proc.pid))}
        if startup_spy is not None:
            result["py_spy_startup"] = stop_py_spy(startup_spy)
        result["startup_phases"] = startup_phases(url)
        # (serve --engine-process: reported as a start-up phase of its own when on)
        result["engine_process"] = "engine_process" in result["startup_phases"]

        cfg = bench_config(args, url)

        def server_means(before: dict) -> dict:
            """The means of SERVER_MEANS since `before` (a scrape_histograms())."""
            now = scrape_histograms(url)
            out = {}
            for key, name in SERVER_MEANS.items():
                (s1, n1), (s0, n0) = now.get(name, (0, 0)), before.get(name, (0, 0))
                out[key] = round((s1 - s0) / (n1 - n0), 4) if n1 > n0 else None
            return out

        async def go() -> None:
            client = SSEClient(url)  # (bench.one_request's client: sse_client says why)

            def send(i: int):
                body = bench.chat_body(cfg, i)
                if args.no_stream:
                    return unstreamed_request(client, body, args.request_timeout)
                return bench.one_request(client, body, args.request_timeout)

            try:
                rows = []
                for _ in range(2):  # the first request after start, then the same one warm
                    before = scrape_histograms(url)
                    rows.append(await send(0))
                    rows[-1].update(server_means(before))  # (the server's side of it)
                first_and_warm(result, *rows)
                await warm_then_measure(send, args, result, lambda: scrape_histograms(url),
                                        server_means, profiled=("server", proc.pid))
            finally:
                await client.aclose()

        asyncio.run(go())
        return result
    finally:
        if startup_spy is not None and startup_spy[0].poll() is None:  # (it never got up)
            stop_py_spy(startup_spy)
        stop_server(proc, log)


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
        if args.engine_switch_interval_ms is not None:  # (once built, as the server sets its)
            sys.setswitchinterval(args.engine_switch_interval_ms / 1e3)
        result["switch_interval_ms"] = round(sys.getswitchinterval() * 1e3, 3)
        try:
            first = await engine_request(llm, args, 0)
            first_and_warm(result, first, await engine_request(llm, args, 0))
            rows: list[dict] = []

            async def send(i: int) -> dict:
                row = await engine_request(llm, args, i)
                rows.append(row)
                return row

            def runtime_means(_: None) -> dict:
                return {"runtime_ttft_mean": _mean([r.get("runtime_ttft") for r in rows]),
                        "runtime_ttfa_mean": _mean([r.get("runtime_ttfa") for r in rows])}

            await warm_then_measure(send, args, result, rows.clear, runtime_means,
                                    profiled=("engine", os.getpid()))
        finally:
            llm.shutdown()

    asyncio.run(go())
    return result


def _engine_side_child(args, conn) -> None:
    try:
        conn.send(("ok", run_engine_side(args)))
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        raise


def run_engine_side_apart(args) -> dict:
    """run_engine_side in a process of its own (spawned, not a daemon: the engine starts
    processes too), so its CUDA context and memory end with it and a server started next
    finds the GPU as the first one did."""
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_engine_side_child, args=(args, theirs))
    child.start()
    theirs.close()
    try:
        kind, value = ours.recv()
    except EOFError:
        kind, value = "error", "the engine side's process died"
    child.join()
    if kind != "ok":
        raise RuntimeError(f"engine side: {value}")
    return value


def level_numbers(side_result: dict, c: int) -> dict:
    """A side's numbers of level c: its median over rounds where there were several."""
    r = side_result[f"c{c}"]
    return r.get("median_of_rounds") or r


def ratios(top: dict, bottom: dict) -> dict:
    """top / bottom (server / engine, or B / A) for ROUND_KEYS, where both have the number."""
    return {k: round(top[k] / bottom[k], 3) for k in ROUND_KEYS
            if top.get(k) and bottom.get(k)}


def run_one_start(args, result: dict, load) -> None:
    """Each side started once: the server, then the engine in this process."""
    # the server first: its process has ended, memory and all, when the engine side loads here
    # (this process keeps its CUDA context and cached blocks after the engine's shutdown, and a
    # server started after it sized its KV caches from what was left)
    if args.side in ("both", "server"):
        result["server"] = run_server_side(args)
        write_result(result, args.out, load)  # (kept if the engine side does not finish)
    if args.side in ("both", "engine"):
        result["engine"] = run_engine_side(args)
    if args.side == "both":
        result["server_over_engine"] = {
            f"c{c}": ratios(level_numbers(result["server"], c), level_numbers(result["engine"], c))
            for c in args.concurrency}


def compile_caches_empty() -> bool:
    """Whether inductor's and Triton's caches (env.compile_cache_dirs, which the server and
    the engine side use) hold nothing yet: a start on them compiles every kernel."""
    from omnistage.config import env
    return not any(Path(d).is_dir() and any(Path(d).iterdir())
                   for d in env.compile_cache_dirs())


def measured(runs: list[dict]) -> list[dict]:
    """The starts a side's median is taken over: those that found the compile caches filled,
    where there are any (a machine's first start compiles every kernel, a cost paid once per
    machine, and only by whichever side starts first), else all."""
    return [r for r in runs if not r["compile_caches_empty"]] or runs


def run_starts(args, result: dict, load) -> None:
    """--starts N: each side started N times, alternating (server, engine, engine, server,
    ...), every start's result kept; the median over starts per side and level, the server
    over the engine from those medians, and each pair's own ratios (their spread). With
    --server-arg-b the two sides are the server's variants A ("server") and B ("server_b"),
    and the ratios B over A. A start on empty compile caches (`compile_caches_empty`) is kept
    but left out of the medians (measured()); its pair's ratios say so."""
    sides = ("server", "engine") if args.side == "both" else (args.side,)
    if args.server_arg_b:  # (an A/B of server arguments: "server_b" starts add them)
        sides = ("server", "server_b")
    result["starts"] = []
    for i in range(args.starts):
        for side in (sides if i % 2 == 0 else sides[::-1]):
            one, k = argparse.Namespace(**vars(args)), len(result["starts"])
            cold = compile_caches_empty()
            if args.py_spy:  # (each start's stacks a file of their own: PREFIX_start<k>_...)
                one.py_spy = f"{args.py_spy}_start{k}"
            if side == "engine":
                r = run_engine_side_apart(one)
            else:  # (each start's server log a file of its own)
                log = Path(args.server_log)
                one.server_log = str(log.with_name(f"{log.stem}_start{k}{log.suffix}"))
                if side == "server_b":
                    one.server_arg = [*args.server_arg, *args.server_arg_b]
                r = {**run_server_side(one), "server_args": one.server_arg,
                     "server_log": one.server_log}
            result["starts"].append({"side": side, "compile_caches_empty": cold, **r})
            write_result(result, args.out, load)  # (kept if a later start does not finish)
    runs = {side: [r for r in result["starts"] if r["side"] == side] for side in sides}
    medians = {side: {f"c{c}": median_numbers([level_numbers(r, c)
                                               for r in measured(runs[side])])
                      for c in args.concurrency} for side in sides}
    result["median_of_starts"] = medians

    def compare(name: str, top: str, bottom: str) -> None:  # top / bottom, overall and per pair
        result[name] = {f"c{c}": ratios(medians[top][f"c{c}"], medians[bottom][f"c{c}"])
                        for c in args.concurrency}
        result[f"{name}_per_pair"] = [
            {**{f"c{c}": ratios(level_numbers(t, c), level_numbers(b, c))
                for c in args.concurrency},
             "compile_caches_empty": t["compile_caches_empty"] or b["compile_caches_empty"]}
            for t, b in zip(runs[top], runs[bottom], strict=True)]

    if args.side == "both":
        compare("server_over_engine", "server", "engine")
    if args.server_arg_b:
        compare("b_over_a", "server_b", "server")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-qwen2.5-omni", help="checkpoint or embedded name")
    ap.add_argument("--device", default=None)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--codes", type=int, default=1024)
    ap.add_argument("--warmup-rounds", type=int, default=1,
                    help="rounds at the largest concurrency before measuring, on both sides")
    ap.add_argument("--side", choices=["both", "server", "engine"], default="both")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra `omnistage serve` argument (repeatable, e.g. --server-arg=--x)")
    ap.add_argument("--server-log", default="/tmp/omnistage_serving_bench.log")
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--repeats", type=int, default=1,
                    help="measure each level this many times in a row (their median too)")
    ap.add_argument("--starts", type=int, default=1,
                    help="start each side this many times, alternating (the median over "
                    "starts, and each pair's ratios)")
    ap.add_argument("--server-arg-b", action="append", default=[], metavar="ARG",
                    help="an A/B of server arguments (with --side server and --starts N): the "
                    "starts alternate A (--server-arg only) and B (these too), A, B, B, A, ...; "
                    "each one's median over its starts, and B over A (e.g. "
                    "--server-arg-b=--switch-interval-ms=5)")
    ap.add_argument("--engine-switch-interval-ms", type=float, default=None, metavar="MS",
                    help="the engine side's GIL switch interval once it is built (default: "
                    "Python's, which AsyncOmniLLM keeps; the server sets its own, "
                    "--switch-interval-ms): how much of a gap the interval is")
    ap.add_argument("--no-stream", action="store_true",
                    help="the server side's requests not streamed (an A/B of the SSE path's "
                    "cost: the runtime's TTFT / TTFA still come from /metrics)")
    ap.add_argument("--server-cpus", default=None, metavar="LIST",
                    help="the server's process on these CPUs only (e.g. 0-7)")
    ap.add_argument("--client-cpus", default=None, metavar="LIST",
                    help="this process (the load generator, and the engine side) on these "
                    "CPUs only (e.g. 8-15: a client on CPUs of its own, as on another machine)")
    ap.add_argument("--py-spy", default=None, metavar="PREFIX",
                    help="sample each side's process with py-spy over the largest measured "
                    "level: folded stacks per thread in PREFIX_server.txt / PREFIX_engine.txt")
    ap.add_argument("--py-spy-exe", default="py-spy", help="the py-spy executable")
    ap.add_argument("--py-spy-rate", type=int, default=200, help="py-spy samples per second")
    ap.add_argument("--py-spy-seconds", type=int, default=None,
                    help="sample only the level's first seconds (default: all of it)")
    ap.add_argument("--py-spy-gil", action="store_true",
                    help="sample only the thread holding the GIL (who keeps the others waiting)")
    ap.add_argument("--py-spy-idle", action="store_true",
                    help="keep the samples of threads that wait (GPU syncs, locks, the GIL, "
                    "futures): where a thread's time went, not only its CPU")
    ap.add_argument("--py-spy-startup", action="store_true",
                    help="with --py-spy: sample the server's start too, until /health "
                    "(PREFIX_server_startup.txt)")
    args = ap.parse_args()
    if args.py_spy_startup and not args.py_spy:
        ap.error("--py-spy-startup: needs --py-spy PREFIX (where the stacks go)")
    if args.server_arg_b and (args.side != "server" or args.starts < 2):
        ap.error("--server-arg-b: needs --side server and --starts 2 or more (an A/B of starts)")
    if args.py_spy and shutil.which(args.py_spy_exe) is None:
        ap.error(f"--py-spy-exe: {args.py_spy_exe!r} is not an executable on PATH")
    try:
        args.server_cpus = sorted(cpu_list(args.server_cpus)) if args.server_cpus else None
        client_cpus = cpu_list(args.client_cpus) if args.client_cpus else None
    except ValueError as e:
        ap.error(f"--server-cpus / --client-cpus: {e}")
    if client_cpus:
        os.sched_setaffinity(0, client_cpus)  # (threads started from now on inherit it)
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    if not args.concurrency or min(args.concurrency) < 1 or args.warmup_rounds < 0:
        ap.error("--concurrency: positive integers like 1,32; --warmup-rounds: >= 0")
    if not 1 <= args.repeats <= 100:
        ap.error(f"--repeats: 1..100, got {args.repeats}")
    if not 1 <= args.starts <= 20:
        ap.error(f"--starts: 1..20, got {args.starts}")
    low, high = SWITCH_INTERVAL_MS  # (the server's bounds)
    if args.engine_switch_interval_ms is not None and \
            not low <= args.engine_switch_interval_ms <= high:
        ap.error(f"--engine-switch-interval-ms: {low}..{high}, got "
                 f"{args.engine_switch_interval_ms}")
    load = os.getloadavg()
    result: dict = {"config": {k: v for k, v in vars(args).items() if k != "out"},
                    "client_cpus": sorted(os.sched_getaffinity(0))}
    (run_starts if args.starts > 1 else run_one_start)(args, result, load)
    write_result(result, args.out, load)
    if args.side != "engine":
        print(f"server log: {args.server_log}" if args.starts == 1 else
              f"server logs: {args.server_log} with _start<k> before its suffix")


if __name__ == "__main__":
    main()
