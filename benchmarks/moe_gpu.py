"""Fused MoE experts (omnistage/layers/moe.py, moe_triton.py) at Qwen3-Omni thinker shapes.

calls: E 128 experts, top-8, D 2048, F 768, random bf16 weights and routing (softmax top-k of
  random logits, renormalised), T = 1, 8, 32, 64, 256, 2048 tokens: the torch path (per-expert
  loop, bf16), the Triton path in bf16 and with weight-only FP8 (e4m3, per-channel scales).
  Per call: ms eager (CUDA events around --reps back-to-back calls, launch overhead included)
  and, for the Triton paths, ms replayed in a CUDA graph; GB/s of expert weights read (the
  distinct experts hit, once each); error vs an fp32 torch reference on the same bf16 weights
  (max abs and relative Frobenius), and for FP8 vs the dequantised weights too.
linear: Fp8Linear (Triton W8A16 GEMM) vs a bf16 F.linear (cuBLAS) at Qwen3-Omni thinker shapes
  (q/k/v, o_proj) and Qwen2.5-Omni's thinker MLP, M = 1, 8, 64, 512 rows: ms (graph) and the
  error of each vs an fp32 linear on the bf16 weights.
sweep (--sweep): alternative MoEConfigs per T (bf16 and FP8, graph-timed), the fastest vs
  the table's; --apply-sweep puts the winners into moe_triton.CONFIGS before "calls" runs.
Prints one JSON object; each case records its error and the others still run. Repo root:
    PYTHONPATH=$PWD python benchmarks/moe_gpu.py --out $OUT/moe.json [--sweep]
`--device cpu --tiny` runs the same code on the CPU (tiny shapes, kernels interpreted, fp32,
no graphs): a smoke test of this script, not a measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import traceback
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # omnistage and benchmarks.*

REAL = {"experts": 128, "top_k": 8, "hidden": 2048, "inter": 768,
        "tokens": (1, 8, 32, 64, 256, 2048)}
TINY = {"experts": 16, "top_k": 4, "hidden": 64, "inter": 32, "tokens": (1, 8, 40)}


def _err(e: BaseException) -> dict:
    return {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-1500:]}


class Timer:
    """ms per call of fn: eager (events around `reps` calls) or replayed from a CUDA graph.
    Off CUDA: one eager wall-clock call (smoke test only)."""

    def __init__(self, device: torch.device, reps: int) -> None:
        self.device, self.reps = device, reps

    def _events(self, run) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(self.reps):
            run()
        end.record()
        end.synchronize()
        return round(start.elapsed_time(end) / self.reps, 4)

    def eager(self, fn) -> float:
        fn()
        if self.device.type != "cuda":
            t = time.perf_counter()
            fn()
            return round(1e3 * (time.perf_counter() - t), 3)
        torch.cuda.synchronize()
        return self._events(fn)

    def graph(self, fn) -> float | None:
        if self.device.type != "cuda":
            return None
        fn()  # warm-up: compiles, allocates outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        for _ in range(3):
            graph.replay()
        return self._events(graph.replay)


@dataclasses.dataclass
class Case:
    x: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor
    experts_hit: int


def make_weights(shape: dict, device: torch.device, dtype: torch.dtype) -> dict:
    from omnistage.layers.fp8 import quantize_fp8
    e, d, f = shape["experts"], shape["hidden"], shape["inter"]
    gen = torch.Generator(device=device).manual_seed(0)
    w13 = (torch.randn(e, 2 * f, d, generator=gen, device=device) * d ** -0.5).to(dtype)
    w2 = (torch.randn(e, d, f, generator=gen, device=device) * f ** -0.5).to(dtype)
    q13, s13 = quantize_fp8(w13)
    q2, s2 = quantize_fp8(w2)
    return {"w13": w13, "w2": w2, "q13": q13, "q2": q2, "scales": (s13, s2)}


def make_case(shape: dict, tokens: int, device: torch.device, dtype: torch.dtype) -> Case:
    from omnistage.layers.moe import select_experts
    gen = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(tokens, shape["hidden"], generator=gen, device=device).to(dtype)
    logits = torch.randn(tokens, shape["experts"], generator=gen, device=device).to(dtype)
    weights, ids = select_experts(logits, shape["top_k"], norm_topk_prob=True)
    return Case(x, weights, ids, int(ids.unique().numel()))


def _errors(out: torch.Tensor, ref: torch.Tensor) -> dict:
    diff = out.float() - ref
    return {"max_abs": float(diff.abs().max()), "rel": float(diff.norm() / ref.norm())}


def calls_section(timer: Timer, shape: dict, device: torch.device, dtype: torch.dtype,
                  w: dict) -> list[dict]:
    from omnistage.layers.fp8 import dequantize_fp8
    from omnistage.layers.moe import fused_experts
    w13_32, w2_32 = w["w13"].float(), w["w2"].float()
    d13 = dequantize_fp8(w["q13"], w["scales"][0], torch.float32)
    d2 = dequantize_fp8(w["q2"], w["scales"][1], torch.float32)
    rows = []
    for tokens in shape["tokens"]:
        row: dict = {"tokens": tokens}
        try:
            c = make_case(shape, tokens, device, dtype)
            row["experts_hit"] = c.experts_hit
            x32, wt32 = c.x.float(), c.weights.float()
            ref = fused_experts(x32, w13_32, w2_32, wt32, c.ids, backend="torch")
            ref8 = fused_experts(x32, d13, d2, wt32, c.ids, backend="torch")
            per_expert = 3 * shape["hidden"] * shape["inter"]
            gb = {"bf16": c.experts_hit * per_expert * w["w13"].element_size() / 1e9,
                  "fp8": c.experts_hit * per_expert / 1e9}
            args = (c.x, w["w13"], w["w2"], c.weights, c.ids)
            fp8_args = (c.x, w["q13"], w["q2"], c.weights, c.ids)
            paths = {  # name -> (call, weight kind)
                "torch": (partial(fused_experts, *args, backend="torch"), "bf16"),
                "triton": (partial(fused_experts, *args, backend="triton"), "bf16"),
                "triton_fp8": (partial(fused_experts, *fp8_args, backend="triton",
                                       scales=w["scales"]), "fp8"),
            }
            for name, (fn, kind) in paths.items():
                try:
                    out = fn()
                    entry = {"ms_eager": timer.eager(fn), **_errors(out, ref)}
                    if name != "torch":
                        entry["ms_graph"] = timer.graph(fn)
                    if name == "triton_fp8":
                        entry["vs_dequantised"] = _errors(out, ref8)
                    best = entry.get("ms_graph") or entry["ms_eager"]
                    entry["weight_GBps"] = round(gb[kind] / (best / 1e3), 1)
                    row[name] = entry
                except Exception as e:  # noqa: BLE001 - recorded in the JSON, the rest still run
                    row[name] = _err(e)
        except Exception as e:  # noqa: BLE001 - recorded in the JSON
            row.update(_err(e))
        rows.append(row)
    return rows


LINEAR_SHAPES = {"qwen3_qkv": (5120, 2048), "qwen3_o": (2048, 4096),
                 "qwen25_gate_up": (37888, 3584), "qwen25_down": (3584, 18944)}
TINY_LINEAR_SHAPES = {"tiny": (48, 64)}


def linear_section(timer: Timer, device: torch.device, dtype: torch.dtype,
                   tiny: bool) -> list[dict]:
    import torch.nn.functional as F

    from omnistage.layers.fp8 import Fp8Linear
    rows = []
    for name, (n, k) in (TINY_LINEAR_SHAPES if tiny else LINEAR_SHAPES).items():
        gen = torch.Generator(device=device).manual_seed(n + k)
        linear = torch.nn.Linear(k, n, bias=False, device=device, dtype=dtype)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(n, k, generator=gen, device=device) * k ** -0.5)
        fp8 = Fp8Linear.from_linear(linear)
        fp8.backend = "triton"
        for m in ((1, 8) if tiny else (1, 8, 64, 512)):
            row: dict = {"shape": name, "n": n, "k": k, "m": m}
            try:
                x = torch.randn(m, k, generator=gen, device=device).to(dtype)
                ref = F.linear(x.float(), linear.weight.float())
                for label, fn in (("bf16_linear", partial(F.linear, x, linear.weight)),
                                  ("fp8_triton", partial(fp8, x))):
                    ms = timer.graph(fn) or timer.eager(fn)
                    row[label] = {"ms": ms, **_errors(fn(), ref)}
            except Exception as e:  # noqa: BLE001 - recorded in the JSON
                row.update(_err(e))
            rows.append(row)
    return rows


def sweep_candidates(tokens: int, tiny: bool) -> list:
    from omnistage.layers.moe_triton import MoEConfig
    if tiny:
        return [MoEConfig(16, 16, 32, 16, 32, 1, 1), MoEConfig(16, 32, 64, 32, 32, 2, 1)]
    block_ms = (16,) if tokens <= 16 else (16, 32) if tokens <= 64 else (32, 64, 128)
    out = []
    for bm in block_ms:
        for bn1, bk1, bn2, bk2 in ((32, 256, 64, 128), (64, 128, 64, 128), (64, 128, 128, 64),
                                   (128, 64, 128, 64), (32, 128, 32, 256), (64, 256, 64, 256)):
            for warps, stages in ((4, 3), (4, 4), (8, 3)):
                out.append(MoEConfig(bm, bn1, bk1, bn2, bk2, warps, stages))
    return out


def sweep_section(timer: Timer, shape: dict, device: torch.device, dtype: torch.dtype,
                  w: dict, tiny: bool) -> dict:
    from omnistage.layers import moe_triton
    result: dict = {}
    for tokens in shape["tokens"]:
        c = make_case(shape, tokens, device, dtype)
        for kind in ("bf16", "fp8"):
            w13, w2, scales = ((w["w13"], w["w2"], None) if kind == "bf16"
                               else (w["q13"], w["q2"], w["scales"]))
            table = moe_triton.pick_config(tokens, dtype)
            timings = []
            for cfg in [table] + sweep_candidates(tokens, tiny):
                try:
                    fn = partial(moe_triton.fused_moe, c.x, w13, w2, c.weights, c.ids, scales,
                                 config=cfg)
                    ms = timer.graph(fn) or timer.eager(fn)
                    timings.append((ms, cfg))
                except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: skip it
                    timings.append((float("inf"), f"{cfg}: {type(e).__name__}: {e}"[:300]))
            ok = [(ms, cfg) for ms, cfg in timings if ms != float("inf")]
            best_ms, best = min(ok, key=lambda t: t[0])
            result[f"{tokens}/{kind}"] = {
                "table_ms": timings[0][0], "table": dataclasses.asdict(table),
                "best_ms": best_ms, "best": dataclasses.asdict(best),
                "failed": [cfg for ms, cfg in timings if ms == float("inf")][:5]}
    return result


def apply_sweep(sweep: dict, kind: str = "bf16") -> dict:
    """Winners (bf16) into moe_triton.CONFIGS, keyed by each T as its bucket bound."""
    from omnistage.layers import moe_triton
    applied = {}
    for key, entry in sweep.items():
        tokens, k = key.split("/")
        if k == kind:
            moe_triton.CONFIGS[int(tokens)] = moe_triton.MoEConfig(**entry["best"])
            applied[int(tokens)] = entry["best"]
    return applied


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--tokens", default=None, help="comma list of T (default: all)")
    ap.add_argument("--sweep", action="store_true", help="add the config sweep section")
    ap.add_argument("--apply-sweep", action="store_true",
                    help="the calls section runs with the sweep's bf16 winners in CONFIGS")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type != "cuda":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference stays fp32
    from benchmarks.common import write_result
    load = os.getloadavg()
    shape = dict(TINY if args.tiny else REAL)
    if args.tokens:
        shape["tokens"] = tuple(int(t) for t in args.tokens.split(","))
    dtype = torch.float32 if args.tiny else torch.bfloat16
    timer = Timer(device, args.reps)
    result: dict = {"config": {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "reps": args.reps, "tiny": args.tiny,
        "dtype": str(dtype).removeprefix("torch."), "shape": shape}}
    try:
        import triton
        result["config"]["triton"] = triton.__version__
    except ImportError as e:
        result["config"]["triton"] = str(e)
    t0 = time.perf_counter()
    w = make_weights(shape, device, dtype)
    if args.sweep or args.apply_sweep:
        t = time.perf_counter()
        try:
            result["sweep"] = sweep_section(timer, shape, device, dtype, w, args.tiny)
            if args.apply_sweep:
                result["sweep_applied"] = apply_sweep(result["sweep"])
        except Exception as e:  # noqa: BLE001 - recorded in the JSON
            result["sweep"] = _err(e)
        result["config"]["sweep_s"] = round(time.perf_counter() - t, 1)
    result["calls"] = calls_section(timer, shape, device, dtype, w)
    del w
    result["linear"] = linear_section(timer, device, dtype, args.tiny)
    result["config"]["wall_s"] = round(time.perf_counter() - t0, 1)
    write_result(result, args.out, load)


if __name__ == "__main__":
    main()
