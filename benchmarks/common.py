"""What the benchmark scripts share: recording the load and saving the JSON, timing, stage
placement, and the server subprocess they drive (a free loopback port, an orderly stop)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from pathlib import Path
from typing import IO


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


def parse_stage_devices(spec: str) -> dict[str, list[str]]:
    """`--stage-devices "thinker=cuda:0,talker=cuda:1,code2wav=cuda:1"` -> each stage's devices;
    `thinker=cuda:0+cuda:1` lists a stage's tensor-parallel ranks (or replicas, with
    `--replicas`)."""
    out: dict[str, list[str]] = {}
    for part in filter(None, spec.split(",")):
        name, sep, devs = part.partition("=")
        if not sep or not devs:
            raise ValueError(f"--stage-devices: {part!r}; expected stage=device[+device...]")
        out[name.strip()] = [d.strip() for d in devs.split("+")]
    return out


def pipeline_yaml(builtin: str, out: Path, per_stage: dict[str, dict],
                  keep: list[str] | None = None) -> str:
    """The built-in pipeline `builtin` with fields of some stages replaced (device, devices,
    tensor_parallel_size, worker, ...) and, with `keep`, only those stages: written to `out`
    (validated by the schema on load). Returns its path."""
    import yaml

    from omnistage.config.schema import load_pipeline
    data = load_pipeline(builtin).model_dump(mode="json", exclude_defaults=True)
    unknown = set(per_stage) - {st["name"] for st in data["stages"]}
    if unknown:
        raise ValueError(f"stages {sorted(unknown)}: not in the {builtin} pipeline")
    if keep is not None:
        data["stages"] = [st for st in data["stages"] if st["name"] in keep]
    for st in data["stages"]:
        fields = per_stage.get(st["name"], {})
        if "devices" in fields and len(fields["devices"]) == 1 and "tensor_parallel_size" \
                not in fields and fields.get("replicas", 1) == 1:
            fields = {**{k: v for k, v in fields.items() if k != "devices"},
                      "device": fields["devices"][0]}
        st.update(fields)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(data))
    return str(out)


def free_port() -> int:
    """A free TCP port on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_server(proc: subprocess.Popen, log: IO) -> None:
    """SIGTERM a server subprocess (it drains and exits), killed after 60 s; close its log."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()
