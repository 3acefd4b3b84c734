"""Weight-only FP8: float8_e4m3fn weights with per-output-row fp32 scales, activations stay in
their dtype (W8A16). Halves the weights' memory and their read traffic at decode.

  quantize_fp8      w -> (e4m3 w / scale, scale = row amax / 448)
  Fp8Linear         a dense linear on such weights (Triton GEMM on CUDA, dequantise on CPU)
  quantize_linears  swap a module's nn.Linear children for Fp8Linear in place

Quantise after moving a module to its device and dtype: Module.to(dtype) would cast the fp8
weights and the fp32 scales too (forward then raises).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
FP8_BACKENDS = ("auto", "torch", "triton")


def quantize_fp8(w: Tensor, combine_row_amax: Callable[[Tensor], Tensor] | None = None
                 ) -> tuple[Tensor, Tensor]:
    """w [..., N, K] -> (e4m3fn [..., N, K], fp32 scale [..., N] = row amax / 448).

    Dequantised weight = fp8 * scale (round to nearest); an all-zero row gets scale 0.
    combine_row_amax: w holds a slice of each row (a row-parallel weight under tensor
    parallelism); it turns the slice's amax into the whole row's (a max over the ranks)."""
    if w.dim() < 2 or not w.dtype.is_floating_point or w.dtype == FP8_DTYPE:
        raise ValueError(f"w: {tuple(w.shape)} {w.dtype}, expected a float matrix [..., N, K]")
    w32 = w.float() if w.dtype != torch.float32 else w.clone()  # worked on in place
    amax = torch.linalg.vector_norm(w32, ord=float("inf"), dim=-1)  # row amax
    if combine_row_amax is not None:
        amax = combine_row_amax(amax.contiguous())
    scale = amax / FP8_MAX
    w32.div_(scale.clamp_min(torch.finfo(torch.float32).tiny)[..., None])
    return w32.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def dequantize_fp8(w: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """fp8 [..., N, K] * scale [..., N] -> dtype (the product in fp32, rounded once)."""
    return (w.float() * scale[..., None]).to(dtype)


class Fp8Linear(nn.Module):
    """y = x @ (weight * weight_scale).T + bias with weight [N, K] float8_e4m3fn and
    weight_scale [N] fp32 (buffers); bias [N] in the activation dtype or None.

    `backend`: "auto" (the Triton W8A16 GEMM on CUDA when installed, else dequantise + matmul),
    "torch" (dequantise + F.linear) or "triton"."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.backend = "auto"
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=FP8_DTYPE,
                                                   device=device))
        self.register_buffer("weight_scale", torch.zeros(out_features, dtype=torch.float32,
                                                         device=device))
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device),
                                  requires_grad=False) if bias else None)

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        """Quantise an nn.Linear's weight (its bias kept as is, in its dtype)."""
        w = linear.weight
        out = cls(linear.in_features, linear.out_features, linear.bias is not None,
                  device=w.device, dtype=w.dtype)
        out.weight, out.weight_scale = quantize_fp8(w)
        if linear.bias is not None:
            out.bias.copy_(linear.bias)
        return out

    def dequantized_weight(self, dtype: torch.dtype) -> Tensor:
        return dequantize_fp8(self.weight, self.weight_scale, dtype)

    def forward(self, x: Tensor) -> Tensor:
        """x [..., K] -> [..., N] in x.dtype."""
        if self.weight.dtype != FP8_DTYPE or self.weight_scale.dtype != torch.float32:
            raise ValueError(f"weight {self.weight.dtype}, weight_scale "
                             f"{self.weight_scale.dtype}: expected {FP8_DTYPE} and float32 "
                             "(was the module cast after quantising?)")
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x: shape {tuple(x.shape)}, expected [..., {self.in_features}]")
        if self.backend not in FP8_BACKENDS:
            raise ValueError(f"backend: {self.backend!r}, expected one of {FP8_BACKENDS}")
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        if self.backend == "torch" or (self.backend == "auto" and not _use_triton(x)):
            return F.linear(x, self.dequantized_weight(x.dtype), bias)
        from omnistage.layers import moe_triton  # lazy: triton is optional on CPU

        flat = x.reshape(-1, self.in_features)
        out = moe_triton.fp8_linear(flat, self.weight, self.weight_scale, bias)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weight=fp8_e4m3fn")


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _use_triton(x: Tensor) -> bool:
    return x.is_cuda and triton_installed()


def quantize_linears(module: nn.Module,
                     filter: Callable[[str, nn.Linear], bool] | None = None) -> list[str]:
    """Replace every nn.Linear under `module` (qualified name, module) -> filter True, or all
    when filter is None, by Fp8Linear.from_linear, in place. Returns the replaced names.
    A weight shared with another module (tied embeddings) is copied, no longer shared."""
    targets = [(name, child) for name, child in module.named_modules()
               if isinstance(child, nn.Linear) and name and (filter is None or filter(name, child))]
    for name, linear in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, attr, Fp8Linear.from_linear(linear))
    return [name for name, _ in targets]
