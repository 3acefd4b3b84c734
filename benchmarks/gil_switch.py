"""The runtime thread beside a busy event loop, at Python's default GIL switch interval (5 ms)
and at 0.5 ms, in one run. (The Python API keeps Python's interval: the 7B engine side on an
H200 was not faster with 0.5 ms in session 20. `omnistage serve` runs at 0.5 ms since session 31,
`--switch-interval-ms`: over alternating starts on an H200 it beat 5 ms at c32;
docs/quickstart.md.)

A model of the server process, no GPU needed: the "runtime" thread runs steps of `--launch-ms`
of Python (launch), `--gpu-ms` with the GIL released (waiting for the GPU), `--launch-ms` again
(collect); the "HTTP loop" thread encodes a burst of `--burst-ms` of Python every `--period-ms`
(a decode step's streamed chunks). Reports each interval's step time over the ideal (the step
alone, no loop) and the steps per second.

    python -m benchmarks.gil_switch --out benchmarks/results/gil_switch_cpu.json"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

from benchmarks.common import write_result

DEFAULT_INTERVAL_S = 0.005  # CPython's
SHORT_INTERVAL_S = 0.0005


def python_work(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def run(args, interval: float | None, with_loop: bool) -> float:
    """Seconds per runtime step."""
    saved = sys.getswitchinterval()
    if interval is not None:
        sys.setswitchinterval(interval)
    stop = threading.Event()

    def http_loop() -> None:
        while not stop.is_set():
            python_work(args.burst_ms / 1e3)
            time.sleep((args.period_ms - args.burst_ms) / 1e3)

    loop = threading.Thread(target=http_loop, daemon=True)
    try:
        if with_loop:
            loop.start()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            python_work(args.launch_ms / 1e3)
            time.sleep(args.gpu_ms / 1e3)
            python_work(args.launch_ms / 1e3)
        return (time.perf_counter() - t0) / args.steps
    finally:
        stop.set()
        if with_loop:
            loop.join()
        sys.setswitchinterval(saved)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--launch-ms", type=float, default=0.3)
    ap.add_argument("--gpu-ms", type=float, default=10.0)
    ap.add_argument("--burst-ms", type=float, default=8.0)
    ap.add_argument("--period-ms", type=float, default=60.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    for name in ("steps", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name}: must be >= 1")
    if not 0 < args.burst_ms < args.period_ms:
        ap.error("--burst-ms: must be > 0 and under --period-ms")
    load = os.getloadavg()
    ideal = min(run(args, None, False) for _ in range(args.repeats))
    result: dict = {"config": {**vars(args), "cpu_count": os.cpu_count()},
                    "ideal_step_ms": round(ideal * 1e3, 3), "intervals": {}}
    for interval in (DEFAULT_INTERVAL_S, SHORT_INTERVAL_S):
        step = min(run(args, interval, True) for _ in range(args.repeats))
        result["intervals"][f"{interval * 1e3:g}ms"] = {
            "step_ms": round(step * 1e3, 3), "over_ideal_ms": round((step - ideal) * 1e3, 3),
            "steps_per_s": round(1 / step, 1)}
    write_result(result, args.out, load)


if __name__ == "__main__":
    main()
