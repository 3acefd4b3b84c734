"""Programmatic dependent launch (PDL, Hopper and later) for the decode step's Triton kernels.

A decode layer at batch 1 is a chain of ~9 short kernels; each one otherwise starts only after
the one before it has drained, and ramps up on an idle GPU. Launched with PDL, a kernel's
programs become resident while the kernel before it finishes: they load what no kernel of the
step writes (weights) and then wait (`griddepcontrol.wait`) for the previous kernel's results.

NOTE (ordering): every PDL kernel calls `pdl_wait` unconditionally, before its first read of
anything a kernel of this step writes and before its first store. Only after that wait does it
let the next kernel launch (`launch_dependents`), so a kernel's pre-wait loads can overlap only
with the kernel right before it: everything earlier is complete by then. Loads before the wait
are therefore limited to weights and other tensors written before the step began, or two or
more kernels earlier.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

_INTERPRET = triton.knobs.runtime.interpret  # Triton's own TRITON_INTERPRET


@functools.lru_cache(maxsize=8)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def pdl_kwargs(device: torch.device, enabled: bool = True) -> dict[str, Any]:
    """Extra launch arguments of a PDL-aware kernel: {} (plain launch) or PDL on. enabled:
    the caller's switch (EngineConfig.pdl, threaded down by the decoder layers)."""
    if not enabled or _INTERPRET or device.type != "cuda":
        return {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    return pdl_flags(True, _capability(index))


def pdl_flags(enabled: bool, capability: tuple[int, int] | None) -> dict[str, Any]:
    """pdl_kwargs for a device of this compute capability (None: not a CUDA device). NOTE: the
    kernels compiled ahead (engine/kernels_ahead.py) pass the capability that their lister read
    in the stage's process, so both launches decide here."""
    if not enabled or _INTERPRET or capability is None or capability[0] < 9:
        return {}
    return {"PDL": True, "launch_pdl": True}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait for the previous kernel's results, then let the next kernel launch (PDL only)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
