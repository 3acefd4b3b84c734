"""Captures under load (issue 24, start-up in seconds; runtime/captures.py): after a lazy start,
a step that ran without its own graph marks that graph wanted; the runtime drains every stage
of its process (no new steps; a step queued ahead and a step in parts finish), captures the
most wanted graph, and resumes, with captures taking at most a share of the time.

Host logic on the CPU: the AR decode graphs with eager stand-ins, the code2wav decoder's
routing with a fake capturer, the workers' draining, the rate, and the background runtime
capturing while requests are unfinished."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from types import SimpleNamespace

import pytest
import torch

from omnistage import SamplingParams
from omnistage.engine.ar.sequence import Sequence
from omnistage.models.qwen2_5_omni.code2wav_plan import capture_plan
from omnistage.runtime.captures import LoadCaptures
from omnistage.runtime.stage import ARStageWorker
from tests.runtime.test_lazy_capture import (BLOCK, CUDA_WINDOW, _ar_engine, _decode,
                                             _FakeCapturer, _worker, decoder)

__all__ = ["decoder"]  # (the module fixture, used below)


# ------------------------------------------------------------------ AR decode graphs
def test_a_step_without_its_size_wants_it_and_it_is_captured_first(monkeypatch):
    eng, graphs, _ = _ar_engine(monkeypatch)
    with torch.inference_mode():
        graphs.warmup(None, [], lazy=True, load_size=1)
    assert list(graphs.later) == [2, 4] and not graphs.wants_capture()
    _decode(eng, 1)  # size 1 is captured: nothing wanted
    assert not graphs.wants_capture()
    _decode(eng, 3)  # 3 rows pad to the captured 8: cheap for a decode step, not wanted
    assert not graphs.wants_capture()
    graphs.graphs.pop((8, False, False))  # say 8 were queued too: 3 rows run eagerly at 4
    graphs.later.append(8)
    _decode(eng, 3)
    assert graphs.wants_capture() and set(graphs.wanted) == {4}
    assert graphs.capture_next() == 4  # before 2, the queue's first
    assert not graphs.wants_capture() and list(graphs.later) == [2, 8]
    assert graphs.capture_next() == 2 and graphs.capture_next() == 8
    assert graphs.capture_next() is None


def test_ar_stage_drains_its_step_queued_ahead(monkeypatch):
    eng, graphs, _ = _ar_engine(monkeypatch)
    with torch.inference_mode():
        graphs.warmup(None, [], lazy=True, load_size=1)
    graphs.graphs.pop((8, False, False))  # only size 1: 3 rows run eagerly at size 4
    graphs.later.append(8)
    worker = ARStageWorker("llm", eng)
    for i in range(3):
        eng.add_request(Sequence(f"r{i}", [5, 6, 7 + i], SamplingParams(
            temperature=0.8, max_tokens=12, ignore_eos=True), seed=i))
    got: dict[str, list[int]] = {}

    def step() -> bool:
        launched = worker.launch()
        if launched is None:
            return False
        for ev in worker.collect(launched):
            got.setdefault(ev.request_id, []).extend(ev.token_ids)
        return True

    while worker._queued is None:  # decoding with a step queued ahead (async scheduling)
        assert step()
    assert worker.wants_capture() and not worker.drained()
    worker.draining = True
    assert step() and worker.drained()  # the queued step runs; none is queued after it
    assert not step() and worker.has_work()  # drained: no new step while requests wait
    assert worker.capture_wanted() and (4, False, False) in graphs.graphs
    worker.draining = False
    while worker.has_work():
        assert step()
    assert all(len(t) == 12 for t in got.values()) and len(got) == 3


# ------------------------------------------------------------------ code2wav decoder
def test_decoder_marks_wanted_graphs_and_captures_them_first(decoder, monkeypatch):
    dec = decoder
    captured: list[tuple] = []

    def fake_capture(key):
        captured.append(key)
        if key[0] == "dit":
            dec.dit_graphs[dec._key(*key[1:])] = object()
        else:
            dec.voc_graphs[key[1:]] = object()

    monkeypatch.setattr(dec, "_capture", fake_capture)
    monkeypatch.setattr(type(dec), "use_graphs", property(lambda self: True))
    monkeypatch.setattr(dec, "_on_device", contextlib.nullcontext)
    now, later = capture_plan(CUDA_WINDOW, BLOCK, (1, 2, 4), lazy=True)
    try:
        for key in now:
            fake_capture(key)
        dec.lazy, dec.later = True, deque(later)
        assert not dec.wants_capture()
        assert dec._graphed(1, 648, False) == (1, 648, False)  # captured: nothing wanted
        assert not dec.wants_capture()
        # bucket 4's full window (4 x 648 frames) runs eagerly about as fast: not asked for
        assert dec._graphed(4, 648, False) is None and not dec.wants_capture()
        assert dec._graphed(4, 48, False) is None  # its first chunk: launch-bound, wanted
        dec._graphed(4, 48, False)
        assert dec.voc_target(2, now[-1][2]) is None  # the vocoder's bucket 2 too, once
        assert dec.wants_capture() and dec.wanted[("dit", 4, 48, False)] == 2
        assert dec.capture_next() == ("dit", 4, 48, False)  # the most wanted first
        assert dec.capture_next() == ("vocoder", 2, now[-1][2])
        assert not dec.wants_capture() and dec.capture_next() == later[0]  # then in order
        # with SMs left free, a wide step that wanted its `beside` graph ran on every SM
        # (slowing the AR stages): wanted whatever its size, and taken first
        monkeypatch.setattr(dec.graphs, "free_sms", 32)
        beside = ("dit", 8, 648, True)
        dec.later.append(beside)
        for _ in range(3):
            dec._graphed(2, 216, False)
        assert dec._graphed(8, 648, True) is None
        assert dec.wanted[beside] == 1 < dec.wanted[("dit", 2, 216, False)]
        assert dec.capture_next() == beside
    finally:
        dec.lazy, dec.dit_graphs, dec.voc_graphs = False, {}, {}
        dec.later.clear()
        dec.wanted.clear()


# ------------------------------------------------------------------ gen worker
def test_gen_worker_drains_its_step_in_parts_then_captures():
    model = _FakeCapturer(queue=["g1", "g2"])
    model.wants_capture = lambda: True
    worker = _worker(model, preempt_parts=1)

    def capture_next():  # under load: requests ready, but no step in parts
        assert worker.job is None and worker.draining
        key = model.queue.pop(0)
        model.log.append(("capture", key))
        return key

    model.capture_next = capture_next
    worker.submit("a", 3)
    worker.add_input("a", 1, False)
    worker.step()  # the first output
    worker.add_input("a", 1, False)
    worker.step()  # a later output: the first of its 3 parts
    assert worker.job is not None and worker.wants_capture() and not worker.drained()
    worker.submit("b", 1)
    worker.add_input("b", 1, True)  # a new first output waits while draining
    worker.draining = True
    worker.step()
    worker.step()
    assert worker.drained() and worker.launch() is None and worker.has_work()
    assert worker.capture_wanted() and model.log[-1] == ("capture", "g1")
    steps = [e for e in model.log if e[0] != "capture"]
    assert steps == [("step", 1), ("begin", 1), ("part", 1), ("part", 2), ("part", 3)]
    worker.draining = False
    worker.step()
    assert model.log[-1] == ("step", 1)  # b's first output, after the capture


# ------------------------------------------------------------------ the rate and the loop
class _Worker:
    def __init__(self, wants: bool = False, fail: bool = False, took: float = 0.0) -> None:
        self.device = torch.device("cpu")
        self.draining, self.queued, self.wants, self.fail, self.took = False, 0, wants, fail, took
        self.captured = 0

    def wants_capture(self) -> bool:
        return self.wants

    def drained(self) -> bool:
        return self.queued == 0

    def capture_wanted(self) -> bool:
        assert self.draining
        if self.fail:
            raise RuntimeError("capture failed")
        time.sleep(self.took)
        self.captured += 1
        self.wants = False
        return True


def _hosts(**workers: _Worker) -> dict:
    return {name: SimpleNamespace(worker=w) for name, w in workers.items()}


def test_load_captures_drain_every_stage_then_capture_at_a_bounded_share(caplog):
    a, b = _Worker(), _Worker(wants=True, took=0.05)
    hosts = _hosts(a=a, b=b)
    caps = LoadCaptures(share=0.25, min_gap_s=0.0)
    a.queued = 1  # a step of a's is queued: no capture before it ran
    assert caps.start(hosts) and a.draining and b.draining and caps.target == "b"
    assert not caps.finish(hosts, in_flight=True)  # a step in flight
    assert not caps.finish(hosts, in_flight=False) and b.captured == 0  # a not drained
    a.queued = 0
    assert caps.finish(hosts, in_flight=False) and b.captured == 1
    assert not a.draining and not b.draining and caps.stats()["captures_under_load"] == 1
    # the next one waits 3x the last capture's time (share 0.25)
    b.wants = True
    gap = caps.not_before - time.monotonic()
    assert 0.14 < gap < 0.3 and not caps.start(hosts) and not b.draining
    time.sleep(gap)
    assert caps.start(hosts)
    b.fail = True  # a failed capture is logged; every stage resumes
    assert caps.finish(hosts, in_flight=False) and not a.draining and not b.draining
    assert "capture under load failed" in caplog.text
    with pytest.raises(ValueError, match="share"):
        LoadCaptures(share=1.0)


def test_runtime_captures_under_load_while_requests_run(tiny_omni_dir):
    """The background runtime (AsyncOmniLLM, the server): a code2wav that wants graphs gets
    them captured while requests are still unfinished, on the runtime thread, with every stage
    drained; the outputs are those of a run without captures."""
    from omnistage.entrypoints.async_llm import AsyncOmniLLM

    params = {"thinker": SamplingParams(max_tokens=6, min_tokens=6, ignore_eos=True, seed=1),
              "talker": SamplingParams(max_tokens=40, min_tokens=40, seed=3)}

    async def run(llm) -> list:
        async def one(i: int):
            last = None
            async for out in llm.generate({"prompt": f"hi {i}"}, params):
                last = out
            return last
        return await asyncio.gather(*(one(i) for i in range(3)))

    def generate(plan: str, hook=None) -> list:
        llm = AsyncOmniLLM(str(tiny_omni_dir), device="cpu", code2wav_warmup_plan=plan)
        try:
            if hook is not None:
                hook(llm)
            return asyncio.run(run(llm))
        finally:
            llm.shutdown()

    queue, captured = ["g1", "g2", "g3"], []

    def hook(llm) -> None:
        worker = llm.pipeline.workers["code2wav"]
        steps = {"n": 0}
        launch = worker.launch

        def counting_launch():
            launched = launch()
            steps["n"] += launched is not None
            return launched

        def capture_next():
            runtime = llm.runtime
            assert all(getattr(h.worker, "drained", lambda: True)()
                       for h in runtime.local.values()) and not runtime.inflight
            captured.append((queue.pop(0), len(runtime.requests),
                             threading.current_thread().name))

        worker.launch = counting_launch
        worker.model.capture_next, worker.model.pending_captures = capture_next, queue.__len__
        worker.model.wants_capture = lambda: steps["n"] > 0  # code2wav steps ran: wanted

    want = generate("full")
    got = generate("lazy", hook)
    assert captured and {thread for *_, thread in captured} == {"omnistage-runtime"}
    assert any(unfinished > 0 for _, unfinished, _ in captured)  # under load, not idle
    for a, b in zip(want, got, strict=True):
        assert a.error is None and b.error is None and a.token_ids == b.token_ids
        assert b.audio.shape == a.audio.shape and abs(a.audio).max() > 0
        assert abs(a.audio - b.audio).max() < 1e-5
