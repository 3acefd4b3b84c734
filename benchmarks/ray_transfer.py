"""Moving a stage's output between two Ray nodes (CPU, a 2-node cluster on loopback): the
payloads the Qwen2.5-Omni pipeline moves (thinker hidden rows fp32 / bf16 [T, 3584], talker
codes int64 [N], code2wav audio fp32 [24000 * k]), between an actor on node_a and one on node_b,
timed two ways:
  object_store:  the sender ray.put()s it, the receiver on the other node ray.get()s it (the
                 runtime's path between stage actors: runtime/ray_placement.py);
  actor_arg:     the tensor as an argument of the receiver's method (Ray inlines small ones,
                 puts large ones in the object store itself).
Each timing is the sender's clock around the move and the receiver's reply that it holds the
tensor (one actor-call round trip included; `empty_call_us` is that round trip alone). Per
payload: p50 / p90 latency in microseconds and MB/s at p50. JSON to stdout and --out. Run:
    PYTHONPATH=$PWD python benchmarks/ray_transfer.py \
        --out benchmarks/results/ray_transfer_cpu_$(date -u +%F).json
The cluster is started and stopped here (tests/runtime/ray_loopback.py: every Ray process on
127.0.0.1, stopped by pid), so nothing else on the machine is touched."""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # omnistage, tests, benchmarks
from benchmarks.common import free_port, write_result  # noqa: E402

HIDDEN = 3584  # Qwen2.5-Omni-7B thinker width
SAMPLE_RATE = 24000  # code2wav output
MAX_REPS = 10_000
CALL_TIMEOUT_S = 60.0  # any single Ray call (a hang fails the run, never blocks it)


def payloads(audio_seconds: list[int]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for dtype, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        out.update({f"hidden_rows_{tag}_T{t}": ((t, HIDDEN), dtype) for t in (1, 16, 128, 1024)})
    out.update({f"codes_int64_N{n}": ((n,), torch.int64) for n in (1, 24, 600)})
    out.update({f"audio_fp32_{k}s": ((SAMPLE_RATE * k,), torch.float32) for k in audio_seconds})
    return out


def make(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    return torch.randint(0, 8192, shape, dtype=dtype)


def summarize(times_s: list[float], nbytes: int) -> dict:
    times = sorted(times_s)
    p50 = statistics.median(times)
    return {"p50_us": round(1e6 * p50, 1),
            "p90_us": round(1e6 * times[int(0.9 * (len(times) - 1))], 1),
            "MB_per_s_p50": round(nbytes / p50 / 1e6, 2)}


class Receiver:
    """On node_b: takes the tensor (from the object store, or as its argument)."""

    def ping(self) -> int:
        return 0

    def fetch(self, refs: list) -> int:
        import ray
        tensor = ray.get(refs[0], timeout=CALL_TIMEOUT_S)  # pulled from node_a's store
        return tensor.numel()

    def take(self, tensor: torch.Tensor) -> int:
        return tensor.numel()


class Sender:
    """On node_a: makes each payload and times its moves to the receiver."""

    def __init__(self, receiver) -> None:
        self.receiver = receiver

    def where(self) -> str:
        import ray
        return ray.get_runtime_context().get_node_id()

    def empty_calls(self, reps: int, warmup: int) -> list[float]:
        import ray
        times = []
        for i in range(warmup + reps):
            t0 = time.perf_counter()
            ray.get(self.receiver.ping.remote(), timeout=CALL_TIMEOUT_S)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        return times

    def run(self, shape: tuple[int, ...], dtype: torch.dtype, reps: int,
            warmup: int) -> dict[str, list[float]]:
        import ray
        tensor = make(shape, dtype)
        out: dict[str, list[float]] = {"object_store": [], "actor_arg": []}
        for i in range(warmup + reps):
            t0 = time.perf_counter()
            ref = ray.put(tensor)
            numel = ray.get(self.receiver.fetch.remote([ref]), timeout=CALL_TIMEOUT_S)
            t1 = time.perf_counter()
            del ref
            numel2 = ray.get(self.receiver.take.remote(tensor), timeout=CALL_TIMEOUT_S)
            t2 = time.perf_counter()
            if numel != tensor.numel() or numel2 != tensor.numel():
                raise RuntimeError(f"received {numel}/{numel2} elements of {tensor.numel()}")
            if i >= warmup:
                out["object_store"].append(t1 - t0)
                out["actor_arg"].append(t2 - t1)
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=20, help="timed moves per payload and way")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--audio-seconds", type=int, nargs="+", default=[1, 10],
                   help="code2wav chunks of 24000 * k samples")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not 1 <= args.reps <= MAX_REPS or not 0 <= args.warmup <= MAX_REPS:
        ap.error(f"--reps: 1..{MAX_REPS}, --warmup: 0..{MAX_REPS}")
    if not all(1 <= k <= 60 for k in args.audio_seconds):
        ap.error("--audio-seconds: each 1..60")
    load_before = os.getloadavg()

    import ray

    from tests.runtime import ray_loopback
    temp_dir = Path(tempfile.mkdtemp(prefix="rayb", dir="/tmp"))  # short: unix socket paths
    started = time.monotonic()
    cluster = ray_loopback.LoopbackCluster(temp_dir, free_port(), num_cpus=1,
                                           resources={"node_a": 1})
    try:
        cluster.add_node("node_b", num_cpus=1, resources={"node_b": 1})
        ray_loopback.loopback()
        ray.init(address=cluster.address, _node_ip_address="127.0.0.1",
                 include_dashboard=False, log_to_driver=False)
        receiver = ray.remote(Receiver).options(num_cpus=1, resources={"node_b": 1}).remote()
        sender = ray.remote(Sender).options(num_cpus=1, resources={"node_a": 1}).remote(receiver)
        node_a = ray.get(sender.where.remote(), timeout=CALL_TIMEOUT_S)
        nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
        if "node_a" not in nodes[node_a]["Resources"] or len(nodes) != 2:
            raise RuntimeError(f"the sender is not on node_a of 2 nodes: {nodes}")
        empty = ray.get(sender.empty_calls.remote(args.reps, args.warmup),
                        timeout=CALL_TIMEOUT_S * 2)
        results = {}
        for name, (shape, dtype) in payloads(args.audio_seconds).items():
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            times = ray.get(sender.run.remote(shape, dtype, args.reps, args.warmup),
                            timeout=CALL_TIMEOUT_S * 4)
            results[name] = {"shape": list(shape), "dtype": str(dtype).removeprefix("torch."),
                             "bytes": nbytes,
                             **{way: summarize(t, nbytes) for way, t in times.items()}}
        sockets = ray_loopback.ray_sockets(cluster.pids() | {os.getpid()})
        off = [s.line for s in sockets if s.state == "ESTAB"
               and not (s.local_loopback and s.peer_loopback)]
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.stop()
        shutil.rmtree(temp_dir, ignore_errors=True)
    write_result({
        "benchmark": "ray_transfer",
        "date": datetime.date.today().isoformat(),
        "config": {"ray": ray.__version__, "torch": torch.__version__,
                   "cluster": "2 nodes on 127.0.0.1 (ray start --node-ip-address=127.0.0.1), "
                              "1 CPU each; sender actor on node_a, receiver on node_b",
                   "cpu_count": os.cpu_count(), "reps": args.reps, "warmup": args.warmup,
                   "wall_s": round(time.monotonic() - started, 1)},
        "empty_call_us": {k: v for k, v in summarize(empty, 1).items() if k != "MB_per_s_p50"},
        "established_sockets_checked": sum(s.state == "ESTAB" for s in sockets),
        "sockets_off_loopback": off,
        "results": results,
    }, args.out, load_before)
    if off:
        raise SystemExit(f"Ray sockets off loopback: {off}")


if __name__ == "__main__":
    main()
