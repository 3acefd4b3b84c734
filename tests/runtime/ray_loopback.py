"""A 2-node Ray cluster on one machine, on loopback only (tests and benchmarks/ray_transfer.py).

NOTE: `ray start --node-ip-address=127.0.0.1` alone is not enough: Ray 2.60 "resolves"
127.0.0.1 to the machine's interface address (services.resolve_ip_for_localhost), so its GCS,
raylets and agents talked over 192.0.2.x. Each node is started by this module's launcher,
which makes Ray's own address probe answer 127.0.0.1 before it runs `ray start`; the driver
does the same (`loopback()`) before ray.init. `ray_sockets` lists every TCP socket
of the cluster's processes (ss -tnap): with the above, every listener is bound to 127.0.0.1
(none to the wildcard) and every connection has both ends there."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

OBJECT_STORE_BYTES = 200_000_000  # the least Ray accepts with room for rows and codes


def loopback() -> None:
    """In this process: Ray's node-address probe answers 127.0.0.1 (no interface address)."""
    from ray._private import services
    services.node_ip_address_from_perspective = lambda address=None: "127.0.0.1"


def _ray_start(args: list[str], temp_dir: Path, timeout: float) -> None:
    here = str(Path(__file__).parent)
    code = (f"import sys; sys.path.insert(0, {here!r}); import ray_loopback; "
            "ray_loopback.loopback(); from ray.scripts.scripts import main; "
            "sys.argv = ['ray'] + sys.argv[1:]; main()")
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    head = ["--include-dashboard=false"] if "--head" in args else []
    cmd = [sys.executable, "-c", code, "start", "--node-ip-address=127.0.0.1", *head,
           "--disable-usage-stats", f"--object-store-memory={OBJECT_STORE_BYTES}", *args]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=temp_dir)
    if done.returncode != 0:
        raise RuntimeError(f"ray start failed ({done.returncode}): {done.stderr[-2000:]}")


def _raylet_pids() -> set[int]:
    out = subprocess.run(["ps", "-ww", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    return {int(line.split()[0]) for line in out.splitlines()
            if "ray/raylet/raylet" in line.split(None, 1)[1][:300]}


class LoopbackCluster:
    """A head node (no CPUs: it holds the GCS, the driver connects to it) and worker nodes
    that run the actors, each `ray start`ed on 127.0.0.1; stopped by pid (never `ray stop`,
    which would stop every Ray on the machine)."""

    def __init__(self, temp_dir: Path, port: int, timeout: float = 60.0, num_cpus: int = 0,
                 resources: dict[str, float] | None = None) -> None:
        """temp_dir: short (Ray's unix sockets live under it: paths over 107 bytes fail);
        num_cpus / resources: the head node's (default none but {"head": 1}: GCS only)."""
        self.temp_dir, self.port, self.timeout = temp_dir, port, timeout
        temp_dir.mkdir(parents=True, exist_ok=True)
        self.address = f"127.0.0.1:{port}"
        self.nodes: dict[str, int] = {}  # node name -> its raylet pid
        before = _raylet_pids()
        try:
            _ray_start(["--head", f"--port={port}", f"--num-cpus={num_cpus}",
                        f"--temp-dir={temp_dir}",
                        "--resources=" + json.dumps(resources or {"head": 1}),
                        "--system-config=" + json.dumps({
                            # a lost node is declared dead within ~2 s (default ~30 s)
                            "health_check_period_ms": 500, "health_check_timeout_ms": 500,
                            "health_check_failure_threshold": 3,
                            # workers at the raylet's priority: Ray's default (nice 15) starves
                            # the stage actors on a busy machine (minutes to import torch)
                            "worker_niceness": 0})], temp_dir, timeout)
            self.nodes["head"] = self._new_raylet(before)
        except (RuntimeError, OSError, subprocess.TimeoutExpired):
            self.stop()  # whatever did start
            raise

    def _new_raylet(self, before: set[int]) -> int:
        new = _raylet_pids() - before
        if len(new) != 1:
            raise RuntimeError(f"expected one new raylet, found {sorted(new)}")
        return new.pop()

    def add_node(self, name: str, num_cpus: int = 1,
                 resources: dict[str, float] | None = None) -> int:
        """A worker node with `num_cpus` and custom `resources` (default: {name: 1})."""
        before = _raylet_pids()
        _ray_start([f"--address={self.address}", f"--num-cpus={num_cpus}",
                    "--resources=" + json.dumps(resources or {name: 1})], self.temp_dir,
                   self.timeout)
        self.nodes[name] = self._new_raylet(before)
        return self.nodes[name]

    def kill_node(self, name: str) -> None:
        """The node's raylet and its workers, killed (a lost machine)."""
        pid = self.nodes.pop(name)
        for child in self._descendants(pid):
            _kill(child)
        _kill(pid)

    def kill_workers(self) -> list[int]:
        """Every worker process (actors, idle workers; not the GCS, raylets or their agents):
        a hung call on an actor then fails, while the cluster (and the driver) stay up."""
        out = subprocess.run(["ps", "-ww", "-eo", "pid=,args="], capture_output=True,
                             text=True).stdout
        ours = self.pids()
        workers = [int(line.split()[0]) for line in out.splitlines()
                   if line.split(None, 1)[1].startswith("ray::") and "Agent" not in line
                   and int(line.split()[0]) in ours]
        for pid in workers:
            _kill(pid)
        return workers

    def pids(self) -> set[int]:
        """Every process of the cluster (started from its session directory)."""
        out = subprocess.run(["ps", "-ww", "-eo", "pid=,args="], capture_output=True,
                             text=True).stdout
        mark = str(self.temp_dir)
        pids = {int(line.split()[0]) for line in out.splitlines() if mark in line}
        for pid in list(pids) + list(self.nodes.values()):
            pids |= self._descendants(pid) | {pid}
        return pids

    @staticmethod
    def _descendants(pid: int) -> set[int]:
        out = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout
        children: dict[int, list[int]] = {}
        for line in out.splitlines():
            p, pp = map(int, line.split())
            children.setdefault(pp, []).append(p)
        found, todo = set(), [pid]
        while todo:
            for c in children.get(todo.pop(), []):
                if c not in found:
                    found.add(c)
                    todo.append(c)
        return found

    def stop(self) -> None:
        for pid in self.pids():
            _kill(pid)
        time.sleep(0.5)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


LOOPBACK = ("127.0.0.1", "::1")


@dataclass(frozen=True)
class TcpSocket:
    state: str  # ss's: ESTAB, LISTEN, TIME-WAIT, ...
    local: str
    peer: str
    line: str

    @staticmethod
    def host(addr: str) -> str:
        return addr.rsplit(":", 1)[0].strip("[]").removeprefix("::ffff:").split("%")[0]

    @property
    def local_loopback(self) -> bool:
        return self.host(self.local) in LOOPBACK

    @property
    def peer_loopback(self) -> bool:
        return self.host(self.peer) in LOOPBACK



def ray_sockets(pids: set[int]) -> list[TcpSocket]:
    """Every TCP socket (ss -tnap: listening and connected) owned by one of these processes."""
    out = subprocess.run(["ss", "-tnap"], capture_output=True, text=True, timeout=10,
                         check=True).stdout
    found = []
    for line in out.splitlines()[1:]:
        owners = {int(p) for p in re.findall(r"pid=(\d+)", line)}
        if owners & pids:
            cols = line.split()
            found.append(TcpSocket(cols[0], cols[3], cols[4], line))
    return found
