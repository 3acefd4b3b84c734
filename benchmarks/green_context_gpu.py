"""Does a decode step get SMs beside big GEMMs? Stream priority vs CUDA green contexts.

A talker-sized probe step (24 x (gate/up [37888, 896] + down [896, 18944]) at batch 32, one
CUDA graph) replays on a priority -2 stream, at most 2 steps queued (as an AR engine runs),
while a CUDA graph of big bf16 GEMMs (stand-in for the DiT's) replays on a priority-0 stream,
captured either there ("primary": every SM) or on a green context that leaves `free` SMs
(`green_free{free}`: the graph's kernels are bound to the other SMs wherever it replays).
Reports per mode: the GEMM graph's time alone and beside the probes, the probe steps done
meanwhile and their ms per step (alone: `probe_alone_ms`). This is what code2wav's free_sms
(engine/gen/graphs.py, for code2wav_graphs.py) rests on.

  python benchmarks/green_context_gpu.py --out benchmarks/results/green_context_gpu_h100.json
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

from benchmarks.common import timed, write_result
from omnistage.engine.streams import green_context_stream, private_stream


def capture(fn, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    with torch.cuda.stream(stream):
        fn()  # warm-up: cuBLAS handles and workspaces of this stream
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    return graph


def replay_on(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream):
    def run() -> None:
        with torch.cuda.stream(stream):
            graph.replay()
    return run


def beside(big: torch.cuda.CUDAGraph, big_stream: torch.cuda.Stream,
           probe: torch.cuda.CUDAGraph, probe_stream: torch.cuda.Stream) -> dict:
    """The big graph once, with probe steps queued beside it until it ends."""
    torch.cuda.synchronize()
    base, start, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    with torch.cuda.stream(probe_stream):
        base.record()
    with torch.cuda.stream(big_stream):
        start.record()
        big.replay()
        end.record()
    ends: list[torch.cuda.Event] = []
    while not end.query() and len(ends) < 5000:
        if len(ends) >= 2:
            ends[-2].synchronize()
        with torch.cuda.stream(probe_stream):
            probe.replay()
            ends.append(torch.cuda.Event(enable_timing=True))
            ends[-1].record()
    torch.cuda.synchronize()
    t0, t1 = base.elapsed_time(start), base.elapsed_time(end)
    during = sum(t0 <= base.elapsed_time(e) <= t1 for e in ends)
    return {"big_ms": round(t1 - t0, 2), "probe_steps_during": during,
            "probe_ms_per_step_during": round((t1 - t0) / max(1, during), 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--free", default="16,32,48", help="SMs left free, comma-separated")
    ap.add_argument("--gemms", type=int, default=40, help="8192^3 bf16 GEMMs in the big graph")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("green_context_gpu.py: needs a CUDA device")
    load = os.getloadavg()
    dev = torch.device("cuda", torch.cuda.current_device())
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    gen = torch.Generator(device=dev).manual_seed(0)
    a, b = (torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16, generator=gen)
            for _ in range(2))
    x = torch.randn(32, 896, device=dev, dtype=torch.bfloat16, generator=gen)
    w_gate_up = torch.randn(37888, 896, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
    w_down = torch.randn(896, 18944, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02

    def gemms() -> None:
        for _ in range(args.gemms):
            torch.mm(a, b)

    def probe_step() -> None:
        for _ in range(24):
            F.linear(F.linear(x, w_gate_up)[:, :18944], w_down)

    hi, lo = private_stream(dev, -2), private_stream(dev, 0)
    probe = capture(probe_step, hi)
    res: dict = {"config": {"device": torch.cuda.get_device_name(dev), "sms": sms,
                            "torch": torch.__version__, "gemms": args.gemms},
                 "probe_alone_ms": timed(replay_on(probe, hi), 20)}
    modes = {"primary": (lo, None)}
    contexts = []  # alive as long as their streams
    for free in (int(f) for f in args.free.split(",") if f):
        context, stream = green_context_stream(dev, sms - free)
        contexts.append(context)
        modes[f"green_free{free}"] = (stream, free)
    for name, (stream, free) in modes.items():
        big = capture(gemms, stream)
        res[name] = {"big_alone_ms": timed(replay_on(big, stream), 2, 2),
                     **beside(big, stream, probe, hi)}
        if free is not None:
            res[name]["free_sms"] = free
    write_result(res, args.out, load)


if __name__ == "__main__":
    main()
