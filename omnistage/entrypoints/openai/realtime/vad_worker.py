"""Server VAD off the event loop: one thread, shared by every session of the process, runs the
Silero network for all the audio the sessions have appended since its last pass, every
session's pending windows in one batched forward per step (vad.detect_batch), and hands each
append's events back to its session's event loop in the order the appends came.

A session awaits its append's events before it handles its next client event (the receive loop
is serial), so its event order and the events' ms values are those of TurnDetector.feed; only
the network's arithmetic moves to the worker thread, where many sessions' 32 ms windows cost
one forward instead of one each on the event loop."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass

import numpy as np

from omnistage.entrypoints.openai.realtime.vad import TurnDetector, VadEvent, detect_batch

log = logging.getLogger("omnistage.realtime")


@dataclass
class _Job:
    detector: TurnDetector
    pcm16: np.ndarray
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[list[VadEvent]]


class VadWorker:
    """The VAD thread (started on first use, a daemon: it holds no resources to release)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self.steps = 0  # (tests, metrics) forwards run, and the most windows in one
        self.largest_batch = 0

    async def feed(self, detector: TurnDetector, pcm16: np.ndarray) -> list[VadEvent]:
        """The events `pcm16` (int16 at 24 kHz, appended to `detector`'s session) completes,
        as detector.feed(pcm16) would give them. A detector is fed by one task at a time."""
        loop = asyncio.get_running_loop()
        job = _Job(detector, pcm16, loop, loop.create_future())
        self._ensure_thread()
        self._jobs.put(job)
        return await job.future

    def _ensure_thread(self) -> None:
        with self._start_lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="omnistage-vad",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            jobs = [self._jobs.get()]
            while True:  # everything appended since the last pass, in arrival order
                try:
                    jobs.append(self._jobs.get_nowait())
                except queue.Empty:
                    break
            try:
                results: list[list[VadEvent]] | Exception = detect_batch(
                    [(job.detector, job.pcm16) for job in jobs], self._observe)
            except Exception as e:  # (passed on to every waiting session, which reports it)
                log.exception("server VAD failed on %d appended chunks", len(jobs))
                results = e
            for i, job in enumerate(jobs):
                outcome = results if isinstance(results, Exception) else results[i]
                try:
                    job.loop.call_soon_threadsafe(_resolve, job.future, outcome)
                except RuntimeError:  # its event loop is closed: nobody waits for it
                    log.debug("server VAD result dropped: its event loop is closed")

    def _observe(self, batch: int) -> None:
        self.steps += 1
        self.largest_batch = max(self.largest_batch, batch)


def _resolve(future: asyncio.Future, outcome: list[VadEvent] | Exception) -> None:
    if future.done():  # (its session was closed while it waited)
        return
    if isinstance(outcome, Exception):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


_SHARED = VadWorker()  # (cheap to make: its thread starts on the first feed)


def shared_vad_worker() -> VadWorker:
    """The process's VAD worker (one thread for every session)."""
    return _SHARED
