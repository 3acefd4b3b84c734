"""Graph services of the non-AR engine: shape buckets, captured graphs in segments, one memory
pool, private capture streams, green-context capture for steps beside other stages, held-shape
claims for jobs in progress, compile-or-fall-back before capture, and their statistics.

A model's graph cache is keyed (batch bucket, shape key, beside). A graph is a list of segments
(e.g. one per ODE interval) replayed back to back, or one by one when a step runs in parts with
other graphs between them; the segments share the memory pool, so state left by one segment's
captured run is read by the next."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Hashable
from typing import Any, Literal

import torch

from omnistage.engine.ar.cuda_graphs import smallest_bucket, warm_and_capture
from omnistage.engine.streams import green_context_stream, private_stream

BUCKETS = (1, 2, 4, 8, 16, 32)


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket >= n (n <= max(buckets))."""
    bucket = smallest_bucket(n, buckets)
    if bucket is not None:
        return bucket
    raise ValueError(f"batch: {n} rows exceed the largest bucket {max(buckets)}")


class SegmentGraph:
    """Captured segments with their static input buffers and output; `state` is what the
    segments pass each other (it lives in the graph pool)."""

    def __init__(self, inputs: dict[str, torch.Tensor]) -> None:
        self.inputs = inputs
        self.segments: list[torch.cuda.CUDAGraph] = []
        self.output: Any = None
        self.state: Any = None

    def replay(self) -> None:
        for graph in self.segments:
            graph.replay()


class GraphCache:
    """Graphs of one model on one device (not thread-safe: one launcher at a time).

    enabled: capture at all (CUDA only). free_sms: SMs a step `beside` other stages leaves to
    them: its graphs are captured on a green context's stream, which binds their kernels to
    the other SMs wherever they replay; 0 = off; "auto" = a quarter of the GPU's, in multiples
    of 8 (0 with a warning where green contexts are missing). beside_min_bucket: smaller
    batches keep every SM (their small kernels leave SMs idle anyway).
    """

    def __init__(self, device: torch.device, enabled: bool, buckets: tuple[int, ...] = BUCKETS,
                 free_sms: int | Literal["auto"] = 0, beside_min_bucket: int = 1,
                 name: str = "gen") -> None:
        if not buckets or sorted(set(buckets)) != list(buckets) or buckets[0] < 1:
            raise ValueError(f"buckets: increasing positive ints, got {buckets!r}")
        if enabled and device.type != "cuda":
            raise ValueError("cuda_graphs: needs a CUDA model")
        self.device, self.enabled, self.buckets = device, bool(enabled), tuple(buckets)
        self.name, self.beside_min_bucket = name, beside_min_bucket
        self.graphs: dict[tuple[Hashable, ...], SegmentGraph] = {}
        self.held: dict[tuple[Hashable, ...], Any] = {}  # graphed shapes of unfinished jobs
        self.pool = torch.cuda.graph_pool_handle() if self.enabled else None
        # captures and their warm-up runs: streams of this cache's own (private_stream: a
        # capture stream's cuBLAS workspace is its graphs' alone)
        self.capture_stream = private_stream(device) if self.enabled else None
        self.warm_stream = private_stream(device) if self.enabled else None
        self.green_context, self.beside_capture_stream = None, self.capture_stream
        self.free_sms = 0
        self._leave_sms(free_sms)
        self.capture_seconds = self.warmup_seconds = self.compile_seconds = 0.0
        self.graph_bytes: dict[tuple[Hashable, ...], int] = {}  # pool growth per capture

    def _leave_sms(self, value: int | str) -> None:
        """Validate free_sms and make the green context of the steps beside other stages."""
        auto = value == "auto"
        if auto:
            if not self.enabled:
                return
            sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            value = sms // 4 // 8 * 8
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"free_sms: an int >= 0 or 'auto', got {value!r}")
        if not value:
            return
        if not self.enabled:
            raise ValueError("free_sms: leaving SMs free needs CUDA graphs (a CUDA model)")
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        if value > sms - 16:
            raise ValueError(f"free_sms: {value} of this GPU's {sms} SMs; at most {sms - 16} "
                             "(the step keeps 16 or more)")
        try:
            self.green_context, self.beside_capture_stream = green_context_stream(
                self.device, sms - value)
        except (ValueError, RuntimeError) as exc:
            if not auto:
                raise ValueError(f"free_sms: no green context on this GPU ({exc})") from exc
            warnings.warn(f"{self.name}: free_sms='auto' needs CUDA green contexts ({exc}); "
                          "steps keep every SM", stacklevel=4)
            return
        self.free_sms = value

    def bucket(self, n: int) -> int:
        return bucket_for(n, self.buckets)

    def key(self, bucket: int, shape: Hashable, beside: bool) -> tuple[int, Hashable, bool]:
        """The cache key of a step: beside only where SMs are left free and the batch is big."""
        return bucket, shape, beside and self.free_sms > 0 and bucket >= self.beside_min_bucket

    # ---------------------------------------------------------------- held shapes
    def claim(self, key: tuple[Hashable, ...], job: Any | None) -> None:
        """A graphed shape serves one step at a time: an unfinished job's state lives in it.
        job None: a whole step (checks only)."""
        if key in self.held:
            raise ValueError(f"requests: graphed shape (batch {key[0]}, {key[1]}) is held by "
                             f"an unfinished job")
        if job is not None:
            self.held[key] = job

    def release(self, key: tuple[Hashable, ...]) -> None:
        self.held.pop(key, None)

    def is_held(self, key: tuple[Hashable, ...]) -> bool:
        return key in self.held

    def drop_held(self) -> None:
        self.held.clear()

    # ---------------------------------------------------------------- capture
    def capture(self, fn: Callable[[], Any], key: tuple[Hashable, ...], beside: bool = False,
                warm: bool = True) -> tuple[torch.cuda.CUDAGraph, Any]:
        """Run fn once (warm-up; warm=False: the caller knows its kernels are loaded and its
        compiles done), then capture it into the shared pool on a private stream (beside: the
        green context's); returns (graph, fn's captured output)."""
        t0 = time.perf_counter()
        reserved = [0]

        def warmed() -> None:  # (compiled code is compiled already: compile_or_fall_back)
            torch.cuda.synchronize(self.device)
            if warm:
                self.warmup_seconds += time.perf_counter() - t0
            reserved[0] = torch.cuda.memory_reserved(self.device)

        stream = self.beside_capture_stream if beside else self.capture_stream
        graph, out = warm_and_capture(fn, fn, self.device, self.pool, stream, self.warm_stream,
                                      warmups=int(warm), after_warmup=warmed)
        torch.cuda.synchronize(self.device)
        self.capture_seconds += time.perf_counter() - t0
        self.graph_bytes[key] = (self.graph_bytes.get(key, 0)
                                 + torch.cuda.memory_reserved(self.device) - reserved[0])
        return graph, out

    def compile_or_fall_back(self, run: Callable[[], Any], what: str) -> bool:
        """Run a compiled shape once before its capture (the compile happens here); False where
        inductor cannot build (no C compiler, old Triton): graphs stay uncompiled."""
        t0 = time.perf_counter()
        ok = True
        try:
            run()
        except Exception as exc:  # noqa: BLE001 - any compile failure: eager graphs instead
            warnings.warn(f"{self.name}: torch.compile of {what} failed, graphs stay uncompiled "
                          f"({type(exc).__name__}: {str(exc)[:300]})", stacklevel=4)
            ok = False
        torch.cuda.synchronize(self.device)
        self.compile_seconds += time.perf_counter() - t0
        return ok

    def stats(self) -> dict[str, float]:
        """Seconds compiling (each shape's first compiled run), capturing (the warm-up run
        included) and warming up; graph pool memory (GiB) grown by the captures."""
        return {"free_sms": self.free_sms, "compile_seconds": round(self.compile_seconds, 3),
                "capture_seconds": round(self.capture_seconds, 3),
                "warmup_seconds": round(self.warmup_seconds, 3),
                "graph_pool_GiB": round(sum(self.graph_bytes.values()) / 2**30, 3)}
