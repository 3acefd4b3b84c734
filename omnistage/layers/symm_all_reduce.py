"""A one-shot all-reduce over symmetric memory for the small all-reduces of a tensor-parallel
decode step (CUDA, peer access between the ranks' GPUs).

NOTE (why): a decode step of the 30B Qwen3-Omni thinker makes 96 all-reduces of a few KB each;
NCCL's ring all-reduce is latency-bound there (measured: TP=2 slower than TP=1). With the
ranks' GPUs peer-accessible, each rank copies its partial sum into a buffer every rank can
read, and reads and adds the others' directly: one kernel, no NCCL. torch provides the kernel
(torch.ops.symm_mem.one_shot_all_reduce*, torch.distributed._symmetric_memory) and it needs no
NVLink multicast (off on the lent machines: TORCH_SYMM_MEM_DISABLE_MULTICAST=1).

NOTE (groups): our groups are c10d backends not registered with torch.distributed, so the
symmetric memory learns the group from us: a name unique to the group (rank 0 draws it and
shares it through the group's store), with the rank, size and store
(_SymmetricMemory.set_group_info), and a c10d ProcessGroup of that name over the group's
NCCL backend, registered where c10d resolves names (torch 2.11's rendezvous looks the name up
there). The buffer is allocated and exchanged (rendezvous: a collective over the store and the
ranks' IPC handles) once, when the group is made, outside any CUDA graph; each all-reduce
then only launches the kernel, so it can be captured. The kernel ends with a barrier over the
ranks, so the next all-reduce may reuse the buffer.

Written against torch 2.11's API (the GPU machines'): set_backend / one_shot_all_reduce_copy_out
are used when present, with the older equivalents otherwise."""

from __future__ import annotations

import logging
import uuid
from typing import Any

import torch

log = logging.getLogger("omnistage.tp")

ALL_REDUCE_MODES = ("auto", "nccl", "symm_mem")
# the symmetric buffer: large enough for a decode step's rows (64 rows x 4096 bf16 = 512 KiB
# with room); larger tensors (prefill chunks) take NCCL's ring, which is bandwidth-optimal
BUFFER_BYTES = 4 << 20
# "auto": one-shot up to this size (past it each rank reading every peer's whole tensor loses
# to the ring's bandwidth)
AUTO_MAX_BYTES = 512 << 10
DTYPES = (torch.float32, torch.bfloat16)  # the kernel's (AT_DISPATCH_FLOAT_AND_BFLOAT16)
ALIGN = 16  # bytes: the kernel's widest vector; sizes are required to be a multiple
_STORE_KEY = "omnistage_symm_mem_group"


def check_mode(mode: Any) -> str:
    """The all-reduce mode, or ValueError naming tp_all_reduce."""
    if mode not in ALL_REDUCE_MODES:
        raise ValueError(f"tp_all_reduce: {mode!r}; one of {', '.join(ALL_REDUCE_MODES)}")
    return mode


def unavailable_reason(devices: list[torch.device]) -> str | None:
    """Why the one-shot all-reduce cannot run for ranks on `devices` (None: it can): it needs
    CUDA GPUs that reach each other's memory, and torch's symmetric-memory kernel."""
    if any(d.type != "cuda" for d in devices):
        return "the ranks are not all on CUDA GPUs"
    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_out"):
        return f"torch {torch.__version__} has no symm_mem.one_shot_all_reduce_out"
    indices = [d.index or 0 for d in devices]
    for a in indices:
        for b in indices:
            if a != b and not torch.cuda.can_device_access_peer(a, b):
                return f"cuda:{a} cannot access cuda:{b}'s memory (no peer access)"
    return None


def resolve_mode(mode: str, devices: list[torch.device]) -> str:
    """What the group of ranks on `devices` uses: "nccl" (the group's own all-reduce; always
    on the CPU), "symm_mem" (one-shot for tensors that fit its buffer) or "auto" (one-shot for
    small tensors; it resolves to "nccl" where one-shot cannot run). A forced "symm_mem" that
    cannot run is a ValueError naming tp_all_reduce."""
    check_mode(mode)
    if mode == "nccl" or all(d.type == "cpu" for d in devices):
        return "nccl"  # (gloo on the CPU: the group's all-reduce, whatever the mode)
    reason = unavailable_reason(devices)
    if reason is None:
        return mode
    if mode == "symm_mem":
        raise ValueError(f"tp_all_reduce: 'symm_mem' cannot run here: {reason}")
    log.info("tp_all_reduce auto: NCCL (%s)", reason)
    return "nccl"


def _register_group(name: str, store: Any, rank: int, size: int, backend: Any) -> Any:
    """A c10d ProcessGroup named `name` over our NCCL backend, in c10d's registry of groups."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import _register_process_group
    group = dist.ProcessGroup(store, rank, size)
    nccl = dist.ProcessGroup.BackendType.NCCL
    group._set_default_backend(nccl)
    group._register_backend(torch.device("cuda"), nccl, backend)
    group._set_group_name(name)
    _register_process_group(name, group)
    return group


class SymmAllReduce:
    """One rank's one-shot all-reduce of a group (a collective to build: every rank builds it
    in the same order, right after joining the group)."""

    def __init__(self, store: Any, rank: int, size: int, device: torch.device,
                 max_bytes: int, backend: Any, buffer_bytes: int = BUFFER_BYTES) -> None:
        import torch.distributed._symmetric_memory as symm_mem
        from torch._C._distributed_c10d import _SymmetricMemory
        if device.type != "cuda":
            raise ValueError(f"tp_all_reduce: symm_mem needs CUDA ranks, got {device}")
        self.max_bytes = min(max_bytes, buffer_bytes)
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = device = torch.device("cuda", index)  # (compared with tensors' devices)
        # the CUDA (peer-memory) allocator, not NVSHMEM's, which would need a default group.
        # torch registers the default backend directly, and set_backend only knows the others:
        # set_backend("CUDA") where CUDA already is the backend raises (torch 2.11)
        current = symm_mem.get_backend(device) if hasattr(symm_mem, "get_backend") else "CUDA"
        if current != "CUDA":
            symm_mem.set_backend("CUDA")
        if rank == 0:
            name = f"omnistage-tp-{uuid.uuid4().hex}"
            store.set(_STORE_KEY, name)
        else:
            name = store.get(_STORE_KEY).decode()
        self.group_name = name
        from torch.distributed import PrefixStore  # (its keys apart from the group's own)
        _SymmetricMemory.set_group_info(name, rank, size, PrefixStore(name, store))
        # torch 2.11's rendezvous resolves the name as a registered process group: ours, with
        # the group's NCCL backend behind it (the name is unique to the group; close()
        # unregisters it)
        self.process_group = _register_group(name, store, rank, size, backend)
        with torch.cuda.device(device):
            self.buffer = symm_mem.empty(buffer_bytes, dtype=torch.uint8, device=device)
            # (collective: every rank of the group makes this call)
            self.handle = _SymmetricMemory.rendezvous(self.buffer, name)
        torch.cuda.synchronize(device)
        self._copy_out = getattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out", None)
        self.num_calls = 0  # one-shot all-reduces issued (eager calls and graph captures)

    def accepts(self, x: torch.Tensor) -> bool:
        """Whether x takes the one-shot path (shapes are fixed inside a captured graph, so a
        graph always replays the path its capture took)."""
        nbytes = x.numel() * x.element_size()
        # (the kernel takes the buffer's and x's common vector width: both 16-byte aligned)
        return (x.device == self.device and x.dtype in DTYPES and 0 < nbytes <= self.max_bytes
                and nbytes % ALIGN == 0 and x.data_ptr() % ALIGN == 0 and x.is_contiguous())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over the ranks, in place (x must be accepted); returns x."""
        symm = self.buffer[:x.numel() * x.element_size()].view(x.dtype).view(x.shape)
        if self._copy_out is not None:  # the copy into the buffer inside the same kernel
            self._copy_out(symm, x, "sum", self.group_name, x)
        else:
            symm.copy_(x)
            torch.ops.symm_mem.one_shot_all_reduce_out(symm, "sum", self.group_name, x)
        self.num_calls += 1
        return x

    def close(self) -> None:
        """Before the group's communicator shuts: the peer buffer is released and the group
        leaves c10d's registry, which (a C++ static) would otherwise keep the closed group's
        NCCL backend alive to the process's very end."""
        from torch._C._distributed_c10d import _unregister_process_group
        self.handle = self.buffer = None
        if self.process_group is not None:
            _unregister_process_group(self.group_name)
            self.process_group = None
