"""Decode GEMVs (Triton; CPU via TRITON_INTERPRET=1) vs the torch expressions of layers.py, and
a tiny decoder whose decode steps run through them vs the torch path. GPU tests are marked."""

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton", reason="triton is not installed")

from omnistage.engine.ar import triton_gemv as tg  # noqa: E402
from omnistage.engine.ar.triton_gemv import GemvConfig  # noqa: E402
from omnistage.engine.ar.kernels import KernelOptions, configure_kernels  # noqa: E402
from omnistage.models import layers  # noqa: E402
from omnistage.engine.ar.interface import ForwardBatch  # noqa: E402
from omnistage.models.layers import DecoderForCausalLM  # noqa: E402
from tests.engine.test_triton_rope_kv import _meta  # noqa: E402  (the same paged layout)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
EPS = 1e-6


def _cast(x32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The kernels' fp32 -> dtype cast: round to nearest even (torch, GPU); Triton's interpreter
    truncates to bf16 instead, so under it the expectation is the truncated value."""
    if dtype == torch.bfloat16 and INTERPRETED:
        return (x32.view(torch.int32) & -65536).view(torch.float32).to(dtype)  # exact
    return x32.to(dtype)


def _rne(x32: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x32.to(dtype)


def _ulp(t: torch.Tensor) -> torch.Tensor:
    # bf16 spacing at |t| (8 significant bits)
    return 2.0 ** (torch.frexp(t.float())[1] - 8).float()


# --- references: torch in fp32 with the kernels' rounding points, `cast` at each of them ---

def ref_norm(x, ln_w, cast):
    xf = x.float()
    xn = cast(xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS), x.dtype)
    return cast(xn.float() * ln_w.float(), x.dtype)


def ref_linear(h, w, b, cast):
    y = (h.double() @ w.double().T).float()  # fp64: no TF32, whatever the matmul settings
    return cast(y + b.float() if b is not None else y, h.dtype)


def ref_norm_gemv(x, ln_w, w, b, cast=_cast):
    return ref_linear(ref_norm(x, ln_w, cast), w, b, cast)


def ref_silu_mul(x, ln_w, w, b, cast=_cast):
    g, u = ref_linear(ref_norm(x, ln_w, cast), w, b, cast).float().chunk(2, dim=-1)
    return cast(cast(g / (1.0 + torch.exp(-g)), x.dtype).float() * u, x.dtype)


def ref_gemv_residual(x, w, r, b, cast=_cast):
    return cast(r.float() + ref_linear(x, w, b, cast).float(), x.dtype)


# --- the torch expressions of the layer (what the kernels replace) ---

def torch_norm_gemv(x, ln_w, w, b):
    return layers.attention_qkv(x, ln_w, EPS, w, b)


def torch_silu_mul(x, ln_w, w, b):
    gate, up = F.linear(layers._rms_norm(x, ln_w, EPS), w, b).chunk(2, dim=-1)
    return F.silu(gate) * up


def torch_gemv_residual(x, w, r, b):
    return r + F.linear(x, w, b)


def make_inputs(M, N, K, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * 2 + 0.5
    ln_w = 1 + torch.randn(K, generator=g) / 4
    w = torch.randn(N, K, generator=g) / K ** 0.5
    b = torch.randn(N, generator=g) if bias else None
    r = torch.randn(M, N // 2, generator=g) * 2  # for gemv_residual with w[:N // 2]
    return [t.to(DEVICE, dtype) if t is not None else None for t in (x, ln_w, w, b, r)]


def _ops(x, ln_w, w, b, r, config, fused_reduce: bool = True):
    # (name, kernel output, reference with the kernel's casts, torch expression, the
    # reference's linear output before the residual add)
    F2 = w.shape[0] // 2
    b_half = b[:F2] if b is not None else None
    k = dict(config=config, fused_reduce=fused_reduce)
    return [
        ("norm_gemv", tg.norm_gemv(x, ln_w, EPS, w, b, **k),
         ref_norm_gemv(x, ln_w, w, b), torch_norm_gemv(x, ln_w, w, b), None),
        ("silu_mul", tg.norm_gemv_silu_mul(x, ln_w, EPS, w, b, **k),
         ref_silu_mul(x, ln_w, w, b), torch_silu_mul(x, ln_w, w, b), None),
        ("residual", tg.gemv_residual(x, w[:F2, :], r, b_half, **k),
         ref_gemv_residual(x, w[:F2], r, b_half), torch_gemv_residual(x, w[:F2], r, b_half),
         ref_linear(x, w[:F2], b_half, _cast)),
    ]


CASES = {  # (N even, K, config): K a multiple of the block or not, N not of BLOCK_N
    "heuristic-K64": (48, 64, None),
    "heuristic-K150": (70, 150, None),
    "fma-split3": (70, 150, GemvConfig(16, 32, 3, use_dot=False)),
    "dot-split2": (70, 160, GemvConfig(16, 64, 2, use_dot=True)),
    "dot-bn32": (76, 128, GemvConfig(32, 64, 1, use_dot=True, num_warps=2)),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_ops_vs_torch(case, M, dtype):
    N, K, config = CASES[case]
    x, ln_w, w, b, r = make_inputs(M, N, K, dtype, bias=M != 3, seed=M + K)
    for name, out, ref, expr, lin in _ops(x, ln_w, w, b, r, config):
        assert out.shape == expr.shape and out.dtype == dtype, name
        assert expr.float().abs().mean() > 0.1, name  # non-trivial
        if dtype == torch.float32:  # same math up to the fp32 summation order
            scale = expr.abs().max().item()
            torch.testing.assert_close(out, expr, rtol=1e-5, atol=1e-5 * scale, msg=name)
            continue
        # bf16: the reference with the kernels' casts, but for a few roundings flipped by the
        # fp32 summation order (measured: <= 0.4% of elements, <= 2 ulps; a flipped linear
        # output moves a residual sum by that output's ulp)
        diff = (out.float() - ref.float()).abs()
        tol = 2 * _ulp(ref) + (_ulp(lin) if lin is not None else 0)
        assert (diff <= tol).all(), f"{name}: max diff {diff.max().item()}"
        assert (diff > 0).float().mean() < 0.02, f"{name}: {(diff > 0).float().mean():.3f}"


@pytest.mark.parametrize("case", ["fma-split3", "dot-split2"])
def test_fused_split_reduce_equals_reduce_launch(case):
    """Split K: the last split of each N tile sums the partials (arrival counters) with the
    same result, bit for bit, as the separate reduce launch; the counters end at zero."""
    N, K, config = CASES[case]
    x, ln_w, w, b, r = make_inputs(3, N, K, torch.bfloat16, bias=True, seed=7)
    fused = [out for _, out, *_ in _ops(x, ln_w, w, b, r, config)]
    counts = [c for key, c in tg._COUNTS.items() if key[1] == w.data_ptr()]
    assert counts and all(int(c.abs().sum()) == 0 for c in counts)
    launched = [out for _, out, *_ in _ops(x, ln_w, w, b, r, config, fused_reduce=False)]
    for a, c in zip(fused, launched):
        assert a.float().abs().max() > 0.1 and torch.equal(a, c)


def test_reference_is_torch_bf16():
    # with round-to-nearest casts the references are the torch expressions (up to a rare
    # 1-ulp flip from the fp32 summation order)
    x, ln_w, w, b, r = make_inputs(8, 70, 150, torch.bfloat16, bias=True, seed=5)
    F2 = w.shape[0] // 2
    pairs = [(ref_norm_gemv(x, ln_w, w, b, _rne), torch_norm_gemv(x, ln_w, w, b)),
             (ref_silu_mul(x, ln_w, w, b, _rne), torch_silu_mul(x, ln_w, w, b)),
             (ref_gemv_residual(x, w[:F2], r, b[:F2], _rne),
              torch_gemv_residual(x, w[:F2], r, b[:F2]))]
    for ref, expr in pairs:
        diff = (ref.float() - expr.float()).abs()
        assert (diff <= _ulp(expr)).all() and (diff == 0).float().mean() > 0.97


def test_config_table_is_well_formed():
    # measured entries (H100 sweep): power-of-two tiles, FMAs at M = 1, tl.dot (>= 16 rows of W
    # per tile) at 2 <= M, K split only where the output is d wide (no norm in front)
    for (n, k, mb), cfg in tg.CONFIGS.items():
        assert cfg.use_dot == (mb > 1), (n, k, mb)
        for v in (cfg.block_n, cfg.block_k, cfg.num_warps):
            assert v & (v - 1) == 0, (n, k, mb)
        assert cfg.block_n >= (16 if cfg.use_dot else 1) and cfg.split_k >= 1
        assert cfg.split_k == 1 or n in (896, 3584), (n, k, mb)
    cpu = torch.device("cpu")
    assert tg.pick_config(896, 18944, 4, torch.bfloat16, False, False, cpu).split_k == 5
    assert tg.pick_config(2560, 896, 1, torch.bfloat16, False, True, cpu) == tg.CONFIGS[
        (2560, 896, 1)]
    assert tg.pick_config(896, 18944, 1, torch.float32, False, False,
                          cpu).block_k == 256  # fp32: not the bf16 table, the heuristic


def test_bad_inputs():
    x, ln_w, w, b, r = make_inputs(3, 70, 150, torch.float32, bias=True)
    with pytest.raises(ValueError, match="w"):
        tg.norm_gemv(x, ln_w, EPS, w[:, :100])
    with pytest.raises(ValueError, match="rows"):
        tg.norm_gemv(torch.zeros(17, 150, device=DEVICE), ln_w, EPS, w)
    with pytest.raises(ValueError, match="dtype"):
        tg.norm_gemv(x, ln_w, EPS, w.double())
    with pytest.raises(ValueError, match="ln_w"):
        tg.norm_gemv(x, ln_w[:10], EPS, w)
    with pytest.raises(ValueError, match="residual"):
        tg.gemv_residual(x, w, r)
    with pytest.raises(ValueError, match="w_gate_up"):
        tg.norm_gemv_silu_mul(x, ln_w, EPS, w[:69])


# --- a tiny decoder: decode steps through the GEMVs (forced) == the torch path ---

LM_CFG = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
              num_attention_heads=6, num_key_value_heads=2, head_dim=16, rope_theta=1e4,
              max_position_embeddings=256, tie_word_embeddings=False, attention_bias=True,
              mlp_bias=True)
PAGE = 8


def _greedy(model, gemv: bool, steps: int = 3, **options):
    """Prefill of 2 sequences (5 and 11 tokens: 16 rows, the torch path), then `steps` greedy
    decode steps of 2 rows; the logits of every step and the tokens. Eager layer kernels, the
    fused rope + KV write, the GEMVs forced on or off (options: more KernelOptions)."""
    configure_kernels(model, KernelOptions(fused_rope_kv=True, triton_gemv=gemv,
                                                         **options))
    L, n_kv, hd = model.kv_shape
    k_cache = torch.zeros(L, 6, PAGE, n_kv, hd, device=DEVICE, dtype=model.lm_head.weight.dtype)
    v_cache = torch.zeros_like(k_cache)
    for i, a in enumerate(model.attention_layers()):
        a.k_cache, a.v_cache = k_cache[i], v_cache[i]
    tables = [[4, 0], [1, 5]]
    lens = [5, 11]
    ids = torch.randint(0, 97, (16,), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    pos = torch.cat([torch.arange(5), torch.arange(11)]).to(DEVICE)
    slots = [4 * PAGE + i for i in range(5)] + [PAGE + i for i in range(8)] + \
        [5 * PAGE + i for i in range(3)]
    meta = _meta(lens, lens, tables, slots)
    logits, tokens = [], []
    with torch.no_grad():
        for _ in range(steps + 1):
            hidden = model(ForwardBatch(input_ids=ids, positions=pos, attn=meta))
            last = hidden[meta.query_start_loc[1:].long() - 1]  # each sequence's last row
            logits.append(model.compute_logits(last))
            ids = logits[-1].argmax(-1)
            tokens.append(ids.tolist())
            pos = torch.tensor(lens, device=DEVICE)
            slots = [tables[s][n // PAGE] * PAGE + n % PAGE for s, n in enumerate(lens)]
            lens = [n + 1 for n in lens]
            meta = _meta([1, 1], lens, tables, slots)
    return logits, tokens, k_cache


def _tiny_model(dtype):
    torch.manual_seed(0)
    model = DecoderForCausalLM(LM_CFG).to(DEVICE, dtype)
    with torch.no_grad():  # non-trivial norm weights and biases
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + torch.randn_like(p) / 4)
            elif name.endswith("bias"):
                p.copy_(torch.randn_like(p))
    return model


def test_decoder_gemv_equals_torch(monkeypatch):
    model = _tiny_model(torch.float32)
    calls = []
    for name in ("norm_gemv", "norm_gemv_silu_mul", "gemv_residual"):
        real = getattr(tg, name)
        monkeypatch.setattr(tg, name, lambda *a, _r=real, _n=name, **k:
                            calls.append(_n) or _r(*a, **k))
    # gemv_max_rows 8: the kernels take the batch's 2 rows too
    ref_logits, ref_tokens, k_ref = _greedy(model, False, gemv_max_rows=8)
    assert not calls
    logits, tokens, k_got = _greedy(model, True, gemv_max_rows=8)
    L = LM_CFG["num_hidden_layers"]
    assert len(calls) == 3 * 4 * L  # the decode steps only (the prefill has 16 rows)
    assert tokens == ref_tokens
    assert len({t for step in ref_tokens for t in step}) > 2  # non-trivial greedy path
    for r, g in zip(ref_logits, logits):
        assert r.abs().mean() > 0.1
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5 * r.abs().max().item())
    torch.testing.assert_close(k_got, k_ref, rtol=1e-5, atol=1e-5)


def test_switch(monkeypatch):
    layer = _tiny_model(torch.float32).model.layers[0]
    x = torch.zeros(8, 4, device=DEVICE)
    # as on CUDA (where it once raised: the default asked an unfused layer for its fused weights)
    monkeypatch.setattr(layers, "_triton_ok", lambda device: True)
    Options = KernelOptions
    assert layer.kernels == Options()  # not bound by an engine: the defaults
    layer.kernels = Options(fused_rope_kv=True)  # the GEMVs by default: not at these shapes
    assert not layer.uses_triton_gemv(x[:1])
    layer.kernels = Options(fused_rope_kv=True, triton_gemv=True)
    assert Options().gemv_max_rows == 1  # by default single-row decode steps only
    assert layer.uses_triton_gemv(x[:1]) and not layer.uses_triton_gemv(x[:2])
    layer.kernels = Options(fused_rope_kv=True, triton_gemv=True, gemv_max_rows=8)
    assert layer.uses_triton_gemv(x) and not layer.uses_triton_gemv(torch.zeros(9, 4))
    layer.kernels = Options(fused_rope_kv=False, triton_gemv=True, gemv_max_rows=8)
    assert not layer.uses_triton_gemv(x)


def test_default_only_for_tuned_shapes(monkeypatch):
    # by default (triton_gemv None, on CUDA) a layer takes the GEMVs only where the table has
    # measured configs for its shapes: Qwen2.5-Omni's talker, not the tiny test decoder
    talker = DecoderForCausalLM(dict(LM_CFG, hidden_size=896, intermediate_size=18944,
                                     num_hidden_layers=1, num_attention_heads=12,
                                     num_key_value_heads=4, head_dim=128, mlp_bias=False))
    tiny = _tiny_model(torch.float32)
    for model in (talker, tiny):
        model.to(torch.bfloat16)
        model.model.layers[0].fuse()
    assert talker.model.layers[0].gemv_tuned() and not tiny.model.layers[0].gemv_tuned()
    monkeypatch.setattr(layers, "_triton_ok", lambda device: True)  # as on CUDA
    x = torch.zeros(1, 896, dtype=torch.bfloat16)
    assert talker.model.layers[0].uses_triton_gemv(x)
    assert not tiny.model.layers[0].uses_triton_gemv(x)
    # an engine with triton_gemv off configures its layers so
    configure_kernels(talker, KernelOptions(triton_gemv=False))
    assert not talker.model.layers[0].uses_triton_gemv(x)


# --- GPU ---

@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 4])
def test_cuda_graph_thinker_bf16(M):
    """Thinker shapes (FMAs at M = 1, tl.dot at 4; K split for o/down), captured and replayed
    on new inputs: equal to eager calls and within the bf16 tolerance of the references
    (round-to-nearest on the GPU)."""
    d, qkv, ffn = 3584, 4608, 18944
    g = torch.Generator(device=DEVICE).manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=DEVICE) * scale).bfloat16()

    x, ln_w, r = rnd(M, d), 1 + rnd(d, scale=0.2), rnd(M, d)
    w_qkv, b_qkv, w_gu, w_o, w_d = (rnd(qkv, d, scale=d ** -0.5), rnd(qkv),
                                    rnd(2 * ffn, d, scale=d ** -0.5), rnd(d, d, scale=d ** -0.5),
                                    rnd(d, ffn, scale=ffn ** -0.5))

    def fn():
        return (tg.norm_gemv(x, ln_w, EPS, w_qkv, b_qkv), tg.gemv_residual(x, w_o, r),
                tg.norm_gemv_silu_mul(x, ln_w, EPS, w_gu),
                tg.gemv_residual(h_in, w_d, r))

    h_in = rnd(M, ffn)
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn()
    for buf in (x, r, h_in):
        buf.copy_(rnd(*buf.shape))
    graph.replay()
    torch.cuda.synchronize()
    eager = fn()
    refs = (ref_norm_gemv(x, ln_w, w_qkv, b_qkv), ref_gemv_residual(x, w_o, r, None),
            ref_silu_mul(x, ln_w, w_gu, None), ref_gemv_residual(h_in, w_d, r, None))
    for out, e, ref in zip(outs, eager, refs):
        assert torch.equal(out, e)  # deterministic (split-K summed in a fixed order)
        assert ((out.float() - ref.float()).abs() <= 2 * _ulp(ref) + 1e-2).all()


@pytest.mark.gpu
def test_decoder_gemv_bf16_gpu():
    model = _tiny_model(torch.bfloat16)
    ref_logits, _, _ = _greedy(model, False, steps=1)
    logits, _, _ = _greedy(model, True, steps=1)
    r, g = ref_logits[1], logits[1]  # the decode step (the same input tokens on both paths)
    assert r.abs().mean() > 0.1
    torch.testing.assert_close(g, r, rtol=0.05, atol=0.05 * r.abs().max().item())


@pytest.mark.gpu
def test_pdl_fused_reduce_chain_in_graph_equals_plain_launches():
    """Talker shapes, 4 layers' GEMVs chained (each reads the one before), captured with
    programmatic dependent launch and split-K sums in the GEMV launch: bit-identical to eager
    launches without either, over replays on new inputs (a kernel reading before its wait, or
    a partial read before it was stored, would show up as a mismatch)."""
    from omnistage.engine.ar import triton_pdl
    if not triton_pdl.pdl_kwargs(torch.device(DEVICE)):
        pytest.skip("PDL needs a Hopper (sm_90+) GPU")
    d, qkv, ffn, heads = 896, 2560, 18944, 1536
    g = torch.Generator(device=DEVICE).manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=DEVICE) * scale).bfloat16()

    x, ln_w = rnd(1, d), 1 + rnd(d, scale=0.2)
    w_qkv, b_qkv, w_o = rnd(qkv, d, scale=d ** -0.5), rnd(qkv), rnd(d, heads, scale=0.03)
    w_gu, w_d = rnd(2 * ffn, d, scale=d ** -0.5), rnd(d, ffn, scale=ffn ** -0.5)

    def chain(on: bool):  # on: PDL and split-K sums in the GEMV launch; else neither
        k = dict(pdl=on, fused_reduce=on)
        h = x
        for _ in range(4):
            a = tg.norm_gemv(h, ln_w, EPS, w_qkv, b_qkv, **k)[:, :heads]
            h = tg.gemv_residual(a, w_o, h, **k)  # split-K + reduce
            h = tg.gemv_residual(tg.norm_gemv_silu_mul(h, ln_w, EPS, w_gu, **k), w_d, h, **k)
        return h

    chain(True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(True)
    for _ in range(20):
        x.copy_(rnd(1, d))
        graph.replay()
        plain = chain(False)
        torch.cuda.synchronize()
        assert plain.abs().max() > 0.1
        assert torch.equal(out, plain)


@pytest.mark.gpu
def test_decoder_pdl_equals_plain_gpu():
    """The tiny decoder's decode steps (GEMVs, rope + KV write, split attention) with and
    without programmatic dependent launch: identical logits, tokens and caches."""
    from omnistage.engine.ar import triton_pdl
    if not triton_pdl.pdl_kwargs(torch.device(DEVICE)):
        pytest.skip("PDL needs a Hopper (sm_90+) GPU")
    model = _tiny_model(torch.bfloat16)
    # gemv_max_rows 8: the decode steps' 2 rows too
    logits, tokens, k_cache = _greedy(model, True, gemv_max_rows=8)
    ref_logits, ref_tokens, k_ref = _greedy(model, True, gemv_max_rows=8, pdl=False)
    assert tokens == ref_tokens
    assert all(torch.equal(a, b) for a, b in zip(logits, ref_logits))
    assert torch.equal(k_cache, k_ref)
