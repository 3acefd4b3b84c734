"""Start-up phases: where the seconds of building a pipeline went (each stage, its weights, its
CUDA graphs, the runtime), for the log and the server's `omnistage_startup_seconds` gauge.

OmniBase records while it builds (`recording()`); the builders mark their phases with
`phase(name)`, which nests (`thinker` -> `thinker.weights`) and does nothing when no recording
is under way (a stage built in a process of its own, a test building one stage)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

# (the phases being recorded, the enclosing phase's name)
_current: ContextVar[tuple[dict[str, float], str] | None] = ContextVar("omnistage_startup",
                                                                       default=None)


@contextmanager
def recording() -> Iterator[dict[str, float]]:
    """Collect the phases marked inside; `total` is added when the block ends."""
    phases: dict[str, float] = {}
    token = _current.set((phases, ""))
    t0 = time.perf_counter()
    try:
        yield phases
    finally:
        _current.reset(token)
        phases["total"] = time.perf_counter() - t0
        # the seconds no phase covers (CUDA's initialisation, config parsing, ...)
        phases["other"] = max(0.0, phases["total"] - sum(
            v for k, v in phases.items() if "." not in k and k != "total"))


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Time the block as `name` inside the enclosing phase (seconds add up on repeats)."""
    current = _current.get()
    if current is None:
        yield
        return
    phases, outer = current
    full = f"{outer}.{name}" if outer else name
    token = _current.set((phases, full))
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _current.reset(token)
        phases[full] = phases.get(full, 0.0) + time.perf_counter() - t0


def describe(phases: dict[str, float]) -> str:
    """One log line: `total 12.3 s; thinker 8.1 (weights 2.0, graphs 5.5); ...`."""
    top = [k for k in phases if "." not in k and k not in ("total", "other")]
    parts = []
    for name in top:
        inner = [f"{k[len(name) + 1:]} {v:.1f}" for k, v in phases.items()
                 if k.startswith(name + ".")]
        parts.append(f"{name} {phases[name]:.1f}" + (f" ({', '.join(inner)})" if inner else ""))
    if "other" in phases:
        parts.append(f"other {phases['other']:.1f}")
    return f"total {phases.get('total', 0.0):.1f} s; " + "; ".join(parts)
