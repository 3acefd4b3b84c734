"""`gpu_memory_budget`: the device memory, in GiB, a pipeline may use on its GPU.

It counts what NVML counts: everything in use on the device (the CUDA context, kernels' code,
workspaces, the caching allocator's pool), not only the allocator's tensors, so a budget of 24
fits a 24 GB card. Other processes' memory on the device counts too.

How it is kept:
  - the caching allocator is capped at the budget less what lies outside it (measured when the
    budget is set, plus a margin for modules and workspaces loaded later): going over is an
    out-of-memory error, not a silent overrun;
  - each AR stage's KV blocks are sized from the room left once its weights are loaded: the
    allocator's cap less what the allocator holds, the weights of the stages not built yet
    (read from the checkpoint's headers) and a reserve for what comes after the KV caches
    (activations, the decode and prefill graphs' pools, the code2wav stage's buffers and
    graphs); the thinker takes THINKER_SHARE of that room, the talker the rest, each at most
    what max_num_seqs x max_model_len needs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from omnistage.checkpoint import safetensors_files

log = logging.getLogger(__name__)

GIB = 1 << 30
MAX_BUDGET_GIB = 4096.0
# after the KV caches: activations (max_num_batched_tokens rows), decode/prefill graph pools,
# code2wav's windows and graph pools, compile workspaces
RESERVE_BYTES = 5 * GIB
OUTSIDE_ALLOCATOR_MARGIN = GIB  # kernels loaded later (compiled, Triton, cuBLAS)
THINKER_SHARE = 0.5
# under a budget, code2wav's largest batch bucket unless the user sets code2wav_max_batch: its
# graph pools grow with the bucket
CODE2WAV_MAX_BATCH = 8
# code2wav keeps float32 weights of parts that the checkpoint may store in 16 bits
WEIGHT_GROWTH = {"gen": 2.0, "ar": 1.0}


def pop_memory_budget(opts: dict[str, Any]) -> float | None:
    """The `gpu_memory_budget` constructor keyword (GiB, a number in (0, 4096]) or None."""
    gib = opts.pop("gpu_memory_budget", None)
    if gib is None:
        return None
    if isinstance(gib, bool) or not isinstance(gib, int | float) or not 0 < gib <= MAX_BUDGET_GIB:
        raise ValueError(f"gpu_memory_budget: {gib!r}; a number of GiB in (0, {MAX_BUDGET_GIB:g}]")
    return float(gib)


def fp8_projection(name: str) -> bool:
    """A decoder projection or LM head that quantization="fp8" stores in one byte per weight
    (models/fp8_decoder.py)."""
    return (".layers." in name and name.endswith("proj.weight")) \
        or name.endswith("lm_head.weight")


def checkpoint_bytes(path, prefix: str, one_byte: Callable[[str], bool] | None = None) -> int:
    """Bytes of the checkpoint's tensors whose names start with `prefix` (headers only); those
    `one_byte` selects counted at one byte per element (quantised at load)."""
    total = 0
    for f in safetensors_files(Path(path)):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                if name.startswith(prefix):
                    sl = st.get_slice(name)
                    n = 1
                    for d in sl.get_shape():
                        n *= d
                    fp8 = one_byte is not None and one_byte(name)
                    total += n * (1 if fp8 else _DTYPE_BYTES.get(sl.get_dtype(), 4))
    return total


_DTYPE_BYTES = {"F64": 8, "F32": 4, "I64": 8, "I32": 4, "F16": 2, "BF16": 2, "I16": 2,
                "U8": 1, "I8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


class MemoryBudget:
    """One pipeline's budget on one CUDA device (see the module note)."""

    def __init__(self, gib: float, device: torch.device, pending: dict[str, int]) -> None:
        if device.type != "cuda":
            raise ValueError(f"gpu_memory_budget: set for device {device}; it budgets a GPU")
        if device.index is None:  # the allocator's cap takes an index
            device = torch.device("cuda", torch.cuda.current_device())
        self.device, self.gib = device, gib
        self.budget_bytes = int(gib * GIB)
        self.pending = dict(pending)  # stage name -> weight bytes not loaded yet
        in_use = self.in_use()
        outside = in_use - torch.cuda.memory_reserved(device) + OUTSIDE_ALLOCATOR_MARGIN
        total = torch.cuda.get_device_properties(device).total_memory
        self.allocator_cap = self.budget_bytes - outside
        if self.room() <= 0:
            raise ValueError(
                f"gpu_memory_budget: {gib:g} GiB cannot hold the pipeline: {in_use / GIB:.2f} "
                f"GiB in use, {sum(self.pending.values()) / GIB:.2f} GiB of weights to load, "
                f"{RESERVE_BYTES / GIB:.1f} GiB reserved for activations and graphs (try "
                "quantization='fp8')")
        torch.cuda.set_per_process_memory_fraction(self.allocator_cap / total, device)
        log.info("gpu_memory_budget %.1f GiB on %s: allocator capped at %.2f GiB", gib, device,
                 self.allocator_cap / GIB)

    def in_use(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def room(self) -> int:
        """Bytes the KV caches may still take under the allocator's cap."""
        return (self.allocator_cap - torch.cuda.memory_reserved(self.device)
                - sum(self.pending.values()) - RESERVE_BYTES)

    def loaded(self, stage: str) -> None:
        """`stage`'s weights are on the device now (no longer pending)."""
        self.pending.pop(stage, None)

    def kv_blocks(self, stage: str, share: float, bytes_per_block: int, want: int,
                  min_blocks: int) -> int:
        """KV blocks for `stage`: `share` of the room left, at most `want`, at least
        `min_blocks` (one max_model_len sequence) or a ValueError naming the budget."""
        self.loaded(stage)
        room = self.room()
        n = min(want, max(0, int(room * share)) // bytes_per_block)
        if n < min_blocks:
            raise ValueError(
                f"gpu_memory_budget: {self.gib:g} GiB leaves {max(room, 0) / GIB:.2f} GiB for "
                f"the KV caches; {stage} needs {min_blocks * bytes_per_block / GIB:.2f} GiB for "
                "one max_model_len sequence: raise the budget, lower max_model_len or use "
                "quantization='fp8'")
        log.info("gpu_memory_budget: %s gets %d KV blocks (%.2f GiB)", stage, n,
                 n * bytes_per_block / GIB)
        return n
