"""The AR engine's sampler head (SamplerState.sample_rows) on the GPU: the torch reference
(fast=False, what EngineConfig(fast_sampler=False) selects) vs the Triton kernels (sampler_triton),
each captured in a CUDA graph as cuda_graphs._head does it.

Cases (one JSON; each fails alone, recording its error):
  talker          V=8448, temperature 0.9, top_k 40, top_p 0.8, repetition_penalty 1.05,
                  suppressed ids, min_tokens stop bans; B = 1, 8, 32
  greedy          V=152064 argmax; B = 1, 8, 32
  thinker         V=152064, temperature 0.7, top_p 0.9, top_k 0; peaked logits (a few strong
                  tokens, as an LM's) and flat ones (the kept set runs to thousands); B = 1, 8
Per case: graph replay ms (CUDA events, median of --reps) for both paths, speedup, and the
fraction of draws that agree over --trials steps x B rows (sampling: differing only at ulp-level
near ties). Run from the repo root:
    PYTHONPATH=$PWD python benchmarks/sampler_gpu.py --out $OUT/sampler.json
`--device cpu --tiny` runs the same code on the CPU (small vocabularies, kernels interpreted,
no graphs): a smoke test of this script, not a measurement.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import os
import sys
import time
import traceback
import types
from pathlib import Path

import torch

try:
    import soundfile  # noqa: F401
except ImportError:  # the GPU machine lacks it; nothing here reads audio files
    sys.modules["soundfile"] = types.ModuleType("soundfile")
    sys.modules["soundfile"].__spec__ = importlib.machinery.ModuleSpec("soundfile", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # omnistage and benchmarks.*

TALKER = dict(temperature=0.9, top_k=40, top_p=0.8, min_p=0.0, repetition_penalty=1.05)
GREEDY = dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0)
THINKER = dict(temperature=0.7, top_k=0, top_p=0.9, min_p=0.0, repetition_penalty=1.0)


def cases(tiny: bool) -> list[dict]:
    vt, vb = (512, 3000) if tiny else (8448, 152064)
    out = [dict(name=f"talker_V{vt}_B{b}", V=vt, B=b, p=TALKER, bans=True, logits="talker")
           for b in ((1, 3) if tiny else (1, 8, 32))]
    out += [dict(name=f"greedy_V{vb}_B{b}", V=vb, B=b, p=GREEDY, bans=False, logits="peaked")
            for b in ((1, 3) if tiny else (1, 8, 32))]
    out += [dict(name=f"thinker_{kind}_V{vb}_B{b}", V=vb, B=b, p=THINKER, bans=False,
                 logits=kind) for kind in ("peaked", "flat") for b in ((1, 2) if tiny else (1, 8))]
    return out


def make_state(case: dict, device: torch.device, seed: int):
    """A SamplerState with B slots as the engine fills them (params, prompt ids, outputs)."""
    from omnistage.engine.ar.sampler import SEEN, STOP, SUPPRESS, SamplerState, SamplingFlags
    V, B, p = case["V"], case["B"], case["p"]
    g = torch.Generator().manual_seed(seed)
    st = SamplerState(B, V, device)
    st.fparams[:B] = torch.tensor([p["temperature"], p["top_p"], p["min_p"],
                                   p["repetition_penalty"], 0.0, 0.0])
    st.iparams[:B, 0] = p["top_k"]
    st.iparams[:B, 1] = torch.randint(0, 2**63 - 1, (B,), generator=g)
    bits = torch.zeros(B, V, dtype=torch.uint8)
    bits.scatter_(1, torch.randint(0, V, (B, 300), generator=g), SEEN)  # prompt ids
    if case["bans"]:  # the talker's suppressed ids, and stop ids banned until min_tokens
        st.iparams[:B, 2] = 1 << 20
        bits[:, V - 8:V - 2] |= SUPPRESS
        bits[:, V - 2:] |= STOP
    st.bits[:B] = bits.to(device)
    counts = torch.zeros(B, V).scatter_add_(1, torch.randint(0, V, (B, 60), generator=g),
                                            torch.ones(B, 60))
    st.counts[:B] = counts.to(device)
    flags = SamplingFlags(all_greedy=p["temperature"] == 0, any_top_k=p["top_k"] > 0,
                          any_top_p=p["top_p"] < 1 and p["temperature"] > 0,
                          any_min_p=p["min_p"] > 0,
                          penalties=p["repetition_penalty"] != 1, banned=case["bans"])
    return st, flags


def make_logits(case: dict, device: torch.device, g: torch.Generator) -> torch.Tensor:
    B, V, kind = case["B"], case["V"], case["logits"]
    x = torch.randn(B, V, generator=g) * {"flat": 3.0, "talker": 2.0, "peaked": 1.0}[kind]
    if kind == "peaked":  # an LM's peak: a few tokens well above the rest
        top = torch.randint(0, V, (B, 8), generator=g)
        x.scatter_(1, top, 12.0 + 2.0 * torch.randn(B, 8, generator=g))
    return x.to(device)


def time_path(case: dict, device: torch.device, fast: bool, reps: int) -> float:
    """Median ms of one sample_rows (update on, as the engine runs it)."""
    st, flags = make_state(case, device, seed=1)
    B = case["B"]
    logits = make_logits(case, device, torch.Generator().manual_seed(2))
    slots = torch.arange(B, device=device)
    steps = torch.full((B,), 5, dtype=torch.long, device=device)

    def fn():
        return st.sample_rows(logits, slots, steps, None, flags, update=True, fast=fast)

    if device.type != "cuda":
        fn()
        t = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            t.append(1e3 * (time.perf_counter() - t0))
        return round(sorted(t)[len(t) // 2], 4)
    s = torch.cuda.Stream(device)
    s.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(s):  # warm-up (Triton compiles) as DecodeGraphs.capture_graph does
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(20):
        g.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return round(sorted(times)[len(times) // 2], 4)


def match(case: dict, device: torch.device, trials: int) -> dict:
    """Draws of both paths on the same state and logits over `trials` steps."""
    st, flags = make_state(case, device, seed=3)
    B, g = case["B"], torch.Generator().manual_seed(4)
    slots = torch.arange(B, device=device)
    same = total = 0
    kept = []
    for step in range(trials):
        logits = make_logits(case, device, g)
        steps = torch.full((B,), step, dtype=torch.long, device=device)
        ref = st.sample_rows(logits, slots, steps, None, flags, update=False, fast=False)
        got = st.sample_rows(logits, slots, steps, None, flags, update=False, fast=True)
        same += int((ref == got).sum())
        total += B
        if step == 0 and not flags.all_greedy:  # the size of the kept set, for context
            from omnistage.engine.ar.sampler import apply_penalties, apply_warpers
            t = st.tensors(slots, steps, flags)
            w = apply_warpers(apply_penalties(logits, t), t)
            kept = torch.isfinite(w).sum(-1).tolist()
    return {"match_fraction": round(same / total, 5), "draws": total, "kept_tokens": kept}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small vocabularies (CPU smoke test)")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type != "cuda":  # before triton is imported: kernels in its interpreter
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.reps, args.trials = min(args.reps, 3), min(args.trials, 3)
    from benchmarks.common import write_result
    load = os.getloadavg()
    result: dict = {"config": {"device": str(device), "tiny": args.tiny, "reps": args.reps,
                               "trials": args.trials}, "cases": {}}
    try:
        import triton
        result["config"].update(torch=torch.__version__, triton=triton.__version__,
                                gpu=torch.cuda.get_device_name(device)
                                if device.type == "cuda" else None)
    except Exception as exc:  # noqa: BLE001 - recorded; the cases report their own errors
        result["config"]["env_error"] = repr(exc)
    for case in cases(args.tiny):
        row: dict = {"V": case["V"], "B": case["B"], "params": case["p"],
                     "logits": case["logits"]}
        for key, fn, extra in (("ref_ms", time_path, (False, args.reps)),
                               ("fast_ms", time_path, (True, args.reps)),
                               ("match", match, (args.trials,))):
            try:
                row[key] = fn(case, device, *extra)
            except Exception as exc:  # noqa: BLE001 - one failing part must not lose the rest
                row[key + "_error"] = "".join(traceback.format_exception_only(exc)).strip()
                row.setdefault("traceback", traceback.format_exc()[-2000:])
        if "ref_ms" in row and "fast_ms" in row and row["fast_ms"] > 0:
            row["speedup"] = round(row["ref_ms"] / row["fast_ms"], 2)
        result["cases"][case["name"]] = row
        if device.type == "cuda":
            torch.cuda.empty_cache()
    write_result(result, args.out, load)


if __name__ == "__main__":
    main()
