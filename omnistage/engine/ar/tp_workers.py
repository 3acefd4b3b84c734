"""Tensor parallelism's worker ranks: the processes that run ranks 1..N-1 of a stage
(engine/ar/tp.py has what every rank runs each step).

Worker ranks are processes of their own (spawned, kept in a pool between stages: a restarted
stage or the next test reuses them); their builder is a picklable function from the runtime
(runtime/build.py), which builds the same stage under layers.parallel.tensor_parallel.

Shutdown, in order (TPWorkers.close: the runtime closes its stages when it stops): rank 0
broadcasts stop; each worker leaves its loop, says "stopped", shuts its side of the group and
frees its stage, then says "idle"; rank 0 shuts its own side once every rank stopped (no rank
is left in a collective, whether or not the backend's shutdown waits for its peers), and the
workers go back to the pool idle. A worker that died, or does not answer, ends the others
(terminated: they may wait in a collective) and none goes back. stop_idle_workers() ends the
idle ones."""

from __future__ import annotations

import atexit
import gc
import logging
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from omnistage.config import env
from omnistage.engine.ar.tp import StepChannel, follow
from omnistage.layers.parallel import TensorParallel, new_group, tensor_parallel
from omnistage.layers.symm_all_reduce import resolve_mode

log = logging.getLogger("omnistage.tp")
DEFAULT_TIMEOUT_S = 300.0  # a collective waiting longer than this raises (a rank died)
GROUP_SHUTDOWN_TIMEOUT_S = 30.0  # rank 0's side of a group closing (shutdown_group_bounded)


@dataclass(frozen=True)
class RankSetup:
    """What a worker rank needs to join its group (picklable)."""

    rank: int
    size: int
    backend: str  # "gloo" (CPU) | "nccl" (CUDA)
    host: str
    port: int
    device: str
    timeout_s: float
    num_threads: int  # torch intra-op threads of a CPU rank (0: torch's default)
    all_reduce: str = "nccl"  # the group's all-reduce mode (symm_all_reduce.resolve_mode)


@dataclass(frozen=True)
class RankReport:
    """What one rank built (a worker sends it to rank 0 once ready): its parameters' shapes
    and its KV cache."""

    rank: int
    param_shapes: dict[str, tuple[int, ...]]
    kv_shape: tuple[int, int, int]  # (layers, KV heads of this rank, head_dim)
    num_kv_blocks: int
    kv_bytes_per_block: int


def rank_report(rank: int, runner) -> RankReport:
    from omnistage.engine.ar.model_runner import kv_bytes_per_block
    shapes = {n: tuple(p.shape) for n, p in runner.model.named_parameters()}
    return RankReport(rank, shapes, tuple(runner.model.kv_shape), runner.num_blocks,
                      kv_bytes_per_block(runner.model, runner.config.block_size, runner.dtype))


def _join_and_build(setup: RankSetup, build: Callable[..., Any], args: tuple):
    if setup.num_threads:
        torch.set_num_threads(setup.num_threads)
    device = torch.device(setup.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tp = new_group(setup.backend, setup.rank, setup.size, setup.host, setup.port,
                   setup.timeout_s, setup.all_reduce, device)
    with tensor_parallel(tp):
        runner = build(*args, device)
    if getattr(runner, "tp", None) is not tp:
        raise RuntimeError("tensor parallel: the stage's model was not built in its group "
                           "(does its family support tensor_parallel_size?)")
    return runner


def shutdown_group(tp: TensorParallel, abort: bool = False) -> None:
    """This rank's side of the group: its communicator (NCCL) or connections (gloo) closed,
    once no collective of the group is pending on any rank (see the module note); abort: at
    once, pending collectives dropped (after a rank failed). The group and its store are then
    released (TensorParallel.release)."""
    if tp.symm is not None:
        tp.symm.close()
    if tp.group is not None:
        if abort:
            tp.group.abort()
        else:
            tp.group.shutdown()
    tp.release()


def shutdown_group_bounded(tp: TensorParallel, abort: bool = False,
                           timeout_s: float = GROUP_SHUTDOWN_TIMEOUT_S) -> None:
    """shutdown_group on a thread of its own, waited for at most timeout_s: RuntimeError if it
    does not return by then (the communicator is then left to the process's exit). NCCL's
    teardown waits for the CUDA graphs holding its collectives (ModelRunner.release_graphs
    destroys them first); should anything else hold it, a stage's close still ends."""
    done, errors = threading.Event(), []

    def run() -> None:
        try:
            shutdown_group(tp, abort)
        except Exception as e:  # re-raised below, in the caller's thread
            errors.append(e)
        finally:
            done.set()
    threading.Thread(target=run, daemon=True, name="omnistage-tp-shutdown").start()
    if not done.wait(timeout_s):
        raise RuntimeError(f"tensor parallel: the group's {'abort' if abort else 'shutdown'} "
                           f"did not finish in {timeout_s:.0f} s")
    if errors:
        raise errors[0]


def _worker_main(conn) -> None:
    """A worker process: jobs (join a group, build a stage's rank, follow rank 0's steps until
    stop, shut the group) one after the other, until its pipe closes or it gets None. An error
    is sent to rank 0 and ends the process (its group is unusable)."""
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        setup, build, args = job
        conn.send(("joining", os.getpid()))
        try:
            runner = _join_and_build(setup, build, args)
            conn.send(("ready", rank_report(setup.rank, runner)))
            conn.send(("stopped", follow(runner)))
            runner.release_graphs()  # (before the group: see ModelRunner.release_graphs)
            shutdown_group(runner.tp)
        except Exception as e:  # reported to rank 0, which fails the stage's start or close
            log.exception("tensor-parallel rank %d failed", setup.rank)
            conn.send(("error", f"rank {setup.rank}: {type(e).__name__}: {e}"))
            return
        del runner
        gc.collect()  # the stage's weights and KV cache, before the next job builds its own
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        conn.send(("idle", os.getpid()))


def _worker_process(conn) -> None:
    """The worker process's body: its job loop, then an immediate exit: the loop has released
    everything it holds by then, and only the output streams need flushing. (Added while
    dangling weakrefs to freed CUDA streams crashed the interpreter's at-exit finalisation and
    turned an idle rank's clean exit into -11; engine/streams.py takes none since, and
    docs/distributed.md tells the story.)"""
    _worker_main(conn)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _Worker:
    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_process, args=(child,), daemon=True,
                                name="omnistage-tp-worker")
        self.proc.start()
        child.close()


_IDLE: list[_Worker] = []
_POOL_LOCK = threading.Lock()


def _acquire(n: int) -> list[_Worker]:
    with _POOL_LOCK:
        alive = [w for w in _IDLE if w.proc.is_alive()]
        _IDLE[:] = alive[n:]
        taken = alive[:n]
    return taken + [_Worker() for _ in range(n - len(taken))]


def idle_workers() -> list[int]:
    """The process ids of the idle worker ranks in the pool (alive, in no group)."""
    with _POOL_LOCK:
        return [w.proc.pid for w in _IDLE if w.proc.is_alive()]


def stop_idle_workers(timeout_s: float = 10.0) -> list[int | None]:
    """End the pool's idle worker ranks (they leave their loop; terminated if they do not
    within timeout_s); returns their exit codes."""
    with _POOL_LOCK:
        workers, _IDLE[:] = list(_IDLE), []
    for w in workers:
        if w.proc.is_alive():
            try:
                w.conn.send(None)
            except OSError as e:  # its pipe is gone: it is ending anyway
                log.warning("tensor-parallel worker %s: %s", w.proc.pid, e)
    codes = []
    for w in workers:
        w.proc.join(timeout_s)
        if w.proc.is_alive():
            w.proc.terminate()
            w.proc.join(5)
        w.conn.close()
        codes.append(w.proc.exitcode)
    return codes


# at exit, the idle ranks leave their loop (before multiprocessing terminates its daemon
# children: atexit runs the later registration first)
atexit.register(stop_idle_workers, 2.0)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_devices(size: int, devices: list[torch.device]) -> str:
    """The backend for these ranks' devices; ValueError naming tensor_parallel_size when they
    do not fit (one device per rank, existing, all CPU or all CUDA)."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size: a positive integer, got {size!r}")
    if len(devices) != size:
        raise ValueError(f"tensor_parallel_size: {size} ranks but {len(devices)} devices")
    kinds = {d.type for d in devices}
    if kinds == {"cpu"}:
        return "gloo"
    if kinds != {"cuda"}:
        raise ValueError(f"tensor_parallel_size: ranks on mixed devices {devices}")
    count = torch.cuda.device_count()
    indices = [d.index if d.index is not None else 0 for d in devices]
    if max(indices) >= count or len(set(indices)) != size:
        raise ValueError(f"tensor_parallel_size: {size} needs {size} distinct GPUs; devices "
                         f"{[str(d) for d in devices]}, this machine has {count}")
    return "nccl"


class TPWorkers:
    """Rank 0's handle on a stage's worker ranks 1..N-1."""

    def __init__(self, tp: TensorParallel, workers: list[_Worker], device: torch.device) -> None:
        self.tp, self.workers, self.device = tp, workers, device
        self.reports: list[RankReport] = []
        self.closed = False

    def _reply(self, worker: _Worker, timeout_s: float) -> tuple:
        if not worker.conn.poll(timeout_s):
            raise RuntimeError(f"tensor parallel: a worker rank sent nothing in {timeout_s} s")
        msg = worker.conn.recv()
        if msg[0] == "error":
            raise RuntimeError(f"tensor parallel: {msg[1]}")
        return msg

    def wait_ready(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[RankReport]:
        """The worker ranks' reports (after rank 0 built its own: the builds share
        collectives)."""
        self.reports = [self._reply(w, timeout_s)[1] for w in self.workers]
        return self.reports

    def attach(self, runner) -> None:
        """Rank 0's runner owns the ranks: runner.close(), or its garbage collection, stops
        them (not at interpreter exit: the daemon processes end with it)."""
        runner.tp_workers = self
        weakref.finalize(runner, self.close).atexit = False

    def abandon(self) -> None:
        """After a failed start or close: end the worker processes (they may wait in a
        collective), and rank 0's side of the group."""
        self.closed = True
        _end(self.workers)
        try:
            shutdown_group_bounded(self.tp, abort=True)
        except RuntimeError as e:  # the workers are ended already; rank 0's side is moot
            log.warning("%s", e)

    def _expect(self, kind: str, timeout_s: float) -> None:
        for w in self.workers:
            msg = self._reply(w, timeout_s)
            if msg[0] != kind:
                raise RuntimeError(f"tensor parallel: a worker rank sent {msg[0]!r}, "
                                   f"expected {kind!r}")

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop the worker ranks in order (module note): they go back to the pool idle, and
        rank 0's side of the group is shut. Call it from the thread that steps the stage, no
        step in flight. Idempotent; RuntimeError (the ranks ended) if a rank died or does not
        answer."""
        if self.closed:
            return
        self.closed = True
        dead = [w.proc.pid for w in self.workers if not w.proc.is_alive()]
        if dead:  # a broadcast would wait for it until the group's timeout
            self.abandon()
            raise RuntimeError(f"tensor parallel: worker rank process(es) {dead} died")
        try:
            StepChannel(self.tp, self.device).send_stop()
            self._expect("stopped", timeout_s)
            shutdown_group_bounded(self.tp)
            self._expect("idle", timeout_s)
        except Exception:
            self.abandon()
            raise
        with _POOL_LOCK:
            _IDLE.extend(self.workers)


def start_workers(size: int, devices: list[torch.device], build: Callable[..., Any],
                  args: tuple, timeout_s: float = DEFAULT_TIMEOUT_S,
                  all_reduce: str = "nccl") -> tuple[TensorParallel, TPWorkers]:
    """Start ranks 1..size-1 (each calls build(*args, its device) inside its group and returns
    the stage's ModelRunner, then follows rank 0), and join the group as rank 0. The caller
    builds rank 0's stage inside tensor_parallel(tp), then calls workers.wait_ready().
    all_reduce: the tp_all_reduce option (resolved here, once, for every rank)."""
    backend = check_devices(size, devices)
    all_reduce = resolve_mode(all_reduce, devices)
    if backend == "nccl":
        env.nccl_device_rules()  # NVLink multicast off, for this process and the spawned ranks
    host = "127.0.0.1"
    port = _free_port(host)
    threads = max(1, (os.cpu_count() or 1) // size) if backend == "gloo" else 0
    workers = _acquire(size - 1)
    for rank, w in enumerate(workers, 1):
        w.conn.send((RankSetup(rank, size, backend, host, port, str(devices[rank]), timeout_s,
                               threads, all_reduce), build, args))
    _wait_joining(workers, timeout_s)
    tp = new_group(backend, 0, size, host, port, timeout_s, all_reduce, devices[0])
    handle = TPWorkers(tp, workers, devices[0])
    return tp, handle


def _wait_joining(workers: list[_Worker], timeout_s: float) -> None:
    """Each worker rank took its job (it is joining the group), before rank 0 blocks in the
    group's rendezvous: a rank whose process ended first (a spawned process that failed to
    start, typically a script without a __main__ guard) is a RuntimeError now, not a wait of
    timeout_s in the rendezvous."""
    deadline = time.monotonic() + timeout_s
    for w in workers:
        while True:
            try:
                if w.conn.poll(0.05):
                    msg = w.conn.recv()
                    break
                ended = not w.proc.is_alive()
            except (EOFError, OSError):  # its end of the pipe closed: the process ended
                ended = True
            if ended:
                _end(workers)
                raise RuntimeError(
                    f"tensor parallel: worker rank process {w.proc.pid} ended (exit code "
                    f"{w.proc.exitcode}) before joining the group; its error is on stderr. "
                    "The ranks are spawned processes that import the main script: a script "
                    "that builds a multi-device stage must guard its entry point with "
                    "`if __name__ == \"__main__\":`")
            if time.monotonic() >= deadline:
                _end(workers)
                raise RuntimeError(f"tensor parallel: worker rank process {w.proc.pid} did "
                                   f"not take its job in {timeout_s:.0f} s")
        if msg[0] != "joining":
            _end(workers)
            raise RuntimeError(f"tensor parallel: a worker rank sent {msg[0]!r}, expected "
                               f"'joining'" + (f": {msg[1]}" if msg[0] == "error" else ""))


def _end(workers: list[_Worker]) -> None:
    """Terminate worker ranks that will not go back to the pool (they may wait in a
    collective, or never joined), and reap them."""
    for w in workers:
        if w.proc.is_alive():
            w.proc.terminate()
        w.proc.join(5)
