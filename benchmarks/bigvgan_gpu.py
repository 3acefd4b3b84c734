"""BigVGAN (the Qwen2.5-Omni-7B code2wav vocoder's shapes, random weights) on the GPU: the torch
AntiAliasedSnake path vs the fused Triton kernel (`bigvgan_triton.py`), eager and in CUDA graphs.

Sections (one JSON; each fails alone):
  env        versions, device, the cuDNN TF32 setting the vocoder section runs with
  op         the activation alone at big shapes: torch vs the fused variants (and the MUFU sine),
             ms, effective GB/s (x read + y written), max abs diff vs torch; bf16 input
  vocoder    BigVGAN forward at batch 1, 8, 32 x 168 mel frames: ms eager and in a CUDA graph
             (the whole forward captured, as code2wav_graphs.voc_graph does) for the torch path
             and each fused variant, speedups, waveform max abs diff vs the torch path
  precision  batch 8 (and 32), fused activation: convs in strict fp32 / TF32 / bf16 or fp16
             autocast, or the whole module in fp16 / bf16 (`*_module`): graph ms
             and waveform error vs the strict-fp32 torch path (also the kernel's own exactness)
  profile    GPU time by kernel kind of one eager forward at the largest batch, both paths
Run from the repo root:
    PYTHONPATH=$PWD python benchmarks/bigvgan_gpu.py --out $OUT/bigvgan.json
`--small` runs the same code on the CPU with a tiny config and the kernel interpreted
(TRITON_INTERPRET=1): a smoke test of this script, not a measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.machinery
import json
import os
import sys
import time
import traceback
import types
from collections import defaultdict

import torch

from benchmarks.common import sync, timed

try:
    import soundfile  # noqa: F401
except ImportError:  # the GPU machine lacks it; nothing here reads audio files
    sys.modules["soundfile"] = types.ModuleType("soundfile")
    sys.modules["soundfile"].__spec__ = importlib.machinery.ModuleSpec("soundfile", None)

PATHS = ("torch", "recompute", "gather")  # the activation's implementations
TINY = dict(mel_dim=80, upsample_initial_channel=64, resblock_kernel_sizes=[3],
            resblock_dilation_sizes=[[1, 3, 5]], upsample_rates=[5, 3, 2, 2, 2, 2],
            upsample_kernel_sizes=[11, 7, 4, 4, 4, 4])


def bigvgan_config(small: bool) -> dict:
    if small:
        return dict(TINY)
    try:
        from transformers import Qwen2_5OmniConfig
        return Qwen2_5OmniConfig().to_dict()["token2wav_config"]["bigvgan_config"]
    except Exception:  # noqa: BLE001 - no transformers there: the 7B defaults
        return dict(mel_dim=80, upsample_initial_channel=1536, resblock_kernel_sizes=[3, 7, 11],
                    resblock_dilation_sizes=[[1, 3, 5]] * 3, upsample_rates=[5, 3, 2, 2, 2, 2],
                    upsample_kernel_sizes=[11, 7, 4, 4, 4, 4])


def err(x: torch.Tensor, ref: torch.Tensor) -> dict:
    d = (x.float() - ref.float())
    snr = 10 * torch.log10(ref.float().pow(2).sum() / d.pow(2).sum().clamp(min=1e-30))
    return {"max_abs": float(d.abs().max()), "snr_db": round(float(snr), 1)}


@contextlib.contextmanager
def activation_path(module: torch.nn.Module, path: str):
    """Runs the module's anti-aliased Snakes on `path` (their `triton` option: "off" for the
    torch ops; on the CPU the smoke test also forces the dispatch, which otherwise keeps the
    CPU on torch)."""
    from omnistage.models.qwen2_5_omni import token2wav_bigvgan as tb
    snakes = [m for m in module.modules() if isinstance(m, tb.Qwen2_5OmniAntiAliasedSnake)]
    old_modes, old_fn = [m.triton for m in snakes], tb._triton_variant
    for m in snakes:
        m.triton = "off" if path == "torch" else path
    if not torch.cuda.is_available() and path != "torch":
        tb._triton_variant = lambda x, act: path
    try:
        yield
    finally:
        tb._triton_variant = old_fn
        for m, mode in zip(snakes, old_modes, strict=True):
            m.triton = mode


@contextlib.contextmanager
def conv_precision(mode: str):
    """strict fp32 / tf32 (cuDNN TF32 convs) / bf16, fp16 (autocast: convs in that dtype)."""
    old = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = mode == "tf32"
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mode)
    try:
        # no autocast weight cache: a CUDA graph must capture the casts, not reuse warm-up copies
        with torch.autocast(dev, half or torch.bfloat16, enabled=half is not None,
                            cache_enabled=False):
            yield
    finally:
        torch.backends.cudnn.allow_tf32 = old


def capture(fn):
    """fn() captured in a CUDA graph (warmed up on a side stream first) -> (graph, output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    sync()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    sync()
    return graph, out


def build_vocoder(cfg: dict, device: str):
    from omnistage.models.qwen2_5_omni.token2wav_bigvgan import Qwen2_5OmniToken2WavBigVGAN
    torch.manual_seed(0)
    voc = Qwen2_5OmniToken2WavBigVGAN(cfg).eval()
    with torch.no_grad():  # trained alpha/beta are not zero; zeros would hide channel mix-ups
        for name, p in voc.named_parameters():
            if name.endswith((".alpha", ".beta")):
                p.normal_(0.0, 0.3)
    return voc.to(device)


def make_mel(batch: int, cfg: dict, frames: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(batch)
    return (2 * torch.randn(batch, cfg["mel_dim"], frames, generator=g) - 6).to(device)


# ---------------------------------------------------------------------------------- sections
def section_env(args) -> dict:
    out = {"torch": torch.__version__, "cuda": torch.version.cuda,
           "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
           "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32}
    try:
        import triton
        out["triton"] = triton.__version__
    except ImportError as e:
        out["triton"] = f"missing: {e}"
    if torch.cuda.is_available():
        out["device"] = torch.cuda.get_device_name()
    return out


def _op_shape(args, device: str, B: int, C: int, L: int) -> dict:
    from omnistage.models.qwen2_5_omni.bigvgan_triton import anti_aliased_snake
    from omnistage.models.qwen2_5_omni.token2wav_bigvgan import Qwen2_5OmniAntiAliasedSnake
    row: dict = {}
    torch.manual_seed(1)
    m = Qwen2_5OmniAntiAliasedSnake(C).to(device)
    with torch.no_grad():
        m.act.alpha.normal_(0.0, 0.3)
        m.act.beta.normal_(0.0, 0.3)
    x = torch.randn(B, C, L, device=device)
    a, b, w = m.act.alpha.detach(), m.act.beta.detach(), m.filter
    gbytes = 2 * x.numel() * 4 / 1e9
    with activation_path(m, "torch"), torch.inference_mode():
        with conv_precision("fp32"):  # the reference: cuDNN's depthwise convs without TF32
            ref = m(x)
        row["torch_ms"] = timed(lambda: m(x), args.reps)  # as configured (env section)
        row["torch_default_vs_strict"] = err(m(x), ref)
    for variant in ("recompute", "gather"):
        for fast in (False,) if args.small else (False, True):
            name = variant + ("_fast_sin" if fast else "")
            try:
                def fn(v=variant, f=fast):
                    return anti_aliased_snake(x, a, b, w, v, fast_sin=f)
                y = fn()
                row[f"{name}_ms"] = ms = timed(fn, args.reps)
                row[f"{name}_GBps"] = round(gbytes / ms * 1e3, 1)
                row[f"{name}_speedup"] = round(row["torch_ms"] / ms, 2)
                row[f"{name}_err"] = err(y, ref)
            except Exception as e:  # noqa: BLE001 - record it, go on
                row[f"{name}_error"] = repr(e)[:500]
    if not args.small:  # bf16 in, bf16 out, fp32 math (vs fp32 torch on the same input)
        xb = x.bfloat16()
        with activation_path(m, "torch"), torch.inference_mode(), conv_precision("fp32"):
            ref_b = m(xb.float())
        row["recompute_bf16_err"] = err(anti_aliased_snake(xb, a, b, w), ref_b)
        row["recompute_bf16_ms"] = timed(lambda: anti_aliased_snake(xb, a, b, w), args.reps)
    return row


def section_op(args, device: str) -> dict:
    shapes = [(2, 4, 300), (1, 8, 64)] if args.small else [
        (32, 24, 40320), (32, 96, 10080), (32, 768, 840)]
    res = {}
    for B, C, L in shapes:
        try:
            res[f"{B}x{C}x{L}"] = _op_shape(args, device, B, C, L)
        except Exception as e:  # noqa: BLE001
            res[f"{B}x{C}x{L}"] = {"error": repr(e)[:500],
                                   "traceback": traceback.format_exc()[-1500:]}
    return res


def section_vocoder(args, device: str, voc, cfg: dict) -> dict:
    res = {}
    for batch in args.batches:
        row: dict = {}
        res[f"b{batch}"] = row
        try:
            mel = make_mel(batch, cfg, args.frames, device)
            outs = {}
            for path in PATHS:
                try:
                    with activation_path(voc, path), torch.inference_mode():
                        outs[path] = voc(mel).clone()
                        row[f"{path}_eager_ms"] = timed(lambda m=mel: voc(m), args.reps)
                        if device == "cuda":
                            graph, out = capture(lambda m=mel: voc(m))
                            row[f"{path}_graph_ms"] = timed(graph.replay, args.reps)
                            row[f"{path}_graph_vs_eager_max_abs"] = float(
                                (out - outs[path]).abs().max())
                            del graph, out
                            torch.cuda.empty_cache()
                except Exception as e:  # noqa: BLE001
                    row[f"{path}_error"] = repr(e)[:500]
                    row[f"{path}_traceback"] = traceback.format_exc()[-1500:]
            if "torch" in outs:
                ref = outs["torch"]
                row["wave_rms"] = float(ref.pow(2).mean().sqrt())
                row["wave_clipped_frac"] = float((ref.abs() >= 1).float().mean())
                row["audio_s"] = batch * ref.shape[-1] / 24000
                for path in PATHS[1:]:
                    if path in outs:
                        row[f"{path}_vs_torch"] = err(outs[path], ref)
                    for mode in ("eager", "graph"):
                        if f"{path}_{mode}_ms" in row and f"torch_{mode}_ms" in row:
                            row[f"{path}_{mode}_speedup"] = round(
                                row[f"torch_{mode}_ms"] / row[f"{path}_{mode}_ms"], 2)
        except Exception as e:  # noqa: BLE001
            row["error"] = repr(e)[:500]
            row["traceback"] = traceback.format_exc()[-1500:]
    return res


def section_precision(args, device: str, voc, cfg: dict) -> dict:
    batch = 2 if args.small else 8
    mel = make_mel(batch, cfg, args.frames, device)
    res: dict = {"batch": batch}
    with conv_precision("fp32"), activation_path(voc, "torch"), torch.inference_mode():
        ref = voc(mel).clone()
    # *_module: a copy of the vocoder in that dtype, fed mel in it (no per-call weight casts)
    modes = ("fp32", "tf32", "bf16", "fp16", "fp16_module", "bf16_module")
    for mode in modes:
        try:
            dtype = {"fp16_module": torch.float16, "bf16_module": torch.bfloat16}.get(mode)
            net = copy.deepcopy(voc).to(dtype) if dtype is not None else voc
            x = mel.to(dtype) if dtype is not None else mel
            with conv_precision(mode), activation_path(net, args.precision_path), \
                    torch.inference_mode():
                out = net(x).float().clone()
                res[f"{mode}_vs_fp32_torch"] = err(out, ref)
                if device == "cuda":
                    for b in (batch, 32):
                        xb = x if b == batch else x.repeat(-(-b // batch), 1, 1)[:b]
                        graph, _ = capture(lambda n=net, v=xb: n(v))
                        res[f"{mode}_graph_ms" + ("" if b == batch else f"_b{b}")] = timed(
                            graph.replay, args.reps)
                        del graph
                        torch.cuda.empty_cache()
                else:
                    res[f"{mode}_eager_ms"] = timed(lambda n=net, v=x: n(v), args.reps)
        except Exception as e:  # noqa: BLE001
            res[f"{mode}_error"] = repr(e)[:500]
    res["activation_path"] = args.precision_path
    return res


def _kind(name: str) -> str:
    n = name.lower()
    if "aa_snake" in n:
        return "fused_snake"
    if any(k in n for k in ("conv", "cudnn", "xmma", "gemm", "cutlass", "implicit", "sm90")):
        return "conv"
    return "elementwise_other"


def section_profile(args, device: str, voc, cfg: dict) -> dict:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    mel = make_mel(max(args.batches), cfg, args.frames, device)
    res = {}
    for path in ("torch", "recompute"):
        try:
            with activation_path(voc, path), torch.inference_mode():
                voc(mel)
                sync()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    voc(mel)
                    sync()
            by_kind, by_name = defaultdict(float), defaultdict(float)
            for e in prof.events():
                if e.device_type == DeviceType.CUDA:
                    us = e.time_range.elapsed_us()
                    by_kind[_kind(e.name)] += us / 1e3
                    by_name[e.name[:90]] += us / 1e3
            top = sorted(by_name.items(), key=lambda kv: -kv[1])[:8]
            res[path] = {"ms_by_kind": {k: round(v, 2) for k, v in by_kind.items()},
                         "top_kernels_ms": {k: round(v, 2) for k, v in top}}
        except Exception as e:  # noqa: BLE001
            res[path] = {"error": repr(e)[:500]}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the JSON here too")
    ap.add_argument("--batches", type=int, nargs="+", default=None)
    ap.add_argument("--frames", type=int, default=None, help="mel frames per span (168)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--small", action="store_true", help="CPU smoke test (tiny config)")
    ap.add_argument("--sections", default=None, help="comma-separated sections (default: all)")
    ap.add_argument("--precision-path", default="recompute", choices=["recompute", "gather"],
                    help="the fused activation's variant in the precision section")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.small else "cpu"
    if device == "cpu" and not args.small:
        raise SystemExit("no CUDA device: run with --small for a CPU smoke test")
    if args.small:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    args.batches = args.batches or ([1, 2] if args.small else [1, 8, 32])
    args.frames = args.frames or (4 if args.small else 168)
    args.reps = args.reps or (1 if args.small else 5)
    result: dict = {"args": {k: v for k, v in vars(args).items() if k != "out"}}
    cfg = bigvgan_config(args.small)
    result["config"] = {k: cfg[k] for k in TINY}
    sections = [("env", lambda: section_env(args)), ("op", lambda: section_op(args, device))]
    try:
        voc = build_vocoder(cfg, device)
        sections += [(name, lambda f=f: f(args, device, voc, cfg)) for name, f in (
            ("vocoder", section_vocoder), ("precision", section_precision),
            ("profile", section_profile))]
    except Exception as e:  # noqa: BLE001
        result["build_error"] = repr(e)[:500]
    wanted = set(args.sections.split(",")) if args.sections else None
    for name, fn in sections:
        if wanted is not None and name not in wanted:
            continue
        t0 = time.perf_counter()
        try:
            result[name] = fn()
        except Exception as e:  # noqa: BLE001 - one failed section keeps the others
            result[name] = {"error": repr(e)[:500], "traceback": traceback.format_exc()[-2000:]}
        result.setdefault("section_seconds", {})[name] = round(time.perf_counter() - t0, 1)
        print(f"# {name}: {result['section_seconds'][name]} s", file=sys.stderr, flush=True)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
