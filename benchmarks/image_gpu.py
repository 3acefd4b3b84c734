"""Image pipelines (Qwen-Image, Z-Image-Turbo) on one GPU, side by side with diffusers in the
same run: real shapes, random bf16 weights built in memory (no checkpoint on disk: the real
ones are 58 GB), the same prompts, sizes and steps.

Reports, for ours: the first request's latency right after the engine is built and a warm one
(c1), images per minute at each concurrency (that many requests submitted at once), peak
memory; for diffusers: one image (batch 1), and a batch of each concurrency's size.

    python -m benchmarks.image_gpu --family qwen_image --steps 20 --true-cfg 4 \\
        --out benchmarks/results/image_gpu_qwen_image_h100.json
    python -m benchmarks.image_gpu --family z_image --out ...      # the Turbo card: 9 steps

Defaults are the engine's (the pipeline's default steps and guidance; diffusers gets the same
values). --tiny runs the tiny checkpoints' shapes (a CPU smoke test of this script)."""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import sync, write_result

PROMPTS = ["a red fox in fresh snow, morning light", "a lighthouse on a cliff at dusk",
           "a bowl of ramen on a wooden table", "a cyberpunk street in the rain at night",
           "an astronaut riding a horse on the moon", "a watercolor of a mountain lake",
           "a close-up photo of a honeybee on a flower", "a vintage car parked by the sea"]

# real component shapes (the released config.json values that set the compute)
QWEN_IMAGE_TRANSFORMER = {"attention_head_dim": 128, "num_attention_heads": 24,
                          "num_layers": 60, "joint_attention_dim": 3584,
                          "axes_dims_rope": [16, 56, 56]}
QWEN_IMAGE_VAE = {"base_dim": 96}
QWEN2_5_VL_7B_TEXT = {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
                      "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
                      "rope_theta": 1000000.0}
Z_IMAGE_TRANSFORMER = {"dim": 3840, "n_layers": 30, "n_refiner_layers": 2, "n_heads": 30,
                       "n_kv_heads": 30, "cap_feat_dim": 2560, "axes_dims": [32, 48, 48]}
Z_IMAGE_VAE = {"block_out_channels": [128, 256, 512, 512], "layers_per_block": 2,
               "norm_num_groups": 32}
QWEN3_4B = {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "vocab_size": 151936, "rope_theta": 1000000.0}


def _update_json(path: Path, values: dict, nested: str | None = None) -> None:
    cfg = json.loads(path.read_text())
    for part in (cfg, cfg.get(nested) if nested else None):
        if isinstance(part, dict):
            part.update(values)
            part.pop("layer_types", None)  # (per-layer lists of the tiny depth)
    path.write_text(json.dumps(cfg, indent=2))


def real_shape_folder(family: str, root: Path, tiny: bool) -> Path:
    """The tiny checkpoint's folder (tokenizer, scheduler, layout) with real-shape configs and
    no weights (both sides build random weights at those shapes in memory)."""
    if family == "qwen_image":
        from omnistage.testing.tiny_qwen_image import build_tiny_qwen_image as build
    else:
        from omnistage.testing.tiny_z_image import build_tiny_z_image as build
    path = build(root / family)
    if tiny:
        return path
    for comp in ("text_encoder", "transformer", "vae"):
        for f in (path / comp).glob("*.safetensors*"):
            f.unlink()
    if family == "qwen_image":
        _update_json(path / "transformer" / "config.json", QWEN_IMAGE_TRANSFORMER)
        _update_json(path / "vae" / "config.json", QWEN_IMAGE_VAE)
        _update_json(path / "text_encoder" / "config.json", QWEN2_5_VL_7B_TEXT, "text_config")
        cfg = json.loads((path / "text_encoder" / "config.json").read_text())
        cfg.setdefault("vision_config", {})["out_hidden_size"] = 3584
        for part in (cfg, cfg.get("text_config") or {}):  # the released mrope split
            for key in ("rope_parameters", "rope_scaling"):
                if isinstance(part.get(key), dict) and "mrope_section" in part[key]:
                    part[key]["mrope_section"] = [16, 24, 24]
        (path / "text_encoder" / "config.json").write_text(json.dumps(cfg, indent=2))
    else:
        _update_json(path / "transformer" / "config.json", Z_IMAGE_TRANSFORMER)
        _update_json(path / "vae" / "config.json", Z_IMAGE_VAE)
        _update_json(path / "text_encoder" / "config.json", QWEN3_4B)
    return path


def _random_(module: torch.nn.Module, seed: int) -> None:
    """Seeded random weights on the module's device: norms 1, biases 0, matrices N(0, 0.02)."""
    g = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0 if "norm" in name else 0.0)
            else:
                p.normal_(0.0, 0.02, generator=g)


def diffusers_pipeline(family: str, path: Path, device: str, dtype: torch.dtype):
    """diffusers' pipeline built from the folder's configs with random weights."""
    import diffusers
    import transformers
    index = json.loads((path / "model_index.json").read_text())
    parts = {}
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            for seed, comp in enumerate(("text_encoder", "transformer", "vae")):
                lib, cls_name = index[comp]
                cls = getattr(diffusers if lib == "diffusers" else transformers, cls_name)
                if lib == "diffusers":
                    module = cls.from_config(cls.load_config(path / comp))
                else:
                    config = transformers.AutoConfig.from_pretrained(path / comp)
                    module = cls._from_config(config, dtype=dtype)
                _random_(module, seed)
                parts[comp] = module.to(dtype).eval()
    finally:
        torch.set_default_dtype(default)
    parts["tokenizer"] = transformers.AutoTokenizer.from_pretrained(path / "tokenizer")
    parts["scheduler"] = diffusers.FlowMatchEulerDiscreteScheduler.from_pretrained(
        path / "scheduler")
    cls = getattr(diffusers, index["_class_name"])
    pipe = cls(**parts)
    pipe.set_progress_bar_config(disable=True)
    pipe.vae.enable_slicing()  # one image per VAE decode: a batch of 1024x1024 decodes OOMs
    return pipe


def diffusers_call_kwargs(family: str, args, n: int) -> dict:
    kwargs = dict(prompt=PROMPTS[:n] if n > 1 else PROMPTS[0], height=args.size,
                  width=args.size, num_inference_steps=args.steps, output_type="pil",
                  generator=torch.Generator("cpu").manual_seed(0))
    if family == "qwen_image":
        kwargs.update(true_cfg_scale=args.true_cfg if args.true_cfg is not None else 4.0,
                      negative_prompt=[args.negative] * n if n > 1 else args.negative)
    else:
        kwargs.update(guidance_scale=args.guidance if args.guidance is not None else 0.0)
    return kwargs


def run_diffusers(family: str, path: Path, args, device: str) -> dict:
    pipe = diffusers_pipeline(family, path, device, torch.bfloat16)
    out: dict = {}
    with torch.inference_mode():
        pipe(**diffusers_call_kwargs(family, args, 1))  # warm-up (kernels, allocator)
        torch.cuda.reset_peak_memory_stats() if device == "cuda" else None
        for n in [1, *args.concurrency]:
            if f"batch{n}" in out:
                continue
            sync()
            t = time.perf_counter()
            pipe(**diffusers_call_kwargs(family, args, n))
            sync()
            seconds = time.perf_counter() - t
            out[f"batch{n}"] = {"seconds": round(seconds, 3),
                                "images_per_minute": round(60 * n / seconds, 2)}
    if device == "cuda":
        out["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    del pipe
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def run_ours(family: str, path: Path, args, device: str, step_cache: float | None = None,
             concurrency: list[int] | None = None) -> dict:
    from omnistage import DiffusionParams, OmniLLM
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    llm = OmniLLM(model=str(path), device=device, step_cache=step_cache,
                  load_format="safetensors" if args.tiny else "dummy")
    out: dict = {"build_seconds": round(time.perf_counter() - t, 2)}

    def params(i: int) -> DiffusionParams:
        cfg = ({"true_cfg_scale": args.true_cfg, "negative_prompt": args.negative}
               if family == "qwen_image" else {"guidance_scale": args.guidance})
        return DiffusionParams(args.size, args.size, args.steps, seed=i,
                               **{k: v for k, v in cfg.items() if v is not None})

    images: list = []

    def batch(n: int) -> float:
        sync()
        t = time.perf_counter()
        outs = llm.generate(PROMPTS[:n], [params(i) for i in range(n)], use_tqdm=False)
        sync()
        bad = [o.error for o in outs if o.error]
        if bad:
            raise RuntimeError(f"requests failed: {bad[:2]}")
        images[:] = [np.asarray(o.images[0], dtype=np.float64) for o in outs]
        return time.perf_counter() - t

    out["first_request_seconds"] = round(batch(1), 3)
    warm = [batch(1) for _ in range(args.warm_reps)]
    out["c1"] = {"seconds": round(sorted(warm)[len(warm) // 2], 3)}
    out["first_over_warm"] = round(out["first_request_seconds"] / out["c1"]["seconds"], 3)
    out["images"] = list(images)  # (the warm c1 image, for the step cache's PSNR)
    for n in args.concurrency if concurrency is None else concurrency:
        seconds = batch(n)
        out[f"c{n}"] = {"seconds": round(seconds, 3),
                        "images_per_minute": round(60 * n / seconds, 2)}
    dit = llm.pipeline.workers[llm.stage_names[1]]
    out["dit_stats"] = {k: v for k, v in dit.stats().items() if isinstance(v, (int, float))}
    if device == "cuda":
        out["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    llm.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", choices=["qwen_image", "z_image"], default="qwen_image")
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=None, help="default: the pipeline's")
    ap.add_argument("--true-cfg", type=float, default=None, help="Qwen-Image (default 4)")
    ap.add_argument("--negative", default=" ", help="Qwen-Image's negative prompt")
    ap.add_argument("--guidance", type=float, default=None, help="Z-Image (default 0)")
    ap.add_argument("--concurrency", default="4,8")
    ap.add_argument("--warm-reps", type=int, default=1)
    ap.add_argument("--reference", choices=["diffusers", "none"], default="diffusers")
    ap.add_argument("--step-cache", type=float, default=None,
                    help="also run c1 with the first-block cache at this threshold")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke test)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    load = os.getloadavg()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.steps is None:  # the pipeline's default, for both sides
        from omnistage.models.qwen_image.pipeline import QwenImagePipeline
        from omnistage.models.z_image.pipeline import ZImagePipeline
        args.steps = (QwenImagePipeline if args.family == "qwen_image"
                      else ZImagePipeline).default_steps
    root = Path(tempfile.mkdtemp(prefix="image_gpu_"))
    try:
        path = real_shape_folder(args.family, root, args.tiny)
        result = {"config": {**{k: v for k, v in vars(args).items() if k != "out"},
                             "device": torch.cuda.get_device_name() if device == "cuda"
                             else "cpu", "torch": torch.__version__}}
        if args.reference == "diffusers":  # first: its memory is freed before ours is built
            import diffusers
            result["config"]["diffusers"] = diffusers.__version__
            result["diffusers"] = run_diffusers(args.family, path, args, device)
        result["omnistage"] = run_ours(args.family, path, args, device)
        plain = result["omnistage"].pop("images")
        if args.step_cache is not None:  # the same c1 request with the cache, its PSNR
            cached = run_ours(args.family, path, args, device, args.step_cache, [])
            mse = float(np.mean((cached.pop("images")[0] - plain[0]) ** 2))
            cached["psnr_vs_no_cache_db"] = (round(10 * np.log10(255**2 / mse), 2) if mse
                                             else "identical")
            cached["c1_speedup_vs_no_cache"] = round(
                result["omnistage"]["c1"]["seconds"] / cached["c1"]["seconds"], 3)
            result["omnistage_step_cache"] = cached
        if args.reference == "diffusers":
            ours, ref = result["omnistage"], result["diffusers"]
            result["ratios"] = {"c1_time_vs_diffusers": round(
                ours["c1"]["seconds"] / ref["batch1"]["seconds"], 3)}
            for n in args.concurrency:
                result["ratios"][f"c{n}_throughput_vs_diffusers_batch{n}"] = round(
                    ours[f"c{n}"]["images_per_minute"] / ref[f"batch{n}"]["images_per_minute"],
                    3)
        write_result(result, args.out, load)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
