"""The fused anti-aliased Snake Triton kernel vs the module's torch path (CPU via
TRITON_INTERPRET=1; on a CUDA machine the same tests run the compiled kernel)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before triton is imported: kernels then run in triton's numpy interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed")

from omnistage.models.qwen2_5_omni import token2wav_bigvgan  # noqa: E402
from omnistage.models.qwen2_5_omni.bigvgan_triton import (  # noqa: E402
    VARIANTS,
    anti_aliased_snake,
)
from omnistage.models.qwen2_5_omni.token2wav_bigvgan import (  # noqa: E402
    Qwen2_5OmniAntiAliasedSnake,
    Qwen2_5OmniToken2WavBigVGAN,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TINY_BIGVGAN = dict(mel_dim=80, upsample_initial_channel=64, resblock_kernel_sizes=[3],
                    resblock_dilation_sizes=[[1, 3, 5]], upsample_rates=[5, 3, 2, 2, 2, 2],
                    upsample_kernel_sizes=[11, 7, 4, 4, 4, 4])


@pytest.fixture(autouse=True)
def strict_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    # on a GPU, cuDNN's default TF32 convs would make the torch reference the inexact one
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


def _snake_module(channels: int, seed: int) -> Qwen2_5OmniAntiAliasedSnake:
    """An activation with non-trivial per-channel alpha, beta (the init's zeros hide swaps)."""
    torch.manual_seed(seed)
    m = Qwen2_5OmniAntiAliasedSnake(channels).to(DEVICE)
    with torch.no_grad():
        m.act.alpha.normal_(0.0, 0.7)
        m.act.beta.normal_(0.0, 0.7)
    return m


def _torch_path(m: Qwen2_5OmniAntiAliasedSnake, x: torch.Tensor) -> torch.Tensor:
    old, m.triton = m.triton, "off"  # so that a CUDA run also compares to torch
    try:
        with torch.no_grad():
            return m(x)
    finally:
        m.triton = old


# (B, C, L, block): L = 1..5 hit both padded ends in one tile; small blocks cross tiles;
# 75 short rows fill several row tiles, the last one partly
SHAPES = [(1, 1, 1, None), (2, 3, 2, None), (1, 2, 3, None), (2, 1, 4, None), (1, 3, 5, None),
          (3, 2, 16, None), (2, 3, 37, None), (1, 2, 50, 16), (5, 15, 3, None)]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:3])) + f"b{s[3]}")
def test_matches_module(variant: str, shape: tuple) -> None:
    B, C, L, block = shape
    m = _snake_module(C, seed=L)
    x = 2.0 * torch.randn(B, C, L, generator=torch.Generator().manual_seed(L)).to(DEVICE)
    ref = _torch_path(m, x)
    assert ref.shape == (B, C, L)
    assert (ref - x).abs().max() > 0.1  # the snake term and the filters do something
    y = anti_aliased_snake(x, m.act.alpha.detach(), m.act.beta.detach(), m.filter, variant,
                           block=block)
    assert y.shape == ref.shape and y.dtype == ref.dtype
    assert (y - ref).abs().max() <= 1e-5


def test_gather_tiles_overlap() -> None:
    # the gather variant's tile serves block - 6 outputs: 8 -> 2 per tile, many tiles
    m = _snake_module(2, seed=0)
    x = torch.randn(1, 2, 23, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    y = anti_aliased_snake(x, m.act.alpha.detach(), m.act.beta.detach(), m.filter, "gather",
                           block=8)
    assert (y - _torch_path(m, x)).abs().max() <= 1e-5


def test_input_checks() -> None:
    m = _snake_module(3, seed=0)
    a, b, x = m.act.alpha.detach(), m.act.beta.detach(), torch.randn(1, 3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="x"):
        anti_aliased_snake(x[0], a, b, m.filter)
    with pytest.raises(ValueError, match="alpha"):
        anti_aliased_snake(x, a[:2], b, m.filter)
    with pytest.raises(ValueError, match="filt"):
        anti_aliased_snake(x, a, b, m.filter[:10])
    with pytest.raises(ValueError, match="variant"):
        anti_aliased_snake(x, a, b, m.filter, "fast")


def test_cpu_dispatch_is_torch() -> None:
    # the module's CPU path stays the torch one, whatever its triton option says
    m = _snake_module(2, seed=0).cpu()
    assert token2wav_bigvgan._triton_variant(torch.zeros(1, 2, 4), m.act) is None


@pytest.mark.parametrize("variant", VARIANTS)
def test_vocoder_matches_torch_path(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    voc = Qwen2_5OmniToken2WavBigVGAN(TINY_BIGVGAN).eval()
    with torch.no_grad():  # drawn on the CPU: the same vocoder on a GPU (its RNG differs)
        for name, p in voc.named_parameters():
            if name.endswith((".alpha", ".beta")):
                p.normal_(0.0, 0.5)
        voc.conv_pre.weight.mul_(8)  # torch's init leaves the output nearly deaf to the mel
    voc.to(DEVICE)
    mel = torch.randn(2, 80, 3, generator=torch.Generator().manual_seed(3)).to(DEVICE) - 4
    voc.set_triton("off")
    with torch.no_grad():
        ref = voc(mel)
    voc.set_triton("auto")
    assert ref.shape == (2, 3 * 240)
    assert ref.abs().max() > 0.05 and ref.abs().max() < 1.0  # non-trivial and unclipped
    # the module dispatch, forced onto the kernel (interpreted on the CPU)
    monkeypatch.setattr(token2wav_bigvgan, "_triton_variant", lambda x, act: variant)
    with torch.no_grad():
        fused = voc(mel)
    assert (fused - ref).abs().max() <= 1e-5
