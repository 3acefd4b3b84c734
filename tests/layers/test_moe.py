"""MoE block vs transformers' Qwen3-Omni blocks (random weights loaded by checkpoint name), and the
Triton fused MoE (CPU via TRITON_INTERPRET=1, fp32) vs the torch path. GPU tests are marked."""

import os

import pytest
import torch
from torch import nn

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from transformers.models.qwen3_omni_moe import configuration_qwen3_omni_moe as hf_config  # noqa: E402
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf_model  # noqa: E402

from omnistage.layers.fp8 import FP8_DTYPE, quantize_fp8  # noqa: E402
from omnistage.layers.moe import (  # noqa: E402
    MoEExperts,
    SparseMoE,
    expert_param,
    fused_experts,
    select_experts,
)

HIDDEN, INTER, SHARED_INTER = 32, 16, 24
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _nondegenerate(t: torch.Tensor) -> None:
    assert torch.isfinite(t).all()
    assert t.abs().max() > 0 and t.float().std() > 0, "degenerate output"


def _hf_block(kind: str, num_experts: int, top_k: int, norm_topk_prob: bool, seed: int):
    common = dict(hidden_size=HIDDEN, moe_intermediate_size=INTER, num_experts=num_experts,
                  num_experts_per_tok=top_k, norm_topk_prob=norm_topk_prob)
    if kind == "thinker":
        cfg = hf_config.Qwen3OmniMoeTextConfig(**common)
    else:
        cfg = hf_config.Qwen3OmniMoeTalkerTextConfig(
            **common, shared_expert_intermediate_size=SHARED_INTER)
    cfg._experts_implementation = "eager"  # transformers' own loop: the reference arithmetic
    block_cls = (hf_model.Qwen3OmniMoeThinkerTextSparseMoeBlock if kind == "thinker"
                 else hf_model.Qwen3OmniMoeTalkerTextSparseMoeBlock)
    block = block_cls(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return block


def _checkpoint_tensors(hf_block: nn.Module) -> dict[str, torch.Tensor]:
    """transformers' state_dict in the released checkpoint's layout (experts stored per expert)."""
    out = {}
    for name, t in hf_block.state_dict().items():
        if name == "experts.gate_up_proj":
            inter = t.shape[1] // 2  # gate rows first, then up
            for e in range(t.shape[0]):
                out[f"mlp.experts.{e}.gate_proj.weight"] = t[e, :inter].clone()
                out[f"mlp.experts.{e}.up_proj.weight"] = t[e, inter:].clone()
        elif name == "experts.down_proj":
            for e in range(t.shape[0]):
                out[f"mlp.experts.{e}.down_proj.weight"] = t[e].clone()
        else:
            out[f"mlp.{name}"] = t.clone()
    return out


def _load(block: SparseMoE, tensors: dict[str, torch.Tensor]) -> None:
    params = dict(block.named_parameters())
    loaded = set()
    for name, t in tensors.items():
        parsed = expert_param(name)
        if parsed is not None:
            prefix, expert, proj = parsed
            assert prefix == "mlp.experts"
            block.experts.load_expert(expert, proj, t)
            loaded.add(f"experts.{proj}")
        else:
            local = name.removeprefix("mlp.")
            with torch.no_grad():
                params[local].copy_(t)
            loaded.add(local)
    assert loaded == {"experts.gate_proj", "experts.up_proj", "experts.down_proj"} | {
        n for n in params if not n.startswith("experts.")}


def _ours_from_hf(hf_block, num_experts: int, top_k: int, norm: bool, shared: bool):
    ours = SparseMoE(HIDDEN, num_experts, top_k, INTER, norm, SHARED_INTER if shared else None)
    _load(ours, _checkpoint_tensors(hf_block))
    return ours


def test_expert_param():
    assert expert_param("thinker.model.layers.3.mlp.experts.7.up_proj.weight") == (
        "thinker.model.layers.3.mlp.experts", 7, "up_proj")
    assert expert_param("experts.120.down_proj.weight") == ("experts", 120, "down_proj")
    for name in ("thinker.model.layers.3.mlp.gate.weight", "mlp.shared_expert.up_proj.weight",
                 "mlp.experts.gate_up_proj", "mlp.experts.7.up_proj.bias"):
        assert expert_param(name) is None


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_select_experts_matches_router(norm, dtype):
    hf = _hf_block("thinker", 16, 4, norm, seed=1).gate.to(dtype)
    x = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(2)).to(dtype)
    logits, hf_weights, hf_ids = hf(x)
    weights, ids = select_experts(logits, 4, norm)
    assert weights.dtype == dtype and ids.dtype == torch.int64
    _nondegenerate(weights)
    assert torch.equal(ids, hf_ids) and torch.equal(weights, hf_weights)
    if norm:
        torch.testing.assert_close(weights.float().sum(-1), torch.ones(37),
                                   atol=1e-2 if dtype == torch.bfloat16 else 1e-6, rtol=0)
    with pytest.raises(ValueError, match="top_k"):
        select_experts(logits, 17, norm)


@pytest.mark.parametrize("kind,num_experts,top_k,norm", [
    ("thinker", 8, 2, True), ("thinker", 16, 4, True), ("talker", 8, 2, False),
    ("talker", 16, 4, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_moe_matches_transformers(kind, num_experts, top_k, norm, dtype):
    hf = _hf_block(kind, num_experts, top_k, norm, seed=3).to(dtype)
    ours = _ours_from_hf(hf, num_experts, top_k, norm, shared=kind == "talker").to(dtype)
    ours.backend = "torch"
    x = torch.randn(2, 13, HIDDEN, generator=torch.Generator().manual_seed(4)).to(dtype)
    with torch.no_grad():
        expect = hf(x)
        got = ours(x)
        got_flat = ours(x.reshape(-1, HIDDEN))
    _nondegenerate(got)
    assert got.shape == x.shape and got.dtype == dtype
    # same rows through the same matmuls, added in the same order: bitwise (1e-6 is the brief's)
    torch.testing.assert_close(got, expect, atol=1e-6, rtol=0)
    torch.testing.assert_close(got_flat, got.reshape(-1, HIDDEN), atol=0, rtol=0)


def test_load_expert_validates_and_quantizes_on_the_fly():
    experts = MoEExperts(4, HIDDEN, INTER)
    with pytest.raises(ValueError, match="proj"):
        experts.load_expert(0, "gate_up_proj", torch.zeros(INTER, HIDDEN))
    with pytest.raises(ValueError, match="expert"):
        experts.load_expert(4, "up_proj", torch.zeros(INTER, HIDDEN))
    with pytest.raises(ValueError, match="shape"):
        experts.load_expert(0, "down_proj", torch.zeros(INTER, HIDDEN))
    gen = torch.Generator().manual_seed(5)
    mats = {(e, p): torch.randn(*((INTER, HIDDEN) if p != "down_proj" else (HIDDEN, INTER)),
                                generator=gen)
            for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")}
    for (e, p), t in mats.items():
        experts.load_expert(e, p, t)
    late = MoEExperts(4, HIDDEN, INTER)
    late.quantize_fp8()  # quantise first, load after: per-row scales make it the same
    for (e, p), t in mats.items():
        late.load_expert(e, p, t)
    experts.quantize_fp8()
    assert experts.gate_up_proj.dtype == FP8_DTYPE and experts.down_scale.shape == (4, HIDDEN)
    for name in ("gate_up_proj", "down_proj", "gate_up_scale", "down_scale"):
        a, b = getattr(experts, name), getattr(late, name)
        assert torch.equal(a.view(torch.uint8) if a.dtype == FP8_DTYPE else a,
                           b.view(torch.uint8) if b.dtype == FP8_DTYPE else b), name
    assert torch.equal(experts.gate_up_scale[2, INTER:], quantize_fp8(mats[(2, "up_proj")])[1])


def test_sparse_moe_quantize_fp8_equals_dequantised_weights():
    hf = _hf_block("talker", 8, 2, True, seed=10)
    ours = _ours_from_hf(hf, 8, 2, True, shared=True)
    ours.backend = "torch"
    x = torch.randn(11, HIDDEN, generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        exact = ours(x)
        ours.quantize_fp8()
        got = ours(x)
        # the same block with every quantised weight replaced by its fp32 dequantisation
        for name in ("gate_up_proj", "down_proj"):
            q, s = getattr(ours.experts, name), getattr(ours.experts, name.replace("proj", "scale"))
            hf.experts.get_parameter(name).copy_(q.float() * s[..., None])
        for name in ("gate_proj", "up_proj", "down_proj"):
            linear = getattr(ours.shared_expert, name)
            hf.shared_expert.get_submodule(name).weight.copy_(
                linear.weight.float() * linear.weight_scale[:, None])
        expect = hf(x[None])[0]
    _nondegenerate(got)
    assert ours.gate.weight.dtype == torch.float32  # the router is not quantised
    assert isinstance(ours.shared_expert_gate, nn.Linear)
    torch.testing.assert_close(got, expect, atol=1e-5, rtol=1e-5)
    rel = ((got - exact).norm() / exact.norm()).item()
    assert 1e-3 < rel < 0.1, rel


def _random_moe(tokens: int, num_experts: int, top_k: int, hidden: int, inter: int,
                dtype: torch.dtype, device: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w_gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    w_down = torch.randn(num_experts, hidden, inter, generator=gen) / inter ** 0.5
    logits = torch.randn(tokens, num_experts, generator=gen)
    weights, ids = select_experts(logits, top_k, norm_topk_prob=True)
    to = dict(device=device, dtype=dtype)
    return x.to(**to), w_gate_up.to(**to), w_down.to(**to), weights.to(**to), ids.to(device)


def test_fused_experts_validates_arguments():
    x, w13, w2, weights, ids = _random_moe(3, 4, 2, 16, 8, torch.float32, "cpu", 0)
    with pytest.raises(ValueError, match="backend"):
        fused_experts(x, w13, w2, weights, ids, backend="cuda")
    with pytest.raises(ValueError, match="w_gate_up"):
        fused_experts(x, w13[:, :, :8], w2, weights, ids)
    with pytest.raises(ValueError, match="topk_weights"):
        fused_experts(x, w13, w2, weights[:, :1], ids)
    with pytest.raises(ValueError, match="scales"):
        fused_experts(x, w13, w2, weights, ids, scales=(w13[:, :, 0], w2[:, :, 0]))
    with pytest.raises(ValueError, match="topk_ids"):
        fused_experts(x, w13, w2, weights, ids + 4, backend="torch")


def _moe_triton():
    pytest.importorskip("triton", reason="triton is not installed")
    from omnistage.layers import moe_triton
    return moe_triton


def _small():
    # 16-wide tiles: several blocks, N tiles and K steps even at tiny D/F
    return _moe_triton().MoEConfig(16, 16, 16, 16, 16, num_warps=1, num_stages=1)


@pytest.mark.parametrize("tokens", [1, 5, 64])
@pytest.mark.parametrize("num_experts,top_k,hidden,inter", [(8, 2, 32, 24), (16, 4, 40, 16)])
def test_triton_matches_torch_fp32(tokens, num_experts, top_k, hidden, inter):
    moe_triton = _moe_triton()
    args = _random_moe(tokens, num_experts, top_k, hidden, inter, torch.float32, DEVICE, 6)
    expect = fused_experts(*args, backend="torch")
    got = moe_triton.fused_moe(*args, config=_small())
    _nondegenerate(got)
    # only the order of the k-sum differs (fp32 here, expert order there)
    torch.testing.assert_close(got, expect, atol=1e-5, rtol=1e-5)
    if tokens == 5:  # the public entry point and the default config table take the same path
        torch.testing.assert_close(fused_experts(*args, backend="triton"), got,
                                   atol=1e-5, rtol=1e-5)


def test_align_blocks_expert_slots_in_order():
    moe_triton = _moe_triton()
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [5, 3]], device=DEVICE)  # T 4, k 2, E 6
    weights = torch.ones(4, 2, device=DEVICE)
    x, w13, w2, _, _ = _random_moe(4, 6, 2, 16, 16, torch.float32, DEVICE, 7)
    got = moe_triton.fused_moe(x, w13, w2, weights, ids, config=_small())
    _nondegenerate(got)
    torch.testing.assert_close(got, fused_experts(x, w13, w2, weights, ids, backend="torch"),
                               atol=1e-5, rtol=1e-5)
    blocks = moe_triton.max_blocks(8, 6, 16)
    sorted_slots = torch.empty(blocks * 16, dtype=torch.int32, device=DEVICE)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=DEVICE)
    moe_triton._align_kernel[(6,)](ids.reshape(-1), sorted_slots, block_expert, 8, 6, blocks,
                                   BLOCK_M=16, E_PAD=16, CHUNK=4,
                                   COUNT_CHUNK=4)
    # experts 0, 1, 3, 5 in order, one block each; slots in slot order, padded with 8
    assert block_expert.tolist() == [0, 1, 3, 5] + [-1] * (blocks - 4)
    rows = sorted_slots[:64].view(4, 16).tolist()
    expect = [[1, 4], [3], [0, 2, 5, 7], [6]]
    assert rows == [r + [8] * (16 - len(r)) for r in expect]


@pytest.mark.parametrize("tokens", [1, 9])
def test_fp8_matches_dequantised_torch(tokens):
    moe_triton = _moe_triton()
    x, w13, w2, weights, ids = _random_moe(tokens, 8, 2, 32, 24, torch.float32, DEVICE, 8)
    (q13, s13), (q2, s2) = quantize_fp8(w13), quantize_fp8(w2)
    assert q13.dtype == FP8_DTYPE and s13.shape == (8, 48) and s2.shape == (8, 32)
    dequant13, dequant2 = q13.float() * s13[..., None], q2.float() * s2[..., None]
    expect = fused_experts(x, dequant13, dequant2, weights, ids, backend="torch")
    for backend in ("torch", "triton"):
        if backend == "torch":
            got = fused_experts(x, q13, q2, weights, ids, backend="torch", scales=(s13, s2))
        else:
            got = moe_triton.fused_moe(x, q13, q2, weights, ids, (s13, s2), config=_small())
        _nondegenerate(got)
        torch.testing.assert_close(got, expect, atol=1e-5, rtol=1e-5)
    # and FP8 is near, not equal to, the unquantised result (e4m3: 3 mantissa bits)
    exact = fused_experts(x, w13, w2, weights, ids, backend="torch")
    rel = (expect - exact).norm() / exact.norm()
    assert 1e-4 < rel < 0.05, rel


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 64, 300])
def test_triton_bf16_cuda_matches_torch(tokens):
    moe_triton = _moe_triton()
    args = _random_moe(tokens, 32, 8, 256, 128, torch.bfloat16, "cuda", 9)
    expect = fused_experts(*args, backend="torch").float()
    exact = fused_experts(*[a.float() if a.is_floating_point() else a for a in args],
                          backend="torch")
    got = moe_triton.fused_moe(*args).float()
    _nondegenerate(got)
    # both bf16; the rounding points are the same, only the k-sum differs (fp32 vs bf16 adds)
    assert (got - exact).abs().max() <= 1.5 * (expect - exact).abs().max() + 1e-3
    torch.testing.assert_close(got, expect, atol=2e-2, rtol=2e-2)
    x, w13, w2, weights, ids = args
    (q13, s13), (q2, s2) = quantize_fp8(w13), quantize_fp8(w2)
    got8 = moe_triton.fused_moe(x, q13, q2, weights, ids, (s13, s2)).float()
    ref8 = fused_experts(x, q13, q2, weights, ids, backend="torch", scales=(s13, s2)).float()
    torch.testing.assert_close(got8, ref8, atol=3e-2, rtol=3e-2)
