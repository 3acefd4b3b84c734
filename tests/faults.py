"""Injected faults for the tests of request-fatal errors (runtime and server)."""

from __future__ import annotations

from typing import Any


def poison_talker(llm: Any, talker_seed: int) -> dict[str, int]:
    """The talker's engine raises on every step whose batch holds a sequence seeded
    `talker_seed` (a request seeded s has talker seed s + 1). Returns counters the caller can
    check: `raised` (steps that raised) and `batch` (the largest batch that held it)."""
    runner = llm.pipeline.workers["talker"].engine.runner
    launch, seen = runner.launch, {"raised": 0, "batch": 0}

    def launch_or_raise(batch, *args, **kwargs):
        if any(s.seed == talker_seed for s in batch.seqs):
            seen["raised"] += 1
            seen["batch"] = max(seen["batch"], len(batch.seqs))
            raise OverflowError("injected: this request's sampling parameters overflow")
        return launch(batch, *args, **kwargs)
    runner.launch = launch_or_raise
    return seen
