"""What every benchmark script does at the end: record the load, print and save the JSON."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_result(result: dict, out: str | None, load_before: tuple[float, float, float]) -> None:
    """Adds the 1-minute load average at start and end (other processes skew timings), prints
    the JSON and writes it to `out` when given."""
    result["config"]["loadavg_1min_start_end"] = [round(load_before[0], 2),
                                                  round(os.getloadavg()[0], 2)]
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")


def sync() -> None:
    """Wait for the GPU (if any): timings below cover the queued work."""
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, reps: int, digits: int = 3) -> float:
    """Median ms of fn over reps calls (after one untimed call)."""
    import time
    fn()
    times = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(1e3 * (time.perf_counter() - t))
    return round(sorted(times)[len(times) // 2], digits)
