"""Checkpoint tensors copied into CUDA parameters by several threads, staged through pinned
buffers (checkpoint.load_parameters uses it for every large copy to a GPU).

NOTE (why): a plain `param.copy_(tensor)` from the safetensors mmap is a pageable copy: the
driver stages it through a pinned buffer of its own on the calling thread, page faults on the
mmap included, one tensor after another. Here each of THREADS threads copies a chunk of the mmap
into a pinned buffer of its own (the memcpy and the page faults run outside the GIL, side by
side) and queues the chunk's DMA on a stream of its own; its two buffers alternate, so the next
chunk's memcpy overlaps the last one's DMA. A copy that also converts (a bf16 checkpoint into a
float32 vocoder) lands in a device buffer in the checkpoint's dtype and is converted there: a
plain copy_ would convert on the CPU first, on the calling thread.
"""

from __future__ import annotations

import queue
from concurrent.futures import Future, ThreadPoolExecutor

import torch

THREADS = 4
CHUNK_BYTES = 32 << 20  # one pinned buffer (two per thread)
MIN_BYTES = 1 << 20  # smaller tensors: one plain copy each (not worth a hand-over)
# the dtypes a staged copy converts between on the GPU
_WIDE_FLOATS = {torch.float16, torch.bfloat16, torch.float32, torch.float64}


class _Stager:
    """One thread's pinned buffers, CUDA stream and the events of its buffers' last DMAs."""

    def __init__(self, device: torch.device, after: torch.cuda.Stream) -> None:
        self.stream = torch.cuda.Stream(device)
        # the parameters were allocated and initialised on `after`: copy after that
        self.stream.wait_stream(after)
        self.buffers = [torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True)
                        for _ in range(2)]
        self.events: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0
        # a converting copy's chunk lands here first (stream order: the next chunk's DMA
        # comes after this one's conversion)
        self.landing: torch.Tensor | None = None

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        converts = dst.dtype != src.dtype
        if converts and self.landing is None:
            self.landing = torch.empty(CHUNK_BYTES, dtype=torch.uint8, device=dst.device)
        s = src.reshape(-1).view(torch.uint8)
        d = dst.view(-1) if converts else dst.view(-1).view(torch.uint8)
        for start in range(0, s.numel(), CHUNK_BYTES):  # (a multiple of every element size)
            n = min(CHUNK_BYTES, s.numel() - start)
            i, self.turn = self.turn, self.turn ^ 1
            if self.events[i] is not None:
                self.events[i].synchronize()  # this buffer's last DMA has read it
            buf = self.buffers[i][:n]
            buf.copy_(s[start:start + n])
            with torch.cuda.stream(self.stream):
                if converts:
                    first = start // src.element_size()
                    landed = self.landing[:n]
                    landed.copy_(buf, non_blocking=True)
                    d[first:first + n // src.element_size()].copy_(landed.view(src.dtype))
                else:
                    d[start:start + n].copy_(buf, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            self.events[i] = event


class DeviceUploads:
    """Copies into the parameters of one GPU (the first copy's), on THREADS threads. finish()
    waits for every copy to land (raising the first error) and gives the threads back."""

    def __init__(self) -> None:
        self.device: torch.device | None = None
        self.after: torch.cuda.Stream | None = None
        self.pool: ThreadPoolExecutor | None = None
        self.stagers: queue.SimpleQueue[_Stager] = queue.SimpleQueue()
        self.made: list[_Stager] = []
        self.futures: list[Future] = []

    def takes(self, dst: torch.Tensor, src: torch.Tensor) -> bool:
        """Whether dst.copy_(src) goes through here: a large contiguous CPU tensor into a
        contiguous tensor of its shape on this GPU, of its dtype or both 16-64-bit floating
        point (anything else, float8 included: a plain copy)."""
        return (dst.is_cuda and self.device in (None, dst.device)
                and src.device.type == "cpu"
                and (dst.dtype == src.dtype or _WIDE_FLOATS >= {dst.dtype, src.dtype})
                and dst.shape == src.shape and dst.is_contiguous() and src.is_contiguous()
                and src.numel() * src.element_size() >= MIN_BYTES)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst.copy_(src) (takes(dst, src) holds), landed by finish(); src must stay unchanged
        until then (this holds a reference)."""
        if self.pool is None:
            self.device = dst.device
            self.after = torch.cuda.current_stream(dst.device)  # the loading thread's
            self.pool = ThreadPoolExecutor(THREADS, thread_name_prefix="weights-upload")
        self.futures.append(self.pool.submit(self._copy, dst, src))

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        try:
            stager = self.stagers.get_nowait()
        except queue.Empty:  # (at most THREADS: one per busy thread)
            stager = _Stager(dst.device, self.after)
            self.made.append(stager)
        try:
            with torch.no_grad():
                stager.copy(dst, src)
        finally:
            self.stagers.put(stager)

    def finish(self) -> None:
        if self.pool is None:
            return
        try:
            for f in self.futures:
                f.result()
        finally:
            self.pool.shutdown(wait=True)
            for stager in self.made:
                stager.stream.synchronize()
            self.pool, self.futures, self.made = None, [], []
