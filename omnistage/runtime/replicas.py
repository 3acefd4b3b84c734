"""Stage replicas: N copies of one stage behind the face of one stage host.

NOTE: a stage with `replicas: N` in its YAML runs N workers (in this process, in stage
processes or as Ray actors); each is a unit of the runtime, named `unit_name(stage, r, N)`.
The orchestrator addresses a stage by its name; a ReplicaSet answers for the stage and routes
per request: a new request goes to the least-loaded replica (fewest requests it holds; ties to
the lowest index), and every later message of that request (link data, abort) goes to the
same replica until the request finishes there. A request's chunks must meet its state: a
code2wav replica holds the request's DiT context and vocoder state, a talker replica its KV
cache. A replica that fails fails only the requests routed to it."""

from __future__ import annotations

from collections import Counter
from typing import Any


def unit_name(stage: str, replica: int, replicas: int) -> str:
    """A replica's name in the runtime: the stage's name for a stage of one replica (so
    stats and metrics keep their names), else `stage/r`."""
    return stage if replicas == 1 else f"{stage}/{replica}"


class ReplicaSet:
    """The stage-level face of a replicated stage (see the module note). Replicas are stage
    hosts (StageHost, ProcessStage, RayStage): submit, receive, abort, stats."""

    def __init__(self, name: str, replicas: list[Any]) -> None:
        if len(replicas) < 2:
            raise ValueError(f"stage {name}: a ReplicaSet needs at least 2 replicas")
        self.name = name
        self.replicas = replicas
        self.assigned: dict[str, int] = {}  # request id -> its replica (until it finishes)
        self.load = [0] * len(replicas)  # requests each replica holds now
        self.served = [0] * len(replicas)  # requests each replica has been given, ever
        # how the requests a replica was given left it: finished there, finished there with an
        # error, or dropped before finishing (aborted, failed or timed out elsewhere)
        self.finished = [0] * len(replicas)
        self.failed = [0] * len(replicas)
        self.aborted = [0] * len(replicas)

    def route(self, request_id: str) -> int:
        """The request's replica: its own, or (new) the least-loaded one."""
        r = self.assigned.get(request_id)
        if r is None:
            r = min(range(len(self.replicas)), key=lambda i: (self.load[i], i))
            self.assigned[request_id] = r
            self.load[r] += 1
            self.served[r] += 1
        return r

    def release(self, request_id: str, failed: bool = False) -> None:
        """The request finished on this stage (with an error: `failed`): its replica's load
        drops."""
        r = self.assigned.pop(request_id, None)
        if r is not None:
            self.load[r] -= 1
            if failed:
                self.failed[r] += 1
            else:
                self.finished[r] += 1

    def replica_of(self, request_id: str) -> int | None:
        return self.assigned.get(request_id)

    def requests_on(self, replica: int) -> list[str]:
        return [rid for rid, r in self.assigned.items() if r == replica]

    # ------------------------------------------------------------ the stage host's face
    def submit(self, request_id: str, request: Any, links: list) -> None:
        self.replicas[self.route(request_id)].submit(request_id, request, links)

    def receive(self, request_id: str, index: int, msg: Any) -> None:
        # the orchestrator submits downstream stages first, so a request has its replica by
        # the time data for it arrives; route() keeps a stray message's replica sticky
        self.replicas[self.route(request_id)].receive(request_id, index, msg)

    def abort(self, request_id: str) -> None:
        r = self.assigned.pop(request_id, None)
        if r is not None:  # (a request that finished here was released already)
            self.replicas[r].abort(request_id)
            self.load[r] -= 1
            self.aborted[r] += 1

    def stats(self) -> dict[str, float]:
        """The replicas' numbers added up (per-replica numbers: replica_stats)."""
        total: Counter = Counter()
        peaks: dict[str, float] = {}
        for s in self.replica_stats():
            for k, v in s.items():
                if not isinstance(v, (int, float)) or isinstance(v, bool):
                    continue
                if k.startswith("max_"):  # a peak is the replicas' largest, not their sum
                    peaks[k] = max(peaks.get(k, float(v)), float(v))
                else:
                    total[k] += float(v)
        out = {**total, **peaks}
        out["replicas"] = float(len(self.replicas))
        return out

    def replica_stats(self) -> list[dict[str, float]]:
        """Each replica's own stats, with its requests: routed (given to it, ever), holding
        (now), finished, failed (finished with an error) and aborted (dropped before
        finishing)."""
        return [dict(rep.stats(), routed=float(self.served[r]), holding=float(self.load[r]),
                     finished=float(self.finished[r]), failed=float(self.failed[r]),
                     aborted=float(self.aborted[r]))
                for r, rep in enumerate(self.replicas)]
