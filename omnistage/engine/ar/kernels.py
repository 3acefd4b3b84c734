"""Per-layer kernel choices of a decoder (KernelOptions): the engine's ModelRunner derives them
from its EngineConfig and sets them on the model's layers when it binds the KV cache
(configure_kernels); a layer built outside an engine keeps the defaults."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class KernelOptions:
    """Which kernels a decoder layer runs. The defaults are the plain torch path, except where
    the Triton attention runs (CUDA), where the fused rope + KV write and the GEMVs are on."""

    compile: bool = False  # the torch.compile'd layer kernels (models/layers.py)
    # rope of q/k and the paged KV write in one Triton launch per layer (instead of rope in the
    # input kernel and two index_copy_). None: where the Triton attention runs; True forces it
    # (on the CPU it then needs the Triton interpreter)
    fused_rope_kv: bool | None = None
    # decode steps of <= gemv_max_rows rows: the dense parts of a layer in 4 Triton GEMV
    # launches (triton_gemv.py) instead of the norms around cuBLAS GEMMs; needs the fused rope
    # path. None: on CUDA, for layers whose shapes have measured configs (untuned Triton GEMVs
    # were up to 20% slower than cuBLAS); True forces it
    triton_gemv: bool | None = None
    # one row only: at 2-8 rows no Triton config reached cuBLAS
    # (measured: benchmarks/results/gemv_gpu_h100_m8_sweep_2026-11-22.json)
    gemv_max_rows: int = 1
    gemv_fused_reduce: bool = True  # split-K partials summed in the GEMV launch
    pdl: bool = True  # programmatic dependent launch of the Triton decode kernels (Hopper+)


def configure_kernels(model: nn.Module, options: KernelOptions) -> int:
    """Set `options` on every layer of `model` that takes them (a `kernels` attribute holding
    KernelOptions); returns how many layers did."""
    n = 0
    for module in model.modules():
        if isinstance(getattr(module, "kernels", None), KernelOptions):
            module.kernels = options
            n += 1
    return n
