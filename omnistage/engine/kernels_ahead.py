"""Triton kernel variants compiled ahead, in processes of their own, while the stages load.

NOTE (why): on a cold start (an empty Triton cache) a stage compiles each variant of a Triton
kernel on its first launch, inside its warm-up, one after another; Triton's LLVM passes hold the
GIL, so threads do not overlap them. A stage builder that knows its variants before its build
(models/registry.StageBuilder.kernels_ahead) lists them as KernelJobs: build_stages
(runtime/build.py) compiles them in spawned processes when the pipeline's build starts, into the
on-disk Triton cache (config/env.compile_cache_dirs); a stage takes them before its first
launches (runtime/build.py says when), which then load them from the cache. A job whose kernels
the cache holds already is not run (engine/kernels_ledger.py): a warm start spawns no process.
A job that fails or is not done is logged, and the stage compiles that variant itself on first
use, as it would without this.

The processes never touch the GPU: Triton's driver is replaced there by the target's
description (compute capability), so they take no device memory.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

import torch

from omnistage.engine.kernels_ledger import KernelLedger, job_id
from omnistage.layers.compile import pin_triton_ptxas

log = logging.getLogger(__name__)

WAIT_SECONDS = 300.0  # the most a stage's build waits for its jobs (then it compiles them)
MAX_WORKERS = 12  # compiling processes at once (each holds torch and Triton: ~340 MB on the CPU)


@dataclass(frozen=True)
class KernelJob:
    """One variant: `compile(*args)` run in a process whose Triton compiles for the pipeline's
    GPU. compile: a module-level function (pickled by reference) that calls the kernel's
    `warmup` (`warm_up`) with the arguments of the launch it stands for."""

    compile: Callable[..., Any]
    args: tuple = ()


@dataclass(frozen=True)
class _TargetOnly:
    """Triton's driver, as far as compiling needs it: the target, no CUDA context."""

    target: Any  # triton.backends.compiler.GPUTarget

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 0

    def get_current_target(self) -> Any:
        return self.target


def warm_up(kernel: Any, *args: Any, **kwargs: Any) -> str:
    """Compile `kernel` (a @triton.jit function) for the launch `kernel[grid](*args, **kwargs)`
    without launching it: tensors stand as their torch dtypes (Triton's MockTensor, aligned as
    every allocation is), integers as launched (their type, and what Triton specializes).
    Returns the compiled kernel's cache key."""
    return kernel.warmup(*args, grid=(1,), **kwargs).hash


@dataclass(frozen=True)
class TensorSpec:
    """A tensor argument for launch code that reads its shape and strides, when compiling ahead
    (no tensor): dtype, shape, strides (None: contiguous) and `offset`, its address in bytes
    past a 16-byte boundary (Triton specializes pointers on 16-byte alignment; an allocation
    is aligned, a view at an offset may not be)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    strides: tuple[int, ...] | None = None
    offset: int = 0

    @classmethod
    def empty(cls, shape: tuple[int, ...], dtype: torch.dtype) -> TensorSpec:
        """The stand-in of torch.empty(shape, dtype=dtype) (launch code's `empty`)."""
        return cls(dtype, tuple(shape))

    def stride(self, dim: int | None = None) -> Any:
        strides = self.strides
        if strides is None:
            acc, rev = 1, []
            for size in reversed(self.shape):
                rev.append(acc)
                acc *= max(size, 1)
            strides = tuple(reversed(rev))
        return strides if dim is None else strides[dim]

    def dim(self) -> int:
        return len(self.shape)

    def data_ptr(self) -> int:
        return self.offset


def launch(kernel: Any, grid: Any, *args: Any, **kwargs: Any) -> Any:
    """`run` of launch code shared with its compile-ahead path: the launch itself."""
    return kernel[grid](*args, **kwargs)


def empty_on(device: torch.device) -> Callable[[tuple[int, ...], torch.dtype], torch.Tensor]:
    """`empty(shape, dtype)` of launch code shared with its compile-ahead path: a buffer on
    `device` (TensorSpec.empty when compiling ahead)."""
    return lambda shape, dtype: torch.empty(shape, dtype=dtype, device=device)


@dataclass
class CompileOnly:
    """`run` of launch code called on TensorSpecs: compiles each launch instead (warm_up) and
    keeps the cache keys, in launch order."""

    keys: list[str] = field(default_factory=list)

    def __call__(self, kernel: Any, grid: Any, *args: Any, **kwargs: Any) -> None:
        self.keys.append(warm_up(kernel, *args, **kwargs))


def _run(job: KernelJob, target: tuple[str, int, int]) -> tuple[float, Any]:
    """In the child: point Triton at the target, run the job -> (its seconds, its result)."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    driver.set_active(_TargetOnly(GPUTarget(*target)))
    t0 = time.perf_counter()
    result = job.compile(*job.args)
    return time.perf_counter() - t0, result


def cuda_target(device: torch.device) -> tuple[str, int, int]:
    """Triton's target for a CUDA device: (backend, compute capability, warp size)."""
    major, minor = torch.cuda.get_device_capability(device)
    return ("cuda", major * 10 + minor, 32)


@dataclass
class _Entry:
    """A listed job: its ledger id, and its future (None: found compiled, its `result`)."""

    job: str
    future: Future | None
    result: Any = None


@dataclass
class KernelsAhead:
    """Jobs compiling in child processes, by the stage unit that listed them; jobs whose
    kernels the Triton cache holds already (engine/kernels_ledger.py) are not run."""

    pool: ProcessPoolExecutor | None = None
    entries: dict[str, list[_Entry]] = field(default_factory=dict)
    unfinished: list[_Entry] = field(default_factory=list)  # past a wait: recorded at close
    ledger: KernelLedger | None = None

    @classmethod
    def start(cls, jobs: dict[str, tuple[tuple[str, int, int], list[KernelJob]]]
              ) -> KernelsAhead:
        """Start every unit's jobs, each for its unit's target (cuda_target; a no-op with
        none), in the dict's order."""
        if not any(js for _, js in jobs.values()):
            return cls()
        ahead = cls(ledger=KernelLedger.load())
        todo: list[tuple[_Entry, KernelJob, tuple[str, int, int]]] = []
        for unit, (target, js) in jobs.items():
            for job in js:
                jid = job_id(job.compile, job.args, target)
                found = ahead.ledger.compiled(jid)
                entry = _Entry(jid, None, found)
                ahead.entries.setdefault(unit, []).append(entry)
                if found is None:
                    todo.append((entry, job, target))
        if todo:
            pin_triton_ptxas()  # (the processes inherit it: layers/compile.py says why)
            # a few cores stay with the stages' builds (a thread each, inductor's workers);
            # MAX_WORKERS bounds the memory
            workers = max(1, min(len(todo), (os.cpu_count() or 2) - 4, MAX_WORKERS))
            # a process per job: no job sees another's kernels in Triton's in-memory cache
            ahead.pool = ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"),
                                             max_tasks_per_child=1)
            for entry, job, target in todo:
                entry.future = ahead.pool.submit(_run, job, target)
        n = sum(len(es) for es in ahead.entries.values())
        log.info("kernels ahead: %d Triton kernel variants listed, %d found compiled, %d "
                 "compiling", n, n - len(todo), len(todo))
        return ahead

    def listed(self, unit: str) -> bool:
        """Whether any of the unit's jobs is running (one found compiled needs no wait)."""
        return any(e.future is not None for e in self.entries.get(unit, ()))

    def wait(self, unit: str, timeout: float = WAIT_SECONDS) -> list[Any]:
        """Before `unit`'s first launches: its jobs done (or failed, or past `timeout`: it
        compiles those itself). Returns each job's result (None where it failed or is not
        done)."""
        entries = self.entries.pop(unit, [])
        futures = [e.future for e in entries if e.future is not None]
        _, pending = wait_futures(futures, timeout=timeout)
        results = []
        for e in entries:
            f = e.future
            if f is None:
                results.append(e.result)
            elif f in pending:
                self.unfinished.append(e)
                results.append(None)
            elif (err := f.exception()) is not None:
                log.warning("stage %s: a kernel compiled ahead failed (%s: %s); its first "
                            "launch compiles it", unit, type(err).__name__, err)
                results.append(None)
            else:
                seconds, result = f.result()
                log.info("stage %s: kernel compiled ahead in %.1f s", unit, seconds)
                self.ledger.record(e.job, result)
                results.append(result)
        if pending:
            log.info("stage %s: %d kernels compiled ahead not done in %.0f s; its first "
                     "launches compile them", unit, len(pending), timeout)
        if not self.entries:
            self.close()
        return results

    def close(self) -> None:
        """Record what finished, let the processes go (those still compiling finish)."""
        for e in [e for es in self.entries.values() for e in es] + self.unfinished:
            f = e.future
            if f is not None and f.done() and not f.cancelled() and f.exception() is None:
                self.ledger.record(e.job, f.result()[1])
        self.entries.clear()
        self.unfinished.clear()
        if self.ledger is not None:
            self.ledger.save()
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None
