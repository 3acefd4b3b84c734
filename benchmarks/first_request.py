"""The first requests after start against warm ones, engine side, as the server starts:
AsyncOmniLLM, its warm-up request (OmniBase.warmup, which `omnistage serve` runs before /health
answers), then the serving benchmark's request three times, then two other prompt lengths twice
each. Per request: TTFT, TTFA, e2e and the runtime's own TTFT / TTFA, with what ran for it that
a warm request would not run: Triton JIT compiles (kernel and specialisation key), CUDA graph
captures and dynamo compiles. Any of them on a request after the warm-up is a stall a user's
first request pays for.

    python -m benchmarks.first_request --model /path/to/ckpt --device cuda \\
        --out benchmarks/results/first_request_h200.json
    python -m benchmarks.first_request   # the embedded tiny model on CPU (a smoke test)"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections import Counter

import torch

from benchmarks.common import write_result

# the serving benchmark's prompt first (three times), then a short and a long one (twice each)
OTHER_PROMPTS = ("Hi.", "Explain in detail how a lighthouse lens focuses light, and why the "
                 "keeper must clean it every single evening.")


class EventLog:
    """Triton JIT compiles, CUDA graph captures, each tagged with the phase it happened in."""

    def __init__(self) -> None:
        self.phase = "load"
        self.events: list[dict] = []

    def install(self) -> None:
        try:
            import triton.runtime.jit as jit
        except ImportError:  # (no Triton: nothing JIT-compiles)
            jit = None
        if jit is not None and hasattr(jit.JITFunction, "_do_compile"):
            compile_once = jit.JITFunction._do_compile
            log = self

            def logged(fn, key, *args, **kwargs):
                t0 = time.perf_counter()
                out = compile_once(fn, key, *args, **kwargs)
                log.events.append({"phase": log.phase, "kind": "triton_compile",
                                   "kernel": getattr(fn.fn, "__qualname__", str(fn.fn)),
                                   "key": str(key)[:400],
                                   "seconds": round(time.perf_counter() - t0, 4)})
                return out
            jit.JITFunction._do_compile = logged
        if torch.cuda.is_available():
            begin = torch.cuda.CUDAGraph.capture_begin

            def counted(graph, *args, **kwargs):
                self.events.append({"phase": self.phase, "kind": "graph_capture"})
                return begin(graph, *args, **kwargs)
            torch.cuda.CUDAGraph.capture_begin = counted

    def counts(self, phase: str) -> dict[str, int]:
        return dict(Counter(e["kind"] for e in self.events if e["phase"] == phase))


def dynamo_counters() -> dict[str, int]:
    from torch._dynamo.utils import counters
    return {f"{group}.{name}": n for group, c in counters.items() for name, n in c.items()}


async def run(args) -> dict:
    from benchmarks.serving import engine_request
    from omnistage import AsyncOmniLLM
    from omnistage.entrypoints import bench
    from omnistage.entrypoints.cli import EMBEDDED_MODELS
    log = EventLog()
    log.install()
    model = args.model
    if model in EMBEDDED_MODELS:
        model = str(EMBEDDED_MODELS[model][1]())
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    t0 = time.perf_counter()
    llm = AsyncOmniLLM(model=model, device=args.device)
    result: dict = {"config": vars(args), "load_s": round(time.perf_counter() - t0, 2),
                    "load_events": log.counts("load")}
    log.phase = "warmup"
    result["warmup_s"] = llm.warmup()
    result["warmup_events"] = log.counts("warmup")
    before = dynamo_counters()
    default_prompt = bench.DEFAULT_PROMPT
    plan = [(f"same_{i}", default_prompt) for i in range(3)]
    for i, prompt in enumerate(OTHER_PROMPTS):
        plan += [(f"other_{i}", prompt), (f"other_{i}_again", prompt)]
    try:
        for phase, prompt in plan:
            log.phase = phase
            bench.DEFAULT_PROMPT = prompt  # (engine_request sends bench's prompt)
            sync()
            row = await engine_request(llm, args, 0)
            sync()
            now = dynamo_counters()
            row["dynamo"] = {k: n - before.get(k, 0) for k, n in now.items()
                             if n != before.get(k, 0)}
            before = now
            row["events"] = log.counts(phase)
            result[phase] = row
    finally:
        bench.DEFAULT_PROMPT = default_prompt
        llm.shutdown()
    warm = result["same_2"]
    for key in ("ttft", "ttfa"):
        if result["same_0"].get(key) and warm.get(key):
            result[f"first_over_warm_{key}"] = round(result["same_0"][key] / warm[key], 3)
    result["events_after_load"] = [e for e in log.events if e["phase"] not in ("load",)]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-qwen2.5-omni", help="checkpoint or embedded name")
    ap.add_argument("--device", default=None)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--codes", type=int, default=1024)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.max_tokens < 1 or args.codes < 1:
        ap.error("--max-tokens and --codes: positive integers")
    load = os.getloadavg()
    write_result(asyncio.run(run(args)), args.out, load)


if __name__ == "__main__":
    main()
