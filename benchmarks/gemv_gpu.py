"""Decode GEMVs (omnistage/engine/ar/triton_gemv.py) against torch at Qwen2.5-Omni shapes, bf16.

ops: per model (talker d=896, thinker d=3584), op (qkv: norm + q/k/v, o: o_proj + residual,
  gate_up: norm + gate/up + SiLU*mul, down: down_proj + residual) and M = 1, 2, 4, 8 rows: ours,
  the torch expression compiled as layers.compiled_kernels() does (dynamic=True) and a plain
  cuBLAS F.linear of the same weight. Each is captured in a CUDA graph replayed --reps times;
  per call: us, GB/s of weight traffic, max abs diff vs the eager torch expression. The graph
  cycles through copies of the weight so that they do not stay in L2 between calls.
stack: the talker's 24 layers (and the thinker's 28) with random weights, decode batches of
  T = 1 and 8 rows (paged KV, 512 tokens of context each): forward in a CUDA graph with
  KernelOptions.triton_gemv on vs off (off: the compiled torch kernels + cuBLAS), max abs diff; the
  Triton path also without programmatic dependent launch (gemv_nopdl, triton_pdl.py) and with
  split-K partials summed by a second launch (gemv_reduce_launch).
sweep (--sweep): alternative GemvConfigs per shape at M = 1 and 8, fastest vs the table's.
Prints one JSON object; each case records its error and the others still run. Repo root:
    PYTHONPATH=$PWD python benchmarks/gemv_gpu.py --out $OUT/gemv.json [--sweep]
`--device cpu --tiny` runs the same code on the CPU (tiny shapes, kernels interpreted, no
graphs): a smoke test of this script, not a measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # omnistage and benchmarks.*

EPS = 1e-6
MS = (1, 2, 4, 8)
MODELS = {  # d, layers, heads, KV heads, ffn (head_dim 128)
    "talker": (896, 24, 12, 4, 18944), "thinker": (3584, 28, 28, 4, 18944)}
TINY = {"talker": (64, 2, 4, 2, 96), "thinker": (96, 2, 6, 2, 160)}
HD, TINY_HD = 128, 16


def _err(e: BaseException) -> dict:
    return {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-1500:]}


class Timer:
    """Time per call of fn: captured in a CUDA graph (warm-up call first), replayed `reps` times;
    `calls` = calls of the op inside fn. Off CUDA: eager calls (smoke test only)."""

    def __init__(self, device: torch.device, reps: int) -> None:
        self.device, self.reps = device, reps

    def __call__(self, fn, calls: int = 1) -> float:
        fn()
        if self.device.type != "cuda":
            t = time.perf_counter()
            fn()
            return round(1e6 * (time.perf_counter() - t) / calls, 2)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        for _ in range(3):
            graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(self.reps):
            graph.replay()
        end.record()
        end.synchronize()
        return round(start.elapsed_time(end) * 1e3 / self.reps / calls, 2)


# --- the torch expressions each op replaces (the same as layers.attention_qkv/out_mlp) ---

def qkv_expr(x, ln_w, w, b):
    from omnistage.models import layers
    return F.linear(layers._rms_norm(x, ln_w, EPS), w, b)


def residual_expr(x, w, r):
    return r + F.linear(x, w)


def silu_mul_expr(x, ln_w, w):
    from omnistage.models import layers
    gate, up = F.linear(layers._rms_norm(x, ln_w, EPS), w).chunk(2, dim=-1)
    return F.silu(gate) * up


_COMPILED: dict = {}


def compiled(fn):
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=True)
    return _COMPILED[fn]


def op_specs(d: int, heads: int, kv: int, ffn: int, hd: int) -> dict:
    """op -> (W rows N, K, has norm, has residual, is gate/up)."""
    return {"qkv": ((heads + 2 * kv) * hd, d, True, False, False),
            "o": (d, heads * hd, False, True, False),
            "gate_up": (2 * ffn, d, True, False, True),
            "down": (d, ffn, False, True, False)}


def make_op(op: str, spec, M: int, dev, copies: int, config=None):
    """(ours, compiled torch, cuBLAS) closures over `copies` weights, and a check closure."""
    from omnistage.engine.ar import triton_gemv as tg
    N, K, norm, res, silu = spec
    dt = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(N + K + M)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(dt)

    ws = [rnd(N, K, scale=K ** -0.5) for _ in range(copies)]
    x, ln_w = rnd(M, K), 1 + rnd(K, scale=0.2)
    r = rnd(M, N) if res else None
    b = rnd(N) if op == "qkv" else None  # Qwen2: q/k/v have biases, the rest not
    if op == "qkv":
        ours = lambda w: tg.norm_gemv(x, ln_w, EPS, w, b, config=config)  # noqa: E731
        expr, args = qkv_expr, lambda w: (x, ln_w, w, b)
    elif silu:
        ours = lambda w: tg.norm_gemv_silu_mul(x, ln_w, EPS, w, config=config)  # noqa: E731
        expr, args = silu_mul_expr, lambda w: (x, ln_w, w)
    else:
        ours = lambda w: tg.gemv_residual(x, w, r, config=config)  # noqa: E731
        expr, args = residual_expr, lambda w: (x, w, r)
    comp = compiled(expr)
    fns = {"ours": lambda: [ours(w) for w in ws],
           "compiled": lambda: [comp(*args(w)) for w in ws],
           "cublas": lambda: [F.linear(x, w, b) for w in ws]}
    ref = expr(*args(ws[0]))

    def diff(name: str) -> float:
        out = ours(ws[0]) if name == "ours" else comp(*args(ws[0]))
        return round((out.float() - ref.float()).abs().max().item(), 5)
    return fns, diff, N * K * dt.itemsize


def _copies(nbytes: int, dev) -> int:
    if dev.type != "cuda":
        return 1
    l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 50 << 20)
    return max(1, min(32, -(-3 * l2 // nbytes)))  # weights spanning 3x L2: streamed from HBM


def ops_section(timer: Timer, dev, tiny: bool) -> dict:
    from omnistage.engine.ar import triton_gemv as tg
    out: dict = {}
    for model, (d, _, heads, kv, ffn) in (TINY if tiny else MODELS).items():
        specs = op_specs(d, heads, kv, ffn, TINY_HD if tiny else HD)
        for op, spec in specs.items():
            for M in MS:
                key = f"{model}/{op}/M{M}"
                res: dict = {"N": spec[0], "K": spec[1]}
                try:
                    nbytes = spec[0] * spec[1] * 2
                    copies = _copies(nbytes, dev)
                    fns, diff, nbytes = make_op(op, spec, M, dev, copies)
                    cfg = tg.pick_config(spec[0], spec[1], M, torch.bfloat16, spec[4], spec[2],
                                         dev)
                    res["config"] = dataclasses.asdict(cfg)
                    for name, fn in fns.items():
                        try:
                            us = res[f"{name}_us"] = timer(fn, copies)
                            res[f"{name}_GBps"] = round(nbytes / us / 1e3, 1)
                            if name != "cublas":
                                res[f"{name}_max_abs_diff"] = diff(name)
                        except Exception as e:  # noqa: BLE001 - recorded, next impl runs
                            res[name] = _err(e)
                    if "ours_us" in res and "compiled_us" in res:
                        res["speedup_vs_compiled"] = round(res["compiled_us"] / res["ours_us"], 2)
                except Exception as e:  # noqa: BLE001 - recorded, next case runs
                    res.update(_err(e))
                out[key] = res
                print(key, {k: v for k, v in res.items() if k.endswith("_us")}, file=sys.stderr)
    return out


def build_net(model: str, dev, tiny: bool):
    """DecoderModel of random bf16 weights (the layers' default init, norms of ones)."""
    from omnistage.models.layers import DecoderConfig, DecoderModel
    d, L, heads, kv, ffn = (TINY if tiny else MODELS)[model]
    cfg = DecoderConfig(
        vocab_size=16, hidden_size=d, intermediate_size=ffn, num_hidden_layers=L,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=TINY_HD if tiny else HD,
        rms_norm_eps=EPS, rope_theta=1e6, rope_scaling=None, attention_bias=True,
        mlp_bias=False, tie_word_embeddings=False, max_position_embeddings=32768)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # weights made in bf16 on the device directly
    try:
        with torch.device(dev):
            net = DecoderModel(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    wbytes = sum(p.numel() * p.element_size() for n, p in net.named_parameters()
                 if "layers." in n)
    return net, cfg, wbytes


def decode_batch(net, cfg, T: int, dev, ctx: int = 512, page: int = 16):
    """Fresh random paged caches bound to the layers and a decode batch of T rows, each
    sequence with ctx tokens (this step's K/V written at its last slot)."""
    from omnistage.engine.ar.attention import AttentionMetadata
    from omnistage.engine.ar.interface import ForwardBatch
    L, kv, hd = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    nb_seq = -(-ctx // page)
    shape = (L, T * nb_seq + 1, page, kv, hd)
    k_cache = torch.randn(shape, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn(shape, device=dev, dtype=torch.bfloat16)
    for i, layer in enumerate(net.layers):
        layer.self_attn.k_cache, layer.self_attn.v_cache = k_cache[i], v_cache[i]
    tables = torch.arange(T * nb_seq, dtype=torch.int32, device=dev).view(T, nb_seq)
    slots = tables[:, (ctx - 1) // page].long() * page + (ctx - 1) % page
    meta = AttentionMetadata(
        slot_mapping=slots, query_start_loc=torch.arange(T + 1, dtype=torch.int32, device=dev),
        seq_lens=torch.full((T,), ctx, dtype=torch.int32, device=dev), block_tables=tables,
        query_lens_cpu=[1] * T, seq_lens_cpu=[ctx] * T, max_query_len=1, decode_only=True)
    batch = ForwardBatch(input_ids=torch.zeros(T, dtype=torch.long, device=dev),
                         positions=torch.full((T,), ctx - 1, device=dev), attn=meta)
    return torch.randn(T, cfg.hidden_size, device=dev, dtype=torch.bfloat16), batch


def stack_case(timer: Timer, net, cfg, wbytes: int, T: int, dev, tiny: bool) -> dict:
    from omnistage.engine.ar.kernels import KernelOptions, configure_kernels
    x, batch = decode_batch(net, cfg, T, dev)
    res: dict = {"weight_MB": round(wbytes / 1e6, 1)}
    outs = {}
    # gemv_nopdl: the same kernels launched without programmatic dependent launch;
    # gemv_reduce_launch: split-K partials summed by a second launch
    for name, flag, pdl, fused in (("gemv", True, True, True), ("gemv_nopdl", True, False, True),
                                   ("gemv_reduce_launch", True, True, False),
                                   ("torch", False, True, True)):
        # T rows measured even where the engine would not take the GEMVs; the "off" path
        # compiled as the engine runs it; on the CPU only forced switches reach Triton
        configure_kernels(net, KernelOptions(
            compile=dev.type == "cuda", fused_rope_kv=True if tiny else None, triton_gemv=flag,
            gemv_max_rows=max(1, T), gemv_fused_reduce=fused, pdl=pdl))
        if flag:
            res["uses_gemv"] = net.layers[0].uses_triton_gemv(x)
        try:
            with torch.no_grad():
                res[f"{name}_ms"] = round(timer(lambda: net(x, batch)) / 1e3, 4)
                outs[name] = net(x, batch)
            res[f"{name}_GBps"] = round(wbytes / res[f"{name}_ms"] / 1e6, 1)
        except Exception as e:  # noqa: BLE001 - recorded, the other path runs
            res[name] = _err(e)
    if len(outs) == 2:
        res["max_abs_diff"] = round((outs["gemv"].float() - outs["torch"].float())
                                    .abs().max().item(), 5)
        res["out_abs_max"] = round(outs["torch"].float().abs().max().item(), 3)
        res["speedup"] = round(res["torch_ms"] / res["gemv_ms"], 3)
    if "gemv" in outs and "gemv_nopdl" in outs:
        res["pdl_max_abs_diff"] = (outs["gemv"].float() - outs["gemv_nopdl"].float()
                                   ).abs().max().item()
        res["pdl_speedup"] = round(res["gemv_nopdl_ms"] / res["gemv_ms"], 3)
    if "gemv" in outs and "gemv_reduce_launch" in outs:
        res["fused_reduce_max_abs_diff"] = (outs["gemv"].float() - outs["gemv_reduce_launch"]
                                            .float()).abs().max().item()
        res["fused_reduce_speedup"] = round(res["gemv_reduce_launch_ms"] / res["gemv_ms"], 3)
    return res


def stack_section(timer: Timer, dev, tiny: bool, models: list[str]) -> dict:
    out: dict = {}
    for model in models:
        net = None
        for T in (1, 8):
            key = f"{model}/T{T}"
            try:
                if net is None:
                    net, cfg, wbytes = build_net(model, dev, tiny)
                out[key] = stack_case(timer, net, cfg, wbytes, T, dev, tiny)
            except Exception as e:  # noqa: BLE001 - recorded, next case runs
                out[key] = _err(e)
            print(key, out[key], file=sys.stderr)
        net = None
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return out


def sweep_configs(table, spec) -> list:
    """The table's config with one field changed at a time."""
    N, K, norm, _, _ = spec
    rep = dataclasses.replace
    out = [rep(table, block_n=bn) for bn in (8, 16, 32, 64, 128)
           if bn != table.block_n and (bn >= 16 or not table.use_dot)]
    out += [rep(table, block_k=bk) for bk in (128, 256, 512, 1024)
            if bk != table.block_k and bk <= max(128, 2 * K)]
    out += [rep(table, split_k=s) for s in (1, 2, 4, 8) if s != table.split_k and not norm]
    out += [rep(table, use_dot=not table.use_dot, block_n=max(16, table.block_n))]
    out += [rep(table, num_warps=w) for w in (2, 8)]
    out += [rep(table, num_stages=st) for st in (2, 4)]
    return out


def sweep_section(timer: Timer, dev, tiny: bool, models: list[str], ms: list[int]) -> dict:
    """Per case: each field of the table's config varied alone, then the best value of every
    field together; the fastest vs the table's."""
    from omnistage.engine.ar import triton_gemv as tg
    out: dict = {}
    t0 = time.perf_counter()
    for model in models:
        d, _, heads, kv, ffn = (TINY if tiny else MODELS)[model]
        for op, spec in op_specs(d, heads, kv, ffn, TINY_HD if tiny else HD).items():
            for M in ms:
                key = f"{model}/{op}/M{M}"
                copies = _copies(spec[0] * spec[1] * 2, dev)
                table = tg.pick_config(spec[0], spec[1], M, torch.bfloat16, spec[4], spec[2], dev)
                times: dict = {}

                def run(cfg, op=op, spec=spec, M=M, copies=copies, times=times):
                    if cfg in times:
                        return
                    if not cfg.use_dot and M > 1 and cfg.block_n * cfg.block_k > 4096:
                        return  # [8, BLOCK_N, BLOCK_K] FMA products: register spills
                    try:
                        fns, diff, _ = make_op(op, spec, M, dev, copies, config=cfg)
                        times[cfg] = (timer(fns["ours"], copies), diff("ours"))
                    except Exception as e:  # noqa: BLE001 - a config that does not compile
                        times[cfg] = (float("inf"), f"{type(e).__name__}: {str(e)[:160]}")
                run(table)
                for cfg in sweep_configs(table, spec):
                    run(cfg)
                best_fields = {}  # each field's best value, where it beat the table
                for cfg, (us, _) in times.items():
                    for f in dataclasses.fields(cfg):
                        v = getattr(cfg, f.name)
                        if v != getattr(table, f.name) and us < times[table][0] and \
                                us < best_fields.get(f.name, (None, float("inf")))[1]:
                            best_fields[f.name] = (v, us)
                if len(best_fields) > 1:
                    run(dataclasses.replace(table, **{k: v for k, (v, _) in best_fields.items()}))
                ranked = sorted(times.items(), key=lambda kv: kv[1][0])
                out[key] = {"table": [dataclasses.astuple(table), *times[table]],
                            "best": [dataclasses.astuple(ranked[0][0]), *ranked[0][1]],
                            "gain": round(times[table][0] / ranked[0][1][0], 3),
                            "all": [[dataclasses.astuple(c), *t] for c, t in ranked]}
                print(key, out[key]["table"], out[key]["best"],
                      f"{time.perf_counter() - t0:.0f}s", file=sys.stderr)
    out["fields"] = [f.name for f in dataclasses.fields(tg.GemvConfig)]
    return out


def apply_sweep(sweep: dict, tiny: bool) -> dict:
    """Each swept case's fastest config into triton_gemv.CONFIGS (this process only)."""
    from omnistage.engine.ar import triton_gemv as tg
    fields = sweep["fields"]
    applied = {}
    for key, case in sweep.items():
        if not isinstance(case, dict) or "best" not in case:
            continue
        model, op, m = key.split("/")
        d, _, heads, kv, ffn = (TINY if tiny else MODELS)[model]
        n, k = op_specs(d, heads, kv, ffn, TINY_HD if tiny else HD)[op][:2]
        best = tg.GemvConfig(**dict(zip(fields, case["best"][0])))
        tg.CONFIGS[(n, k, 1 if m == "M1" else 8)] = best
        applied[key] = case["best"][0]
    return applied


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--sections", default="ops,stack", help="ops,stack,sweep")
    ap.add_argument("--sweep", action="store_true", help="add the config sweep section")
    ap.add_argument("--models", default="talker,thinker", help="stack and sweep models")
    ap.add_argument("--sweep-ms", default="1,8", help="sweep: rows M")
    ap.add_argument("--apply-sweep", action="store_true",
                    help="sections after the sweep run with its winners in triton_gemv.CONFIGS")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type != "cuda":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from benchmarks.common import write_result
    load = os.getloadavg()
    timer = Timer(dev, args.reps)
    sections = args.sections.split(",") + (["sweep"] if args.sweep else [])
    models = args.models.split(",")
    result: dict = {"config": {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__, "reps": args.reps, "tiny": args.tiny, "dtype": "bf16"}}
    try:
        import triton
        result["config"]["triton"] = triton.__version__
    except ImportError as e:
        result["config"]["triton"] = str(e)
    t0 = time.perf_counter()
    for name in sections:
        t = time.perf_counter()
        try:
            if name == "ops":
                result["ops"] = ops_section(timer, dev, args.tiny)
            elif name == "stack":
                result["stack"] = stack_section(timer, dev, args.tiny, models)
            elif name == "sweep":
                result["sweep"] = sweep_section(timer, dev, args.tiny, models,
                                                [int(m) for m in args.sweep_ms.split(",")])
                if args.apply_sweep:
                    result["applied"] = apply_sweep(result["sweep"], args.tiny)
            else:
                raise ValueError(f"--sections: unknown section {name!r}")
        except Exception as e:  # noqa: BLE001 - recorded, next section runs
            result[name] = _err(e)
        result["config"][f"{name}_s"] = round(time.perf_counter() - t, 1)
    result["config"]["total_s"] = round(time.perf_counter() - t0, 1)
    write_result(result, args.out, load)


if __name__ == "__main__":
    main()
