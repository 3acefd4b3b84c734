"""CUDA streams the engines hand their stages and graph captures: private ones (never shared
with another holder in the process) and green-context ones (kernels on a share of the SMs)."""

from __future__ import annotations

import functools
import gc
import warnings

import torch

_HELD_STREAMS: dict[int, set[int]] = {}  # device index -> raw CUDA streams handed out


class _GivesBackRaw:
    """Mixed into torch.cuda.Stream (_private_class): the object gives its raw stream back to
    private_stream() when freed.

    NOTE (why __del__, not weakref.finalize): torch.Stream's C type keeps a weakref list, but
    torch.cuda.Stream's deallocator (THCPStream_dealloc, torch 2.11) frees the object without
    clearing it. A weakref to a CUDA stream is then left pointing at freed memory: its callback
    never runs, and touching it later crashes. Seen as the SIGSEGV at exit of multi-GPU and
    tensor-parallel processes (weakref.finalize's at-exit pass, then the final garbage
    collection, cleared such a weakref: benchmarks/results/tp_exit_h200x2_session21_issue27_
    2026-11-28.txt). So nothing here takes a weakref to a stream."""

    __slots__ = ()

    def __del__(self) -> None:
        # (the set itself, not a module global: __del__ may run late in the interpreter's exit)
        held = getattr(self, "held_in", None)  # the set its raw stream is held in, if any
        if held is not None:
            held.discard(self.cuda_stream)


@functools.cache  # (one subclass per stream class: torch.cuda.Stream, a test's stand-in)
def _private_class(base: type) -> type:
    return type("PrivateStream", (_GivesBackRaw, base), {"__slots__": ("held_in",)})


def private_stream(device: torch.device, priority: int = 0) -> torch.cuda.Stream:
    """A CUDA stream that no other private_stream() caller of this process holds.

    priority: 0 (default) down to -3 (torch's range): lower runs sooner when kernels wait.

    NOTE: torch.cuda.Stream() hands out streams round-robin from a pool of 32 per priority, so
    a process that asks for many (one per graph capture, say) gets the same CUDA stream twice.
    cuBLAS keeps one workspace per stream and a CUDA graph bakes in the one of the stream it
    was captured on: graphs whose capture streams alias share a workspace, and replayed side by
    side (thinker/talker beside code2wav) their split-K kernels hang the GPU. Seen on the H100:
    code2wav's decoder, built after the AR stages' captures, got the talker's capture stream.
    """
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    held = _HELD_STREAMS.setdefault(index, set())
    for attempt in range(2):
        for _ in range(64):  # two passes over a pool of 32
            # (free for another holder once this one is gone: its graphs went with it)
            stream = _private_class(torch.cuda.Stream)(index, priority=priority)
            stream.held_in = None if stream.cuda_stream in held else held
            if stream.held_in is not None:
                held.add(stream.cuda_stream)
                return stream
        if attempt == 0:  # holders that only a cycle keeps alive (engines of finished tests)
            gc.collect()
    warnings.warn(f"cuda:{index}: every stream of torch's pool (32 per priority) is held by "
                  "live CUDA-graph runners or stages; this one shares a stream (graphs that "
                  "replay side by side on shared streams can hang the GPU)", stacklevel=2)
    return stream


def green_context_stream(device: torch.device, num_sms: int) -> tuple[object, torch.cuda.Stream]:
    """(green context, stream): kernels launched on the stream, or captured on it into a CUDA
    graph (wherever that graph is replayed), run on `num_sms` of the GPU's SMs only; the
    caller keeps the context alive as long as the stream. Needs torch >= 2.11 (beta API)."""
    try:
        from torch.cuda.green_contexts import GreenContext
    except ImportError as exc:
        raise ValueError(f"green contexts need torch >= 2.11 (torch {torch.__version__})") from exc
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    context = GreenContext.create(num_sms=num_sms, device_id=index)
    return context, context.Stream()
