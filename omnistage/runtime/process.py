"""Stage processes: a stage (model + worker + its requests' links) in a process of its own.

NOTE: the orchestrator talks to a stage process over one duplex pipe: control goes down
(submit, abort, stop, relink, stats) and the stage's events come up (token ids, text deltas,
audio chunks, finish). Data between two stage processes goes over a pipe of their own, one per
pipeline edge, so hidden rows and codes never pass through the orchestrator. Everything is
pickled with torch's ForkingPickler: tensors travel as handles (CPU: shared memory; CUDA: IPC
on the same GPU), so a message is a few hundred bytes whatever the tensor size. Processes are
spawned (CUDA cannot be forked). When a stage process dies, the orchestrator fails the requests
it held, starts a new one and hands the neighbours new pipes (`relink_in` / `relink_out`)."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import time
from dataclasses import dataclass
from pathlib import Path
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy as np
import torch
import torch.multiprocessing  # noqa: F401 - registers tensor reductions with ForkingPickler
from multiprocessing.reduction import ForkingPickler

from omnistage.config import env
from omnistage.runtime.stage import StageEvent, StageHost

log = logging.getLogger("omnistage.runtime")

STATS_INTERVAL = 0.5  # seconds between unasked stats reports of a stage process


@dataclass
class StageProcessSpec:
    """Everything a stage process needs to build its stage (picklable)."""

    path: str
    config: dict  # the checkpoint's config.json
    pipeline: Any  # PipelineConfig
    stage: str
    device: str
    dtype: str
    options: dict[str, Any]  # the pipeline's resolved options
    num_threads: int = 0  # torch intra-op threads (0: torch's default)
    placement: Any = None  # build.StagePlacement: replica index, devices, TP (None: one)
    worker: str = "process"  # "process" (spawned here) or "ray" (a Ray actor)

    @property
    def unit(self) -> str:
        """The replica's name in the runtime (replicas.unit_name)."""
        from omnistage.runtime.replicas import unit_name
        replicas = self.pipeline.stage(self.stage).replicas
        return unit_name(self.stage, self.placement.replica if self.placement else 0, replicas)


STAGE_WORKERS = ("inprocess", "process", "ray")


def pop_stage_worker(options: dict[str, Any]) -> str | None:
    """Takes the `stage_worker` option (every stage's worker; None = the YAML's) out of options."""
    worker = options.pop("stage_worker", None)
    if worker is not None and worker not in STAGE_WORKERS:
        raise ValueError(f"stage_worker: {worker!r}; one of {STAGE_WORKERS}")
    return worker


def stage_process_spec(path, config: dict, pipeline: Any, stage: str, device: torch.device,
                       dtype: torch.dtype, options: dict[str, Any], placement: Any = None,
                       worker: str = "process") -> StageProcessSpec:
    return StageProcessSpec(str(path), config, pipeline, stage, str(device),
                            str(dtype).removeprefix("torch."), options, placement=placement,
                            worker=worker)


def dumps(obj: Any) -> bytes:
    return bytes(ForkingPickler.dumps(obj))


def pack_events(events: list[StageEvent]) -> list[tuple]:
    # compact tuples: the control channel carries a few dozen bytes per request and step
    return [(ev.request_id, ev.token_ids, ev.text,
             None if ev.audio is None else torch.from_numpy(np.ascontiguousarray(ev.audio)),
             ev.finished, ev.finish_reason, ev.error, ev.codes, ev.images, ev.progress,
             ev.logprobs)
            for ev in events]


def unpack_events(stage: str, packed: list[tuple]) -> list[StageEvent]:
    return [StageEvent(stage, rid, tokens, text, None,
                       None if audio is None else audio.numpy(), finished, reason, error, codes,
                       images, progress, logprobs=logprobs)
            for rid, tokens, text, audio, finished, reason, error, codes, images, progress,
            logprobs in packed]


# ------------------------------------------------------------------------- parent side
class ProcessStage:
    """The orchestrator's handle on one stage process."""

    def __init__(self, spec: StageProcessSpec) -> None:
        self.spec, self.name = spec, spec.stage
        self.ctx = mp.get_context("spawn")
        self.proc: Any = None
        self.conn: Connection | None = None
        self.ready = False
        self.dead = False
        self.bytes_down = 0  # control bytes sent to the process
        self.bytes_up = 0  # event and stats bytes received from it
        self.restarts = 0
        self.last_stats: dict[str, float] = {}
        self.stats_replies = 0
        self.step_delay = 0.0

    def start(self, in_edges: dict[str, Connection], out_edges: dict[str, Connection | None]
              ) -> None:
        parent, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=stage_process_main, name=f"omnistage-{self.name}",
                                     args=(self.spec, child, in_edges, out_edges), daemon=True)
        self.proc.start()
        for c in (child, *in_edges.values(), *out_edges.values()):
            if c is not None:
                c.close()  # the child holds its own copies now
        self.conn, self.ready, self.dead = parent, False, False
        if self.step_delay:
            self.send(("delay", self.step_delay))

    def send(self, msg: tuple) -> None:
        if self.dead or self.conn is None:
            return
        data = dumps(msg)
        self.bytes_down += len(data)
        try:
            self.conn.send_bytes(data)
        except OSError:  # it died; poll() notices and the orchestrator restarts it
            self.dead = True

    def submit(self, request_id: str, request: Any, links: list) -> None:
        self.send(("submit", request_id, request, links))

    def abort(self, request_id: str) -> None:
        self.send(("abort", request_id))

    def receive(self, request_id: str, index: int, msg: Any) -> None:
        self.send(("data", request_id, index, msg))  # from a stage in the orchestrator's process

    def set_step_delay(self, seconds: float) -> None:
        self.step_delay = seconds
        self.send(("delay", seconds))

    def has_work(self) -> bool:
        return False  # it steps itself; the orchestrator only polls it

    def poll(self) -> list[tuple]:
        """Messages that have arrived (non-blocking). Sets `dead` when the process is gone."""
        out = []
        try:
            while self.conn is not None and self.conn.poll():
                data = self.conn.recv_bytes()
                self.bytes_up += len(data)
                out.append(pickle.loads(data))
        except (EOFError, OSError):
            self.dead = True
        if not self.dead and self.proc is not None and not self.proc.is_alive():
            self.dead = True
        return out

    def death(self) -> str:
        """Why it is dead (for the errors of the requests it held)."""
        code = self.proc.exitcode if self.proc is not None else None
        return f"its process died (exit code {code})"

    def stats(self) -> dict[str, float]:
        """The last report (a stage process reports every STATS_INTERVAL while it steps)."""
        return dict(self.last_stats, restarts=self.restarts, alive=float(not self.dead),
                    control_bytes_down=self.bytes_down, control_bytes_up=self.bytes_up)

    def stop(self, timeout: float) -> None:
        self.send(("stop",))
        if self.proc is not None:
            self.proc.join(timeout)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(1.0)
        if self.conn is not None:
            self.conn.close()
        self.conn, self.dead = None, True


# ------------------------------------------------------------------------- child side
def build_stage_worker(spec: StageProcessSpec):
    """The spec's stage worker (every pipeline builds its stages through the registry)."""
    from omnistage.runtime.build import build_stage_worker as build_worker
    return build_worker(Path(spec.path), spec.config, spec.pipeline, spec.stage,
                        torch.device(spec.device), getattr(torch, spec.dtype), spec.options,
                        spec.placement)


def stage_process_main(spec: StageProcessSpec, ctrl: Connection,
                       in_edges: dict[str, Connection],
                       out_edges: dict[str, Connection | None]) -> None:
    """The loop of a stage process: take control and link messages, step, report events."""
    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    logging.basicConfig(level=env.log_level().upper())

    def up(msg: tuple) -> None:
        ctrl.send_bytes(dumps(msg))

    def deliver(downstream: str, request_id: str, index: int, msg: Any) -> None:
        conn = out_edges.get(downstream)
        if conn is None:  # the downstream stage runs in the orchestrator's process
            up(("data", downstream, request_id, index, msg))
            return
        try:
            conn.send_bytes(dumps(("data", request_id, index, msg)))
        except OSError:  # the downstream process died: its requests fail; wait for relink
            log.warning("stage %s: link to %s is down until relinked", spec.stage, downstream)
            out_edges.pop(downstream, None)  # meanwhile through the orchestrator

    try:
        host = StageHost(build_stage_worker(spec), deliver)
    except Exception as e:  # noqa: BLE001 - reported to the orchestrator, then exit
        up(("failed", f"{type(e).__name__}: {e}"))
        raise
    up(("ready", os.getpid()))
    delay, steps, busy_seconds, link_messages = 0.0, 0, 0.0, 0
    last_stats = time.monotonic()

    def stats() -> dict[str, float]:
        return dict(host.stats(), steps=steps, busy_seconds=busy_seconds,
                    link_messages=link_messages)

    up(("stats", stats()))
    while True:
        # stalled: wait for the upstream rows it is gated on (a pipe message wakes us at once)
        if (not host.has_work() and getattr(host.worker, "idle_capture", None) is not None
                and not wait([ctrl, *in_edges.values()], timeout=0)
                and host.worker.idle_capture()):  # a lazy warm-up's graph, nothing to do
            continue
        timeout = (0.05 if host.stalled else 0.0) if host.has_work() else 1.0
        for conn in wait([ctrl, *in_edges.values()], timeout=timeout):
            try:
                while conn.poll():
                    msg = pickle.loads(conn.recv_bytes())
                    if conn is not ctrl:
                        link_messages += 1
                        host.receive(*msg[1:])
                        continue
                    kind = msg[0]
                    if kind == "submit":
                        try:
                            host.submit(*msg[1:])
                        except Exception as e:  # noqa: BLE001 - rejected: fails alone
                            if not isinstance(e, ValueError):
                                log.exception("request %s: submit raised", msg[1])
                            up(("events", pack_events([StageEvent(
                                spec.stage, msg[1], finished=True, finish_reason="error",
                                error=str(e) if isinstance(e, ValueError)
                                else f"request failed at submit: {type(e).__name__}: {e}")])))
                    elif kind == "abort":
                        host.abort(msg[1])
                    elif kind == "data":
                        host.receive(*msg[1:])
                    elif kind == "relink_in":
                        old = in_edges.pop(msg[1], None)
                        if old is not None:
                            old.close()
                        in_edges[msg[1]] = msg[2]
                    elif kind == "relink_out":
                        out_edges[msg[1]] = msg[2]
                    elif kind == "delay":
                        delay = float(msg[1])
                    elif kind == "stats":
                        up(("stats", stats()))
                    elif kind == "stop":
                        return
            except (EOFError, OSError):
                if conn is ctrl:
                    return  # the orchestrator is gone
                for name, c in list(in_edges.items()):  # an upstream process died
                    if c is conn:
                        del in_edges[name]
                        c.close()
        if host.has_work():
            if delay:
                time.sleep(delay)
            t0 = time.perf_counter()
            try:
                events = host.step()
            except Exception as e:  # noqa: BLE001 - its culprits fail alone (host.recover)
                log.error("stage %s: a step raised; finding the requests that make it raise",
                          spec.stage, exc_info=e)
                events = host.recover(e)
            busy_seconds += time.perf_counter() - t0
            steps += 1
            if events:
                up(("events", pack_events(events)))
            if not host.has_work():  # idle now: a final report of this burst
                up(("stats", stats()))
        if time.monotonic() - last_stats > STATS_INTERVAL:
            last_stats = time.monotonic()
            up(("stats", stats()))
