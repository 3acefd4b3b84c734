"""Decode-step cost of the AR engine at Qwen2.5-Omni-7B shapes (random bf16 weights, CUDA
graphs): thinker greedy ms/token and talker ms/code at batch 1/8/32 (--batches), with the
talker's sampling params (temperature 0.9, top_k 40, top_p 0.8, repetition penalty 1.05,
suppressed codec bos, min_tokens holding back the stop codes), the device-state sampler
inside the graphs (case keys end in "_device"). Per case: step_ms (whole engine step, wall
clock, with async scheduling: each step launched before the previous one's tokens are read),
step_ms_sync (the same without async scheduling), run_ms (CUDA events around the graph runner,
synchronized: input fill + replays), replay_ms (the step's graphs replayed back to back, GPU
only) and the first tokens. --prefill: a batch-1 prefill of the 60-token prompt per model
(wall ms, GPU kernel ms, host profile on stderr).
Prints one JSON object; a failing case records its error and the others still run.

    python benchmarks/profile_decode.py [--steps 100] [--profile] [--tiny]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import sys
import time
import traceback
from pathlib import Path

import importlib.machinery
import types

import torch

try:
    import soundfile  # noqa: F401
except ImportError:  # the GPU machine lacks it; nothing here reads audio files
    sys.modules["soundfile"] = types.ModuleType("soundfile")
    sys.modules["soundfile"].__spec__ = importlib.machinery.ModuleSpec("soundfile", None)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from omnistage.engine.ar.engine import AREngine  # noqa: E402
from omnistage.engine.ar.scheduler import EngineConfig  # noqa: E402
from omnistage.engine.ar.sequence import Sequence  # noqa: E402
from omnistage.models.qwen2_5_omni.talker import Qwen2_5OmniTalkerForCausalLM  # noqa: E402
from omnistage.models.qwen2_5_omni.thinker import Qwen2_5OmniThinkerForCausalLM  # noqa: E402
from benchmarks.hf_omni_gpu import build, omni_config  # noqa: E402  (the same 7B shapes)
from benchmarks.qwen2_5_omni_gpu import sync, talker_seqs  # noqa: E402
from benchmarks.qwen2_5_omni_gpu import thinker_seqs as prompt_seqs  # noqa: E402

WARM = 4  # tokens per sequence before timing (prefill, graph captures)
RUN_STEPS = 20  # steps with the synchronized timer around each graph run
KERNEL_PROFILE = False  # --kernels: kernel times inside the step's graphs
PREFILL = False  # --prefill: also a batch-1 prefill of the prompt per model


def thinker_seqs(vocab: int, B: int, n: int, tag: str) -> list[Sequence]:
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(20, min(vocab, 100000) - 1, (60,), generator=g).tolist()
    return prompt_seqs(prompt, n, B, tag)


def measure(engine: AREngine, seqs: list[Sequence], steps: int, dev) -> dict:
    for s in seqs:
        engine.add_request(s)
    while min(len(s.output_token_ids) for s in seqs) < WARM:
        engine.step()
    graphs = engine.runner.graphs
    res = {}
    for key, ahead in (("step_ms", True), ("step_ms_sync", False)):
        engine.async_scheduling = ahead
        sync(dev)
        t0, n0 = time.perf_counter(), engine.num_ahead_steps
        for _ in range(steps):
            engine.step()
        sync(dev)
        res[key] = round(1e3 * (time.perf_counter() - t0) / steps, 3)
        if ahead:
            res["ahead_steps"] = engine.num_ahead_steps - n0
    engine.async_scheduling = True
    res["tokens"] = list(seqs[0].output_token_ids[:32])
    run_ms, keys = [], []
    if graphs is not None and dev.type == "cuda":  # CUDA events around the graph runner
        real_run = graphs.run

        def timed_run(seqs_, e_rows, a_rows, sampling=None, logits=False, ahead=0):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = real_run(seqs_, e_rows, a_rows, sampling, logits, ahead)
            end.record()
            end.synchronize()
            run_ms.append(start.elapsed_time(end))
            B = graphs.padded_size(len(seqs_))
            keys.append(((B, any(e is not None for e in e_rows),
                          any(a is not None for a in a_rows)),
                         (B, sampling.flags if sampling is not None else None)))
            return out
        graphs.run = timed_run
        for _ in range(RUN_STEPS):
            engine.step()
        graphs.run = real_run
        res["run_ms"] = round(sum(run_ms) / max(1, len(run_ms)), 3)
        res["graph_steps"] = len(run_ms)
        if keys:  # the last step's graphs again, GPU time only (K/V rewrites are identical)
            fwd, head = graphs.graphs[keys[-1][0]], graphs.heads.get(keys[-1][1])
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                fwd.graph.replay()
                if head is not None:
                    head.graph.replay()
            end.record()
            end.synchronize()
            res["replay_ms"] = round(start.elapsed_time(end) / 20, 3)
            if KERNEL_PROFILE:
                res["kernels"] = kernel_profile(fwd, head)
    for s in seqs:
        engine.abort(s.request_id)
    return res


def kernel_profile(fwd, head, reps: int = 10) -> dict:
    """The step's graphs replayed under the profiler: GPU time of the kernels inside them (sum and
    top kernels per step) against the replay's span, whose difference is launch gaps/ramps."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fwd.graph.replay()
            if head is not None:
                head.graph.replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not kernels:
        return {"error": "no kernels recorded inside the graphs"}
    span = (max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels))
    by_name: dict = {}
    for e in kernels:
        n, us = by_name.get(e.name, (0, 0.0))
        by_name[e.name] = (n + 1, us + e.time_range.elapsed_us())
    busy = sum(us for _, us in by_name.values())
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:14]
    return {"kernels_per_step": round(len(kernels) / reps, 1),
            "kernel_us_per_step": round(busy / reps, 1), "span_us_per_step": round(span / reps, 1),
            "top": [(name[:70], round(n / reps, 1), round(us / reps, 1)) for name, (n, us) in top]}


def prefill_case(engine: AREngine, make, dev, reps: int = 5) -> dict:
    """A batch-1 prefill of the 60-token prompt (one engine step, first token sampled): wall
    ms, GPU kernel time inside it and the top host functions (profiler), medians over reps."""
    from torch.profiler import ProfilerActivity, profile
    walls, busy, count = [], [], []
    for i in range(reps + 1):  # the first one warms up
        seqs = make(1, f"prefill{i}")
        for s in seqs:
            engine.add_request(s)
        sync(dev)
        t0 = time.perf_counter()
        engine.step()
        sync(dev)
        walls.append(1e3 * (time.perf_counter() - t0))
        for s in seqs:
            engine.abort(s.request_id)
    seqs = make(1, "prefill_prof")
    for s in seqs:
        engine.add_request(s)
    sync(dev)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=acts) as prof:
        engine.step()
        sync(dev)
    for s in seqs:
        engine.abort(s.request_id)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy.append(sum(e.time_range.elapsed_us() for e in kernels) / 1e3)
    count.append(len(kernels))
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    print(table[-4000:], file=sys.stderr)
    walls = sorted(walls[1:])
    return {"wall_ms": round(walls[len(walls) // 2], 2), "wall_ms_min": round(walls[0], 2),
            "gpu_kernel_ms": round(busy[0], 2), "kernels": count[0]}


def section(res: dict, name: str, engine: AREngine, make, batches, steps: int, dev) -> None:
    if PREFILL:
        try:
            res[f"{name}_prefill_b1"] = prefill_case(engine, make, dev)
        except Exception as e:  # noqa: BLE001 - the decode cases still run
            res[f"{name}_prefill_b1"] = {"error": f"{type(e).__name__}: {e}"}
            traceback.print_exc(file=sys.stderr)
    for B in batches:
        key = f"{name}_b{B}_device"
        try:
            res[key] = measure(engine, make(B, key), steps, dev)
        except Exception as e:  # noqa: BLE001 - one failing case must not lose the others
            res[key] = {"error": f"{type(e).__name__}: {e}"}
            traceback.print_exc(file=sys.stderr)


def run_thinker(res: dict, args, cfg: dict, n: int, dev, dtype) -> None:
    try:
        thinker = build(Qwen2_5OmniThinkerForCausalLM, cfg["thinker_config"], dev, dtype)
        eng = AREngine(thinker, EngineConfig(max_model_len=1024, max_num_seqs=max(args.batches),
                                             num_kv_blocks=2048), dev, dtype)
        vocab = thinker.vocab_size
        section(res, "thinker", eng, lambda B, tag: thinker_seqs(vocab, B, n, tag), args.batches,
                args.steps, dev)
        if args.profile:
            seqs = thinker_seqs(vocab, 1, 10 ** 4, "prof")
            for s in seqs:
                eng.add_request(s)
            for _ in range(WARM):
                eng.step()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.steps):
                eng.step()
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
            print(out.getvalue()[-6000:], file=sys.stderr)
            eng.abort(seqs[0].request_id)
        del eng, thinker
    except Exception as e:  # noqa: BLE001
        res["thinker_error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc(file=sys.stderr)


def run_talker(res: dict, args, cfg: dict, n: int, dev, dtype) -> None:
    try:
        talker = build(Qwen2_5OmniTalkerForCausalLM, cfg["talker_config"], dev, dtype)
        eng = AREngine(talker, EngineConfig(max_model_len=1024, max_num_seqs=max(args.batches),
                                            num_kv_blocks=4096), dev, dtype)
        section(res, "talker", eng, lambda B, tag: talker_seqs(talker, 60, n, B, tag, dev, dtype),
                args.batches, args.steps, dev)
    except Exception as e:  # noqa: BLE001
        res["talker_error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc(file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--tiny", action="store_true", help="tiny config (CPU smoke test)")
    ap.add_argument("--profile", action="store_true", help="cProfile of thinker batch-1 steps")
    ap.add_argument("--kernels", action="store_true",
                    help="kernel times inside the step's graphs (profiler), per case")
    ap.add_argument("--only", choices=("thinker", "talker"), default=None)
    ap.add_argument("--prefill", action="store_true",
                    help="also time a batch-1 prefill of the 60-token prompt (and profile it)")
    ap.add_argument("--batches", default="1,8,32", help="decode batch sizes, comma-separated")
    args = ap.parse_args()
    try:
        args.batches = tuple(int(b) for b in args.batches.split(","))
    except ValueError:
        raise SystemExit(f"--batches: comma-separated ints, got {args.batches!r}") from None
    if not args.batches or min(args.batches) < 1:
        raise SystemExit(f"--batches: sizes >= 1, got {args.batches}")
    global KERNEL_PROFILE, PREFILL
    KERNEL_PROFILE, PREFILL = args.kernels, args.prefill
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = omni_config(args.tiny)
    res: dict = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                 "steps": args.steps}
    n = WARM + 2 * args.steps + RUN_STEPS + 8  # min_tokens = max_tokens: never stops here
    if args.only != "talker":
        run_thinker(res, args, cfg, n, dev, dtype)
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if args.only != "thinker":
        run_talker(res, args, cfg, n, dev, dtype)
    for v in res.values():  # keep the JSON short: tokens only served the comparison
        if isinstance(v, dict):
            v.pop("tokens", None)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
