"""The DiT block-attention Triton kernel vs the module's attention (Qwen2_5OmniDiTAttention: rotary
on the first head, SDPA over the dense block mask), and the fast DiT's whole ODE with it vs with
SDPA. CPU via TRITON_INTERPRET=1; on a CUDA machine the same tests run the compiled kernel, plus
a bf16 check at the real DiT's head shapes."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before triton is imported: kernels then run in triton's numpy interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed")

from omnistage.models.qwen2_5_omni.code2wav_fast import Qwen2_5OmniFastDiT  # noqa: E402
from omnistage.models.qwen2_5_omni.dit_attention_triton import (  # noqa: E402
    dit_block_attention,
    frame_table,
    supported,
)
from omnistage.models.qwen2_5_omni.token2wav_dit import (  # noqa: E402
    Qwen2_5OmniDiTAttention,
    Qwen2_5OmniDiTSpec,
    qwen2_5_omni_dit_attention_mask,
)

from .test_token2wav import tiny_token2wav_pair  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 24


def _attention(heads: int, head_dim: int, seed: int, dtype=torch.float32
               ) -> Qwen2_5OmniDiTAttention:
    torch.manual_seed(seed)
    spec = Qwen2_5OmniDiTSpec(hidden_size=heads * head_dim, num_attention_heads=heads,
                              head_dim=head_dim)
    return Qwen2_5OmniDiTAttention(spec).to(DEVICE, dtype).eval()


def _rope(start: torch.Tensor, width: int, head_dim: int, dtype) -> tuple:
    # the DiT's rotary angles at absolute frame positions: [B, 1, W, hd/2] (as window_geometry)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, device=DEVICE).float() / head_dim)
    pos = start[:, None] + torch.arange(width, device=DEVICE)
    angles = pos[:, None, :, None].float() * inv_freq
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _both(attn: Qwen2_5OmniDiTAttention, x: torch.Tensor, start: list[int], nvalid: list[int],
          look: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the module's output, the kernel's) for x [B, W, D] windows at `start` with `nvalid`
    real frames; both through the module's own output projection."""
    b, w, _ = x.shape
    start_t = torch.tensor(start, device=DEVICE)
    nvalid_t = torch.tensor(nvalid, device=DEVICE)
    cos, sin = _rope(start_t, w, attn.head_dim, x.dtype)
    valid = torch.arange(w, device=DEVICE) < nvalid_t[:, None]
    mask = qwen2_5_omni_dit_attention_mask(start_t[:, None] + torch.arange(w, device=DEVICE),
                                           valid, BLOCK, *look)
    with torch.no_grad():
        ref = attn(x, (cos, sin), mask)
        wqkv = torch.cat([attn.to_q.weight, attn.to_k.weight, attn.to_v.weight])
        bqkv = torch.cat([attn.to_q.bias, attn.to_k.bias, attn.to_v.bias])
        qkv = torch.nn.functional.linear(x, wqkv, bqkv)
        got = attn.to_out[0](dit_block_attention(qkv, cos[:, 0], sin[:, 0],
                                                 frame_table(start_t, nvalid_t, *look),
                                                 attn.heads, BLOCK))
    return ref, got


# (B, W, heads, head_dim, starts, nvalids): windows at block starts and off them (5, 30),
# several query tiles (140, 200), padding frames, a 1-frame window, a row of padding only
CASES = [(3, 96, 2, 16, [0, 24, 48], [96, 70, 5]), (2, 140, 2, 32, [5, 0], [140, 100]),
         (2, 50, 3, 16, [0, 30], [50, 31]), (1, 1, 1, 16, [48], [1]),
         (2, 200, 1, 64, [72, 0], [200, 0])]


LOOKS = [(0, 0), (1, 0), (0, 1), (1, 1)]  # (look_backward, look_ahead) blocks


@pytest.mark.parametrize("look", LOOKS, ids=lambda k: f"lb{k[0]}la{k[1]}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}w{c[1]}h{c[2]}d{c[3]}")
def test_kernel_matches_module(case: tuple, look: tuple[int, int]) -> None:
    b, w, heads, head_dim, start, nvalid = case
    attn = _attention(heads, head_dim, seed=w)
    x = torch.randn(b, w, heads * head_dim, generator=torch.Generator().manual_seed(w)).to(DEVICE)
    ref, got = _both(attn, x, start, nvalid, look)
    assert got.shape == ref.shape and torch.isfinite(got).all()
    # the whole output, padding queries included (they see their blocks' keys, as the mask)
    assert (got - ref).abs().max() <= 2e-5, float((got - ref).abs().max())
    # the rotary and the mask both matter: without them the module gives something else
    if w > 1:
        plain = qwen2_5_omni_dit_attention_mask(torch.zeros(b, w, dtype=torch.long,
                                                            device=DEVICE),
                                                torch.ones(b, w, dtype=torch.bool, device=DEVICE),
                                                BLOCK, 0, 0)
        cos, sin = _rope(torch.zeros(b, dtype=torch.long, device=DEVICE), w, head_dim,
                         torch.float32)
        with torch.no_grad():
            other = attn(x, (torch.ones_like(cos), torch.zeros_like(sin)), plain)
        assert (other - ref).abs().max() > 1e-3


def test_validation() -> None:
    attn = _attention(2, 16, seed=0)
    qkv = torch.zeros(1, 24, 96, device=DEVICE)
    cos = sin = torch.zeros(1, 24, 8, device=DEVICE)
    frames = frame_table(torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.long), 0, 0)
    frames = frames.to(DEVICE)
    assert dit_block_attention(qkv, cos, sin, frames, attn.heads, BLOCK).shape == (1, 24, 32)
    with pytest.raises(ValueError, match="qkv"):
        dit_block_attention(qkv[..., :90], cos, sin, frames, 2, BLOCK)
    with pytest.raises(ValueError, match="cos/sin"):
        dit_block_attention(qkv, cos[:, :20], sin[:, :20], frames, 2, BLOCK)
    with pytest.raises(ValueError, match="frames"):
        dit_block_attention(qkv, cos, sin, frames.long(), 2, BLOCK)
    assert supported(16) and supported(64) and not supported(8) and not supported(48)
    with pytest.raises(ValueError, match="attention"):
        Qwen2_5OmniFastDiT(tiny_token2wav_pair()[1].code2wav_dit_model, attention="flash")


def _ode_inputs(spec: Qwen2_5OmniDiTSpec, width: int, starts: list[int], nvalids: list[int],
                seed: int) -> tuple[torch.Tensor, ...]:
    """Random (noise, codes, spk, cond, start, nvalid) for Qwen2_5OmniFastDiT.sample."""
    g, r = torch.Generator().manual_seed(seed), len(starts)
    return (torch.randn(r, width, spec.mel_dim, generator=g).to(DEVICE),
            torch.randint(0, spec.num_embeds, (r, width // spec.repeats), generator=g).to(DEVICE),
            torch.randn(r, 2, spec.enc_dim, generator=g).to(DEVICE),
            torch.randn(r, spec.enc_emb_dim, generator=g).to(DEVICE),
            torch.tensor(starts, device=DEVICE), torch.tensor(nvalids, device=DEVICE))


def test_fast_dit_block_equals_sdpa() -> None:
    """A whole ODE (CFG rows, padded windows) with the kernel vs with SDPA; 3 grid points (8
    evaluations, not 36: the interpreter is slow)."""
    dit = tiny_token2wav_pair()[1].code2wav_dit_model.to(DEVICE)
    block = Qwen2_5OmniFastDiT(dit, num_steps=3, attention="block")
    sdpa = Qwen2_5OmniFastDiT(dit, num_steps=3, attention="sdpa")
    assert block.attention == "block" and block.block_frames == BLOCK and sdpa.block_frames == 0
    inputs = _ode_inputs(dit.spec, 96, [0, 24, 48], [96, 72, 40], seed=3)
    with torch.inference_mode():
        ref = sdpa.sample(*inputs)
        got = block.sample(*inputs)
    assert ref.abs().max() > 0.1 and not got[2, 40:].any()  # padding frames stay zero
    assert (got - ref).abs().max() <= 1e-4, float((got - ref).abs().max())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_bf16_real_shapes() -> None:
    """bf16 at the real DiT's heads (16 x 64), a 360-frame window: within bf16 rounding of the
    module run in bf16, and much closer to an fp32 run than bf16 SDPA's own error allows."""
    attn = _attention(16, 64, seed=1)
    x = torch.randn(4, 360, 1024, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    for look in ((0, 0), (1, 0), (0, 1)):
        ref32, got32 = _both(attn, x, [0, 24, 48, 96], [360, 360, 300, 17], look)
        assert (got32 - ref32).abs().max() <= 2e-5
        ref16, got16 = _both(attn.to(torch.bfloat16), x.bfloat16(), [0, 24, 48, 96],
                             [360, 360, 300, 17], look)
        attn.float()
        err_kernel = (got16.float() - ref32).abs().max()
        err_sdpa = (ref16.float() - ref32).abs().max()
        assert err_kernel <= 2 * err_sdpa + 1e-3, (float(err_kernel), float(err_sdpa))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cuda_gemm_gelu_epilogue_is_tanh(dtype: torch.dtype) -> None:
    """code2wav_fast._dit_layer relies on CUDA's torch._addmm_activation(use_gelu=True) being the
    DiT's tanh GELU (the CPU version is the erf one, so the CPU path does not use it)."""
    g = torch.Generator().manual_seed(0)
    # pre-activations ~ N(0, 1): where the two GELUs differ
    x, w, b = (torch.randn(*s, generator=g).to(DEVICE, dtype) / 32 ** 0.5 for s in (
        (512, 1024), (2048, 1024), (2048,)))
    got = torch._addmm_activation(b, x, w.t(), use_gelu=True).float()
    lin = torch.nn.functional.linear(x.float(), w.float(), b.float())
    tanh = torch.nn.functional.gelu(lin, approximate="tanh")
    erf = torch.nn.functional.gelu(lin)
    tol = 1e-4 if dtype == torch.float32 else 0.03  # fp32 GEMM (no TF32) / bf16 rounding
    assert (got - tanh).abs().max() <= tol
    if dtype == torch.float32:  # bf16 rounding (~1e-2) would hide the GELUs' <= 5e-4 gap
        far = (tanh - erf).abs() > 2e-4  # where the two GELUs differ most
        assert far.sum() > 1000
        assert (got - tanh).abs()[far].max() < 0.2 * (tanh - erf).abs()[far].min()


def test_fast_dit_block_compiled_equals_eager() -> None:
    """The kernel as a custom op inside the inductor-compiled layer function (the CUDA graphs'
    path): the same ODE as eager (CPU inductor here; 2 grid points, 4 evaluations)."""
    dit = tiny_token2wav_pair()[1].code2wav_dit_model.to(DEVICE)
    block = Qwen2_5OmniFastDiT(dit, num_steps=2, attention="block")
    inputs = _ode_inputs(dit.spec, 48, [0, 24], [48, 30], seed=5)
    with torch.inference_mode():
        eager = block.sample(*inputs)
        compiled = block.sample(*inputs, compiled=True)
    assert eager.abs().max() > 0.1 and not compiled[1, 30:].any()
    assert (compiled - eager).abs().max() <= 1e-5, float((compiled - eager).abs().max())
