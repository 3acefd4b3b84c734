"""Weight-only FP8: quantisation error bounds, the Triton W8A16 GEMM (CPU via TRITON_INTERPRET=1,
fp32) vs the dequantised torch linear, quantize_linears, and SmolLM2-135M real weights (FP8
linears vs bf16 over 200 positions of text). GPU tests are marked."""

import os

import pytest
import torch
from torch import nn

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from omnistage.layers.fp8 import (  # noqa: E402
    FP8_DTYPE,
    Fp8Linear,
    dequantize_fp8,
    quantize_fp8,
    quantize_linears,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3_HALF_ULP = 2.0 ** -4  # 3 mantissa bits: round to nearest is within 1/16 relative
E4M3_MIN_NORMAL = 2.0 ** -6

TEXT = (
    "The river town woke slowly that spring. Fishermen pulled their boats onto the gravel bank "
    "before sunrise, and the baker on the corner opened his shutters to let the smell of bread "
    "drift down the street. Children walked to school along the old stone bridge, stopping to "
    "watch the water rush beneath the arches after a week of heavy rain. At the library, the "
    "new librarian sorted boxes of donated books: atlases with faded maps, cookbooks full of "
    "handwritten notes, and a complete set of encyclopedias from 1962. She made a list of "
    "everything, because the town council had asked for a report by the end of the month. "
    "In the afternoon the wind changed direction, and clouds gathered over the hills to the "
    "west. Farmers checked their fences and moved the sheep into the lower fields. By evening "
    "the first drops of rain were falling on the market square, where the last traders were "
    "packing away their stalls of apples, cheese, and wool. Inside the tavern, people talked "
    "about the weather, the price of grain, and the plan to build a new school next year. "
    "Someone said the bridge would need repairs before winter; someone else said it had stood "
    "for two hundred years and would stand for two hundred more. The conversation went on "
    "late into the night, long after the rain had stopped and the stars had come out again."
)


def _nondegenerate(t: torch.Tensor) -> None:
    assert torch.isfinite(t).all()
    assert t.abs().max() > 0 and t.float().std() > 0, "degenerate output"


def test_quantize_fp8_error_bounds():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 40, 70, generator=gen) * torch.logspace(-3, 1, 40)[None, :, None]
    w[1, 5] = 0.0  # an all-zero row
    q, scale = quantize_fp8(w)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (3, 40)
    torch.testing.assert_close(scale, w.abs().amax(-1) / 448.0, atol=0, rtol=0)
    assert scale[1, 5] == 0 and not torch.isnan(q.float()).any()
    deq = dequantize_fp8(q, scale, torch.float32)
    torch.testing.assert_close(deq.abs().amax(-1), w.abs().amax(-1), atol=0, rtol=1e-6)
    bound = torch.maximum(w.abs() * E4M3_HALF_ULP,  # normals: half an ulp, relative
                          scale[..., None] * E4M3_MIN_NORMAL * 2.0 ** -3)  # subnormal spacing/2
    assert ((deq - w).abs() <= bound * (1 + 1e-6)).all()
    rel = ((deq - w).norm() / w.norm()).item()
    assert 0.01 < rel < 0.04, rel  # e4m3 on Gaussian rows: ~2.5%
    with pytest.raises(ValueError, match="w"):
        quantize_fp8(torch.zeros(5))


def _fp8_linear_args(rows: int, k: int, n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    linear = nn.Linear(k, n, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=gen) / k ** 0.5)
        linear.bias.copy_(torch.randn(n, generator=gen))
    return torch.randn(rows, k, generator=gen), linear


@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("k,n,bias", [(64, 48, True), (72, 40, False)])
def test_fp8_linear_triton_matches_dequantised_torch(rows, k, n, bias):
    pytest.importorskip("triton", reason="triton is not installed")
    from omnistage.layers import moe_triton
    x, linear = _fp8_linear_args(rows, k, n, seed=rows)
    if not bias:
        linear.bias = None
    fp8 = Fp8Linear.from_linear(linear).to(DEVICE)
    x = x.to(DEVICE)
    fp8.backend = "torch"
    expect = fp8(x)
    fp8.backend = "triton"
    small = moe_triton.LinearConfig(16, 16, 16, num_warps=1, num_stages=1)
    got = moe_triton.fp8_linear(x, fp8.weight, fp8.weight_scale, fp8.bias, config=small)
    _nondegenerate(got)
    # fp32: the kernel scales the accumulator, torch the weight; only rounding differs
    torch.testing.assert_close(got, expect, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fp8(x.reshape(rows, 1, k)), expect.reshape(rows, 1, n),
                               atol=1e-5, rtol=1e-5)  # the default table, leading dims kept
    exact = linear.to(DEVICE)(x)
    rel = ((got - exact).norm() / exact.norm()).item()
    assert 1e-3 < rel < 0.05, rel  # FP8 weights: near the fp32 linear, not equal to it


def test_quantize_linears_in_place_and_validation():
    model = nn.Sequential(nn.Linear(16, 32), nn.SiLU(),
                          nn.ModuleDict({"head": nn.Linear(32, 8), "skip": nn.Linear(32, 8)}))
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    expect = model[2]["head"](model[1](model[0](x)))
    names = quantize_linears(model, lambda name, linear: not name.endswith("skip"))
    assert names == ["0", "2.head"]
    assert isinstance(model[0], Fp8Linear) and isinstance(model[2]["skip"], nn.Linear)
    assert model[0].weight.dtype == FP8_DTYPE and model[0].bias.dtype == torch.float32
    got = model[2]["head"](model[1](model[0](x)))
    _nondegenerate(got)
    torch.testing.assert_close(got, expect, atol=0.1, rtol=0.1)
    assert not torch.equal(got, expect)
    with pytest.raises(ValueError, match="x"):
        model[0](torch.randn(2, 15))
    model[0].backend = "fast"
    with pytest.raises(ValueError, match="backend"):
        model[0](x)
    model[0].backend = "auto"
    model[0].to(torch.bfloat16)  # casts the fp8 weights too: refused, not silently wrong
    with pytest.raises(ValueError, match="weight"):
        model[0](x.bfloat16())


def _logit_stats(logits: torch.Tensor, ref: torch.Tensor, targets: torch.Tensor) -> dict:
    nll = torch.nn.functional.cross_entropy
    return {"top1_agreement": (logits.argmax(-1) == ref.argmax(-1)).float().mean().item(),
            "max_abs": (logits - ref).abs().max().item(),
            "mean_abs": (logits - ref).abs().mean().item(),
            "rel": ((logits - ref).norm() / ref.norm()).item(),
            "ppl_ratio": (nll(logits[:-1], targets) - nll(ref[:-1], targets)).exp().item()}


@pytest.mark.slow
def test_smollm2_fp8_linears_vs_bf16(smollm2):
    """Every decoder linear FP8 (lm_head, tied to the embeddings, kept bf16), bf16
    activations, vs the bf16 model. Measured (CPU): top-1 0.935, logit rel 0.075, max abs 3.5,
    ppl x1.020; for scale, bf16 vs fp32: top-1 0.965, rel 0.020, ppl x1.004. SmolLM2-135M is
    small; its GGUF source was Q4_1, dequantised to fp32 by omnistage.testing.smollm2."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    ids = AutoTokenizer.from_pretrained(smollm2)(TEXT, return_tensors="pt").input_ids[:, :200]
    assert ids.shape[1] == 200
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.bfloat16).eval()
    model = model.to(DEVICE)
    ids = ids.to(DEVICE)
    with torch.no_grad():
        ref = model(ids).logits[0].float()
        names = quantize_linears(model, lambda name, linear: name != "lm_head")
        assert len(names) == 7 * model.config.num_hidden_layers
        got = model(ids).logits[0].float()
    _nondegenerate(got)
    stats = _logit_stats(got, ref, ids[0, 1:])
    print("smollm2 fp8 vs bf16:", {k: round(v, 4) for k, v in stats.items()})
    assert stats["rel"] > 1e-3  # the weights really are FP8
    assert stats["top1_agreement"] >= 0.88 and stats["rel"] < 0.1, stats
    assert stats["ppl_ratio"] < 1.06, stats


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 100, 600])
def test_fp8_linear_bf16_cuda(rows):
    x, linear = _fp8_linear_args(rows, 1024, 3072, seed=3)
    x, linear = x.cuda().bfloat16(), linear.cuda().bfloat16()
    fp8 = Fp8Linear.from_linear(linear)
    got = fp8(x).float()
    _nondegenerate(got)
    # reference: the fp8 * scale weights exactly, in fp32
    expect = torch.nn.functional.linear(x.float(), fp8.dequantized_weight(torch.float32),
                                        fp8.bias.float())
    torch.testing.assert_close(got, expect, atol=2e-2, rtol=1e-2)  # bf16 output rounding
