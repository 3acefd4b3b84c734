"""Fused rope + paged KV write (Triton; CPU via TRITON_INTERPRET=1) vs apply_rope + write_kv,
and a tiny decoder through the fused path vs the torch path. GPU tests are marked."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton", reason="triton is not installed")

from omnistage.engine.ar import triton_rope_kv  # noqa: E402
from omnistage.engine.ar.attention import AttentionMetadata, write_kv  # noqa: E402
from omnistage.engine.ar.triton_rope_kv import rope_write_kv  # noqa: E402
from omnistage.engine.ar.kernels import KernelOptions, configure_kernels  # noqa: E402
from omnistage.models import layers  # noqa: E402
from omnistage.engine.ar.interface import ForwardBatch  # noqa: E402
from omnistage.models.layers import DecoderForCausalLM, apply_rope  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAGE = 8


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _cast(x32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The kernel's fp32 -> dtype cast: round to nearest even (torch, GPU); Triton's interpreter
    truncates to bf16 instead, so under it the expectation is the truncated value."""
    if dtype == torch.bfloat16 and INTERPRETED:
        return (x32.view(torch.int32) & -65536).view(torch.float32).to(dtype)  # exact
    return x32.to(dtype)


def reference(qkv, cos, sin, k_cache, v_cache, slots, H, Hkv, hd, cast=_cast):
    """The torch path: split, apply_rope on q and k in fp32, cast, write_kv (into the given
    caches). With cast=Tensor.to it is exactly apply_rope(x) + write_kv."""
    T = qkv.shape[0]
    q, k, v = qkv.split([H * hd, Hkv * hd, Hkv * hd], dim=-1)
    q = cast(apply_rope(q.float().reshape(T, H, hd), cos, sin), qkv.dtype)
    k = cast(apply_rope(k.float().reshape(T, Hkv, hd), cos, sin), qkv.dtype)
    write_kv(k, v.reshape(T, Hkv, hd), k_cache, v_cache, slots)
    return q


def test_reference_is_apply_rope():
    # the fp32-then-cast reference is the torch path itself when the cast rounds like torch
    qkv, cos, sin, k_cache, v_cache, slots = make_inputs(3, 4, 2, 16, torch.bfloat16)
    T = qkv.shape[0]
    q = reference(qkv, cos, sin, k_cache.clone(), v_cache.clone(), slots, 4, 2, 16,
                  cast=lambda x, d: x.to(d))
    assert torch.equal(q, apply_rope(qkv[:, :64].reshape(T, 4, 16), cos, sin))


def make_inputs(T, H, Hkv, hd, dtype, seed=0, num_blocks=11):
    """Random qkv, per-token cos/sin whose halves differ (mrope-like rows), random caches and
    scattered slots, one of them the very last slot of the last block."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(T, (H + 2 * Hkv) * hd, generator=g) * 3).to(dtype)
    ang = torch.rand(T, hd, generator=g) * 40 - 20
    cos, sin = ang.cos(), ang.sin()
    shape = (num_blocks, PAGE, Hkv, hd)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    slots = torch.randperm(num_blocks * PAGE, generator=g)[:T]
    slots[T // 2] = num_blocks * PAGE - 1
    return [t.to(DEVICE) for t in (qkv, cos, sin, k_cache, v_cache, slots)]


def check(T, H, Hkv, hd, dtype, seed=0):
    qkv, cos, sin, k_cache, v_cache, slots = make_inputs(T, H, Hkv, hd, dtype, seed)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q_ref = reference(qkv, cos, sin, k_ref, v_ref, slots, H, Hkv, hd)
    k_before = k_cache.clone()
    q = rope_write_kv(qkv, cos, sin, k_cache, v_cache, slots, H, Hkv, hd)
    # non-trivial: rope changed q, the reference wrote new values at every slot
    assert q_ref.float().abs().mean() > 0.5
    assert not torch.equal(q_ref, qkv[:, :H * hd].reshape(T, H, hd))
    flat_before = k_before.view(-1, Hkv, hd)
    assert (k_ref.view(-1, Hkv, hd)[slots] != flat_before[slots]).float().mean() > 0.9
    assert q.shape == (T, H, hd) and q.dtype == dtype
    # exact: same fp32 operations, then the same cast; whole caches, so other slots are untouched
    torch.testing.assert_close(q, q_ref, rtol=0, atol=0)
    if dtype == torch.bfloat16:  # and within one bf16 ulp of the torch path (exact on GPU)
        q_torch = reference(qkv, cos, sin, k_cache.clone(), v_cache.clone(), slots, H, Hkv, hd,
                            cast=lambda x, d: x.to(d))
        ulp = 2.0 ** (torch.frexp(q_torch.float())[1] - 8).float()
        assert ((q.float() - q_torch.float()).abs() <= ulp).all()
    torch.testing.assert_close(k_cache, k_ref, rtol=0, atol=0)
    torch.testing.assert_close(v_cache, v_ref, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [1, 3, 37])
def test_thinker_heads(T, dtype):
    check(T, 28, 4, 128, dtype)


@pytest.mark.parametrize("H,Hkv,hd,T", [(12, 4, 128, 3), (12, 4, 64, 37), (4, 4, 64, 1),
                                        (4, 4, 128, 37), (3, 1, 96, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_head_layouts(H, Hkv, hd, T, dtype):
    check(T, H, Hkv, hd, dtype, seed=T + H)


@pytest.mark.parametrize("tile", [128, 256, 4096])
def test_tile_sizes(tile, monkeypatch):
    # 1 head per program, 2 (tiles straddle the q/k boundary at 12), all 16 in one
    monkeypatch.setattr(triton_rope_kv, "_TILE_ELEMS", tile)
    check(5, 12, 4, 64, torch.float32, seed=tile)


def test_mrope_rows_and_negative_slot():
    # cos/sin from the model's own mrope table (3-axis positions that differ per token)
    cfg = layers.DecoderConfig(
        vocab_size=8, hidden_size=16, intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
        rope_theta=1e4, rope_scaling=None, attention_bias=False, mlp_bias=False,
        tie_word_embeddings=False, max_position_embeddings=64, mrope_section=(2, 3, 3))
    pos = torch.stack([torch.arange(6), torch.arange(6) * 2 + 1, 5 - torch.arange(6)])
    cos, sin = layers.RotaryEmbedding(cfg)(pos.to(DEVICE))
    qkv, _, _, k_cache, v_cache, slots = make_inputs(6, 4, 2, 16, torch.float32, seed=3)
    slots[2] = -1  # skipped by the kernel
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    q_ref = reference(qkv[keep], cos[keep], sin[keep], k_ref, v_ref, slots[keep], 4, 2, 16)
    q = rope_write_kv(qkv, cos, sin, k_cache, v_cache, slots, 4, 2, 16)
    assert torch.equal(q[keep], q_ref)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_bad_shapes():
    qkv, cos, sin, k_cache, v_cache, slots = make_inputs(3, 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="qkv"):
        rope_write_kv(qkv, cos, sin, k_cache, v_cache, slots, 4, 1, 16)
    with pytest.raises(ValueError, match="cos"):
        rope_write_kv(qkv, cos[:, :8], sin, k_cache, v_cache, slots, 4, 2, 16)
    with pytest.raises(ValueError, match="slot_mapping"):
        rope_write_kv(qkv, cos, sin, k_cache, v_cache, slots[:2], 4, 2, 16)


# --- a whole tiny decoder: fused path (forced, interpreter on CPU) == torch path ---

LM_CFG = dict(vocab_size=97, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=6, num_key_value_heads=2, head_dim=16, rope_theta=1e4,
              max_position_embeddings=256, tie_word_embeddings=False, attention_bias=True)


def _meta(q_lens, seq_lens, tables, slots) -> AttentionMetadata:
    start = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=DEVICE), query_start_loc=start.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=DEVICE),
        query_lens_cpu=q_lens, seq_lens_cpu=seq_lens, max_query_len=max(q_lens),
        decode_only=all(n == 1 for n in q_lens))


def _run_model(model, fused: bool, mrope: bool):
    """Prefill of 2 sequences (5 and 11 tokens), then one decode step; hidden of both steps.
    Eager layer kernels (no torch.compile), the fused rope + KV write forced on or off."""
    configure_kernels(model, KernelOptions(fused_rope_kv=fused,
                                                         triton_gemv=False))
    L, n_kv, hd = model.kv_shape
    k_cache = torch.zeros(L, 6, PAGE, n_kv, hd, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    for i, a in enumerate(model.attention_layers()):
        a.k_cache, a.v_cache = k_cache[i], v_cache[i]
    tables = [[4, 0], [1, 5]]  # seq 1 ends in the last block
    ids = torch.randint(0, 97, (16,), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    pos = torch.cat([torch.arange(5), torch.arange(11)]).to(DEVICE)
    slots = [4 * PAGE + i for i in range(5)] + [PAGE + i for i in range(8)] + \
        [5 * PAGE + i for i in range(3)]
    steps = [(ids, pos, _meta([5, 11], [5, 11], tables, slots)),
             ((ids[:2] + 1) % 97, torch.tensor([5, 11], device=DEVICE),
              _meta([1, 1], [6, 12], tables, [4 * PAGE + 5, 5 * PAGE + 3]))]
    out = []
    with torch.no_grad():
        for tok, p, meta in steps:
            if mrope:  # 3 axes that differ per token
                p = torch.stack([p, p * 2, p + 3])
            out.append(model(ForwardBatch(input_ids=tok, positions=p, attn=meta)))
    return out, k_cache, v_cache


@pytest.mark.parametrize("mrope", [False, True], ids=["rope", "mrope"])
def test_decoder_fused_equals_torch(mrope, monkeypatch):
    cfg = dict(LM_CFG)
    if mrope:
        cfg["rope_parameters"] = dict(rope_theta=1e4, rope_type="default",
                                      mrope_section=[2, 3, 3])
    torch.manual_seed(0)
    model = DecoderForCausalLM(cfg).to(DEVICE)
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    with torch.no_grad():
        for layer in model.model.layers:  # non-trivial biases: they must reach q, k and v
            layer.self_attn.q_proj.bias.normal_()
            layer.self_attn.k_proj.bias.normal_()
            layer.self_attn.v_proj.bias.normal_()
    calls = []
    real = triton_rope_kv.rope_write_kv
    monkeypatch.setattr(triton_rope_kv, "rope_write_kv",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    ref, k_ref, v_ref = _run_model(model, False, mrope)
    assert not calls
    calls.clear()
    got, k_got, v_got = _run_model(model, True, mrope)
    assert len(calls) == 2 * LM_CFG["num_hidden_layers"]
    assert k_ref.abs().sum() > 0 and v_ref.abs().sum() > 0
    for r, g in zip(ref, got):
        assert r.abs().mean() > 0.1
        torch.testing.assert_close(g, r, rtol=0, atol=0)
    torch.testing.assert_close(k_got, k_ref, rtol=0, atol=0)
    torch.testing.assert_close(v_got, v_ref, rtol=0, atol=0)


@pytest.mark.gpu
def test_cuda_graph_capture_thinker_bf16():
    """Captured in a CUDA graph, replayed on new inputs: equal to the torch path (bf16)."""
    T, H, Hkv, hd = 4, 28, 4, 128
    qkv, cos, sin, k_cache, v_cache, slots = make_inputs(T, H, Hkv, hd, torch.bfloat16)
    rope_write_kv(qkv, cos, sin, k_cache, v_cache, slots, H, Hkv, hd)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q = rope_write_kv(qkv, cos, sin, k_cache, v_cache, slots, H, Hkv, hd)
    new = make_inputs(T, H, Hkv, hd, torch.bfloat16, seed=7)
    for buf, val in zip((qkv, cos, sin, k_cache, v_cache, slots), new):
        buf.copy_(val)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q_ref = reference(qkv, cos, sin, k_ref, v_ref, slots, H, Hkv, hd)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(q, q_ref)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.gpu
def test_gpu_microbench_thinker_decode(capsys):
    """28 layers' worth of rope + KV write at batch 1, in CUDA graphs: fused vs apply_rope +
    write_kv. Prints the times (run with -s); asserts only that both write the same."""
    H, Hkv, hd, L = 28, 4, 128, 28
    qkv, cos, sin, k_cache, v_cache, slots = make_inputs(1, H, Hkv, hd, torch.bfloat16)
    k2, v2 = k_cache.clone(), v_cache.clone()

    def fused():
        return [rope_write_kv(qkv, cos, sin, k_cache, v_cache, slots, H, Hkv, hd)
                for _ in range(L)]

    def torch_path():
        return [reference(qkv, cos, sin, k2, v2, slots, H, Hkv, hd, cast=lambda x, d: x.to(d))
                for _ in range(L)]

    times = {}
    for name, fn in (("fused", fused), ("torch", torch_path)):
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        for _ in range(10):
            graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(200):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times[name] = (start.elapsed_time(end) * 1e3 / 200, out[-1])
    with capsys.disabled():
        print(f"\nrope+KV write, {L} layers, batch 1, graph replay: fused "
              f"{times['fused'][0]:.1f} us, torch {times['torch'][0]:.1f} us")
    assert torch.equal(times["fused"][1], times["torch"][1])
    assert torch.equal(k_cache, k2) and torch.equal(v_cache, v2)
