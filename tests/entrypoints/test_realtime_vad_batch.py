"""Server VAD batched across sessions (vad.detect_batch, the VAD worker thread): every session
gets exactly the events (kinds and ms) its own TurnDetector.feed gives it alone, whatever the
other sessions append and however their appends are grouped into passes."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from omnistage.entrypoints.openai.realtime.vad import TurnDetector, VadEvent, detect_batch
from omnistage.entrypoints.openai.realtime.vad_worker import VadWorker
from tests.entrypoints.realtime_utils import silence, speak

PHRASES = ["What is the weather like today?", "Tell me a joke.",
           "How far away is the moon?", "Stop, wait a second."]


def _detector() -> TurnDetector:
    return TurnDetector(threshold=0.5, silence_duration_ms=400, prefix_padding_ms=300)


@pytest.fixture(scope="module")
def streams() -> list[list[np.ndarray]]:
    """Four sessions' microphones: different speech, lead-in silence and chunk sizes (480
    samples = 20 ms, as browsers send, down to odd sizes that split windows unevenly)."""
    out = []
    for k, phrase in enumerate(PHRASES):
        pcm = np.concatenate([silence(0.3 + 0.25 * k), speak(phrase), silence(0.8),
                              speak(phrase), silence(0.7)])
        size = [480, 1111, 960, 317][k]
        out.append([pcm[i:i + size] for i in range(0, len(pcm), size)])
    return out


def _alone(chunks: list[np.ndarray]) -> list[list[tuple[str, int]]]:
    det = _detector()
    return [[(e.kind, e.ms) for e in det.feed(c)] for c in chunks]


def test_batched_sessions_get_the_events_they_get_alone(streams):
    expected = [_alone(chunks) for chunks in streams]
    for per_session in expected:  # (speech found twice in each: the test sees real turns)
        kinds = [kind for chunk in per_session for kind, _ in chunk]
        assert kinds == ["start", "stop", "start", "stop"]
    detectors = [_detector() for _ in streams]
    got: list[list[list[tuple[str, int]]]] = [[] for _ in streams]
    batch_sizes: list[int] = []
    rng = np.random.default_rng(0)
    positions = [0] * len(streams)
    while any(p < len(c) for p, c in zip(positions, streams)):
        # a pass: each session's next 0-3 appended chunks, the sessions interleaved at random
        # (each one's chunks in its order)
        queued: list[list[int]] = [[] for _ in streams]
        for s, chunks in enumerate(streams):
            take = min(int(rng.integers(0, 4)), len(chunks) - positions[s])
            queued[s] = list(range(positions[s], positions[s] + take))
            positions[s] += take
        order: list[tuple[int, int]] = []  # (session, chunk index)
        while any(queued):
            s = int(rng.choice([k for k, q in enumerate(queued) if q]))
            order.append((s, queued[s].pop(0)))
        results = detect_batch([(detectors[s], streams[s][c]) for s, c in order],
                               batch_sizes.append)
        for (s, _), events in zip(order, results):
            got[s].append([(e.kind, e.ms) for e in events])
    assert got == expected
    assert max(batch_sizes) == len(streams)  # (the windows did run batched)


def test_detect_batch_refuses_detectors_of_different_networks():
    a, b = _detector(), _detector()
    b.model = type(a.model)()  # (another instance: its windows cannot share a forward)
    with pytest.raises(ValueError, match="one VAD network"):
        detect_batch([(a, silence(0.1)), (b, silence(0.1))])


def test_worker_thread_gives_each_session_its_own_events(streams):
    expected = [[ev for chunk in _alone(chunks) for ev in chunk] for chunks in streams]
    worker = VadWorker()

    async def session(chunks: list[np.ndarray]) -> list[tuple[str, int]]:
        det, events = _detector(), []
        for c in chunks:
            got: list[VadEvent] = await worker.feed(det, c)
            events += [(e.kind, e.ms) for e in got]
            await asyncio.sleep(0)  # (other sessions' appends land in the same passes)
        return events

    async def main() -> list[list[tuple[str, int]]]:
        return list(await asyncio.gather(*(session(c) for c in streams)))

    assert asyncio.run(main()) == expected
    assert worker.steps > 0
