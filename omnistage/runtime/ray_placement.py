"""Ray placement: a stage (or each replica of one) as a Ray actor on some node of a cluster.

NOTE: with `ray_address` set (OmniLLM(..., ray_address="auto" | "HOST:PORT"), `omnistage serve
--ray-address`), a stage whose worker is "ray" (every stage, unless the YAML or stage_worker
says otherwise) runs in a StageActor: the same StageHost a stage process runs (the worker and
its requests' links), built on the node Ray chose. Each actor gets a placement group of one
bundle (the stage's `placement:` CPUs, GPUs and custom resources), so Ray reserves the node's
resources before the model is built, and a re-placed stage gets a fresh reservation anywhere
in the cluster. The orchestrator talks to an actor as to a stage process (RayStage has
ProcessStage's face): control down by actor calls, events up by a long poll. Data between two
actors (thinker rows, codes) goes actor to actor through Ray's object store (`ray.put`, then
the downstream actor's `data` call resolves it), moved to the CPU first, as another node
cannot open a CUDA handle; a link into a stage of the orchestrator's process comes up with the
events. A node that is lost takes its actors with it: the poll of each fails, the orchestrator
fails the requests that actor held and re-places it (a new placement group and actor; its
upstream actors get its new handle)."""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from typing import Any

import torch

from omnistage.runtime.process import STATS_INTERVAL, StageProcessSpec, pack_events
from omnistage.runtime.stage import StageEvent, StageHost, move_tensors

log = logging.getLogger("omnistage.runtime")

MAX_ADDRESS_LEN = 256
POLL_WAIT_S = 0.05  # an actor's poll returns after this long when it has nothing to report
CPU = torch.device("cpu")
DRIVER = "driver"  # the sender id of the orchestrator's messages (one per actor incarnation)


def check_ray_address(address: Any) -> str | None:
    """`ray_address`: None, "auto" or "[ray://]HOST:PORT" (ValueError naming the field)."""
    if address is None:
        return None
    if not isinstance(address, str) or not address.strip() or len(address) > MAX_ADDRESS_LEN:
        raise ValueError(f"ray_address: {address!r}; 'auto' or 'HOST:PORT' (a Ray cluster's "
                         "GCS address)")
    address = address.strip()
    if address != "auto":
        host, _, port = address.removeprefix("ray://").rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"ray_address: {address!r}; 'auto' or 'HOST:PORT' with a port in "
                             "1..65535")
    return address


def connect(address: str) -> None:
    """Join the Ray cluster at `address` as its driver (once per process)."""
    try:
        import ray
    except ImportError as e:
        raise ValueError("ray_address: Ray is not installed (pip install 'omnistage[ray]')") \
            from e
    if ray.is_initialized():
        return
    try:
        ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING,
                 log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise ValueError(f"ray_address: cannot join the Ray cluster at {address!r}: {e}") from e


def placement_options(pipeline: Any, options: dict[str, Any],
                      pipeline_cls: type | None = None) -> dict[str, Any]:
    """The constructor's options with `ray_address` taken out: when set, Ray is joined and
    every stage goes on Ray (unless `stage_worker` names another worker); a YAML stage with
    `worker: ray` needs it (ValueError naming the field). pipeline_cls: the model's Pipeline
    class; image (diffusion) pipelines are not placed on Ray (ValueError naming ray_address)."""
    opts = dict(options)
    address = check_ray_address(opts.pop("ray_address", None))
    if address is not None and pipeline_cls is not None:
        from omnistage.models.diffusion_pipeline import ImagePipeline
        if issubclass(pipeline_cls, ImagePipeline):
            # not built for Ray placement (never tested there): refused, not silently ignored
            raise ValueError(f"ray_address: {pipeline_cls.family} (diffusion) pipelines run "
                             "their stages in this process; Ray placement serves omni "
                             "pipelines (drop --ray-address / ray_address)")
    worker = opts.get("stage_worker")
    if address is None:
        for i, stage in enumerate(pipeline.stages):
            if stage.worker == "ray" and worker in (None, "ray"):
                raise ValueError(f"stages[{i}].worker: 'ray' needs ray_address (the Ray "
                                 "cluster to place the stage on)")
        if worker == "ray":
            raise ValueError("stage_worker: 'ray' needs ray_address")
        return opts
    connect(address)
    if worker is None and not any(s.worker == "ray" for s in pipeline.stages):
        opts["stage_worker"] = "ray"
    return opts


# ------------------------------------------------------------------------- actor side
class StageActor:
    """A stage unit on a Ray node: its StageHost stepped by a thread of its own; Ray calls
    (threaded actor) put control and link data in its inbox and take events out.

    NOTE: a threaded actor runs its calls in any order, not in the order they were sent; so
    every message in carries its sender's id and sequence number, and goes to the inbox in
    each sender's order (a talker fed thinker rows out of order samples other codes)."""

    def __init__(self, spec: StageProcessSpec, out_edges: dict[str, Any]) -> None:
        from omnistage.runtime.process import build_stage_worker
        if spec.num_threads:  # else torch's default, as in a stage process (same numerics)
            torch.set_num_threads(spec.num_threads)
        self.spec, self.out_edges = spec, dict(out_edges)
        self.inbox: queue.Queue = queue.Queue()
        self.order_lock = threading.Lock()
        self.next_seq: dict[str, int] = {}  # per sender: the next message due in the inbox
        self.held: dict[str, dict[int, tuple]] = {}  # per sender: arrived before their turn
        # this incarnation's sender id (a re-placed actor's messages count from 0 again)
        self.sender = f"{spec.unit}@{uuid.uuid4().hex[:12]}"
        self.out_seq: dict[str, int] = {}  # per downstream actor: the next sequence number
        self.outbox: list[tuple] = []
        self.cond = threading.Condition()
        self.host = StageHost(build_stage_worker(spec), self._deliver)
        self.delay, self.steps, self.busy_seconds, self.link_messages = 0.0, 0, 0.0, 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name=f"omnistage-{spec.stage}",
                                       daemon=True)
        self.thread.start()

    # ----------------------------------------------------------- Ray calls
    def where(self) -> dict[str, Any]:
        import os

        import ray
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}

    def send(self, sender: str, seq: int, msg: tuple) -> None:
        self._in_order(sender, seq, msg)

    def data(self, sender: str, seq: int, request_id: str, index: int, msg: Any) -> None:
        """Link data from upstream (resolved from Ray's object store by the call)."""
        self._in_order(sender, seq, ("link", request_id, index, msg))

    def _in_order(self, sender: str, seq: int, msg: tuple) -> None:
        with self.order_lock:
            held = self.held.setdefault(sender, {})
            held[seq] = msg
            due = self.next_seq.get(sender, 0)
            while due in held:
                self.inbox.put(held.pop(due))
                due += 1
            self.next_seq[sender] = due

    def poll(self, wait_s: float) -> list[tuple]:
        with self.cond:
            if not self.outbox:
                self.cond.wait(min(max(wait_s, 0.0), 1.0))
            out, self.outbox = self.outbox, []
        return out

    # ----------------------------------------------------------- the stage's thread
    def _up(self, msg: tuple) -> None:
        with self.cond:
            self.outbox.append(msg)
            self.cond.notify_all()

    def _deliver(self, downstream: str, request_id: str, index: int, msg: Any) -> None:
        msg = move_tensors(msg, CPU)  # another node cannot open this GPU's memory
        actor = self.out_edges.get(downstream)
        if actor is None:  # the downstream stage runs in the orchestrator's process
            self._up(("data", downstream, request_id, index, msg))
            return
        import ray
        seq = self.out_seq.get(downstream, 0)
        self.out_seq[downstream] = seq + 1
        actor.data.remote(self.sender, seq, request_id, index, ray.put(msg))

    def _stats(self) -> dict[str, float]:
        return dict(self.host.stats(), steps=self.steps, busy_seconds=self.busy_seconds,
                    link_messages=self.link_messages)

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "submit":
            try:
                self.host.submit(*msg[1:])
            except Exception as e:  # noqa: BLE001 - a request rejected at submit fails alone
                if not isinstance(e, ValueError):
                    log.exception("request %s: submit raised", msg[1])
                self._up(("events", pack_events([StageEvent(
                    self.spec.stage, msg[1], finished=True, finish_reason="error",
                    error=str(e) if isinstance(e, ValueError)
                    else f"request failed at submit: {type(e).__name__}: {e}")])))
        elif kind == "abort":
            self.host.abort(msg[1])
        elif kind in ("data", "link"):
            self.link_messages += kind == "link"
            self.host.receive(*msg[1:])
        elif kind == "relink_out":  # a re-placed downstream actor: its count starts again
            self.out_edges[msg[1]] = msg[2]
            self.out_seq.pop(msg[1], None)
        elif kind == "delay":
            self.delay = float(msg[1])
        elif kind == "stats":
            self._up(("stats", self._stats()))
        elif kind == "stop":
            self.stopped.set()

    def _loop(self) -> None:
        self._up(("stats", self._stats()))
        last_stats = time.monotonic()
        while not self.stopped.is_set():
            # idle or stalled (gated on upstream rows): wait for a message, else just drain
            wait = 0.05 if not self.host.has_work() or self.host.stalled else 0.0
            try:
                msg = self.inbox.get(timeout=wait) if wait else self.inbox.get_nowait()
            except queue.Empty:
                msg = None
            while msg is not None:
                self._handle(msg)
                try:
                    msg = self.inbox.get_nowait()
                except queue.Empty:
                    msg = None
            if self.host.has_work():
                if self.delay:
                    time.sleep(self.delay)
                t0 = time.perf_counter()
                try:
                    events = self.host.step()
                except Exception as e:  # noqa: BLE001 - its culprits fail alone
                    log.error("stage %s: a step raised; finding the requests that make it "
                              "raise", self.spec.stage, exc_info=e)
                    events = self.host.recover(e)
                self.busy_seconds += time.perf_counter() - t0
                self.steps += 1
                if events:
                    self._up(("events", pack_events(events)))
                if not self.host.has_work():
                    self._up(("stats", self._stats()))
            if time.monotonic() - last_stats > STATS_INTERVAL:
                last_stats = time.monotonic()
                self._up(("stats", self._stats()))
        close = getattr(self.host.worker, "close", None)
        if close is not None:  # stopped: free what outlives requests (a stage's TP ranks)
            try:
                close()
            except Exception:  # noqa: BLE001 - the actor goes away regardless
                log.exception("stage %s: close failed", self.spec.stage)


_ACTOR_CLASS: Any = None


def actor_class() -> Any:
    global _ACTOR_CLASS
    if _ACTOR_CLASS is None:
        import ray
        _ACTOR_CLASS = ray.remote(StageActor)
    return _ACTOR_CLASS


# ------------------------------------------------------------------------- driver side
class RayStage:
    """The orchestrator's handle on one stage unit placed as a Ray actor (ProcessStage's
    face: start, send, submit, abort, receive, poll, stats, stop; plus restart)."""

    conn = None  # no pipe to wait on: polled
    proc = None

    def __init__(self, spec: StageProcessSpec) -> None:
        self.spec, self.name = spec, spec.stage
        self.actor: Any = None
        self.pg: Any = None
        self.out_edges: dict[str, RayStage | None] = {}
        self.ready = self.dead = False
        self.restarts = 0
        self.last_stats: dict[str, float] = {}
        self.stats_replies = 0
        self.step_delay = 0.0
        self.node_id: str | None = None
        self.pid: int | None = None  # the actor's process (on its node)
        self.cause = ""
        self._ready_ref: Any = None
        self._poll_ref: Any = None
        self._seq = 0  # messages sent to the current actor (it puts them in this order)

    def bundle(self) -> dict[str, float]:
        """The placement group bundle of this unit: the stage's `placement:` resources."""
        placement = self.spec.pipeline.stage(self.spec.stage).placement
        gpus = placement.num_gpus
        if gpus is None:
            devices = self.spec.placement.devices if self.spec.placement else (self.spec.device,)
            gpus = float(sum(d.startswith("cuda") for d in devices))
        out = {"CPU": placement.num_cpus, **placement.resources}
        if gpus:
            out["GPU"] = gpus
        return {k: v for k, v in out.items() if v}

    def start(self, out_edges: dict[str, RayStage | None]) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        self.out_edges = dict(out_edges)
        bundle = self.bundle()
        self.pg = placement_group([bundle] if bundle else [{"CPU": 0.001}], strategy="PACK",
                                  name=f"omnistage-{self.spec.unit}-{self.restarts}")
        handles = {d: s.actor if s is not None else None for d, s in self.out_edges.items()}
        self.actor = actor_class().options(
            num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
            resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
            max_concurrency=4, max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, 0),
        ).remote(self.spec, handles)
        self._seq = 0
        self._ready_ref = self.actor.where.remote()
        self._poll_ref = None
        self.ready = self.dead = False
        if self.step_delay:
            self.send(("delay", self.step_delay))

    def restart(self) -> None:
        """Re-place: a new placement group and actor (wherever the cluster has room)."""
        self._release()
        self.start(self.out_edges)

    def death(self) -> str:
        return f"its Ray actor was lost ({self.cause})"

    def send(self, msg: tuple) -> None:
        if self.dead or self.actor is None:
            return
        if msg[0] == "relink_out" and isinstance(msg[2], RayStage):
            self.out_edges[msg[1]] = msg[2]
            msg = (msg[0], msg[1], msg[2].actor)
        self.actor.send.remote(DRIVER, self._next_seq(), msg)

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq - 1

    def submit(self, request_id: str, request: Any, links: list) -> None:
        self.send(("submit", request_id, request, links))

    def abort(self, request_id: str) -> None:
        self.send(("abort", request_id))

    def receive(self, request_id: str, index: int, msg: Any) -> None:
        """Link data from a stage of the orchestrator's process, through the object store."""
        if self.dead or self.actor is None:
            return
        import ray
        self.actor.data.remote(DRIVER, self._next_seq(), request_id, index,
                               ray.put(move_tensors(msg, CPU)))

    def set_step_delay(self, seconds: float) -> None:
        self.step_delay = seconds
        self.send(("delay", seconds))

    def has_work(self) -> bool:
        return False  # it steps itself

    def poll(self) -> list[tuple]:
        """What the actor has reported (non-blocking); sets `dead` when it is lost."""
        import ray
        from ray.exceptions import RayActorError, RayError
        out: list[tuple] = []
        if self.dead or self.actor is None:
            return out
        try:
            if self._ready_ref is not None and ray.wait([self._ready_ref], timeout=0)[0]:
                where = ray.get(self._ready_ref)
                self._ready_ref, self.ready = None, True
                self.node_id, self.pid = where["node_id"], where["pid"]
                out.append(("ready", where["pid"]))
            if self._poll_ref is None:
                self._poll_ref = self.actor.poll.remote(POLL_WAIT_S)
            if ray.wait([self._poll_ref], timeout=0)[0]:
                ref, self._poll_ref = self._poll_ref, None
                out += ray.get(ref)
                self._poll_ref = self.actor.poll.remote(POLL_WAIT_S)
        except (RayActorError, RayError) as e:  # its node (or its process) is gone
            self.dead, self.cause = True, f"{type(e).__name__}: {str(e)[:300]}"
        return out

    def stats(self) -> dict[str, float]:
        return dict(self.last_stats, restarts=self.restarts, alive=float(not self.dead))

    def _release(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group
        if self.actor is not None:
            ray.kill(self.actor, no_restart=True)
        if self.pg is not None:
            remove_placement_group(self.pg)
        self.actor = self.pg = None
        self._ready_ref = self._poll_ref = None

    def stop(self, timeout: float) -> None:
        if self.actor is not None and not self.dead:
            self.actor.send.remote(DRIVER, self._next_seq(), ("stop",))
        self._release()
        self.dead = True
