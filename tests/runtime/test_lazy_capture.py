"""Lazy graph capture (issue 24, start-up in seconds): at load only the graphs a first request
needs, the others one per idle gap of the stage, on its own thread, never while a step is
pending; steps needing a graph not captured yet run on a larger captured bucket or eagerly.

The plan and the scheduling are host logic (tested here on the CPU with a fake capturer); the
captures themselves and lazy vs full outputs on CUDA are the `gpu` tests at the end."""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from omnistage import OmniLLM, SamplingParams
from omnistage.engine.gen import GenEngineConfig, GenRequest, GenStageWorker
from omnistage.engine.gen.config import pop_stage_options
from omnistage.models.qwen2_5_omni.code2wav_graphs import BUCKETS, Qwen2_5OmniCode2WavDecoder
from omnistage.models.qwen2_5_omni.code2wav_plan import (BESIDE_MIN_BUCKET, capture_plan,
                                                         first_window_width, full_window_width,
                                                         vocoder_lengths, window_widths)
from omnistage.models.qwen2_5_omni.code2wav_stream import Qwen2_5OmniCode2WavStreamConfig
from omnistage.testing.tiny_omni import TINY_TALKER_EOS, tiny_omni_test_messages

CPU = torch.device("cpu")
BLOCK = 24  # Qwen2.5-Omni's DiT block (mel frames)
CUDA_WINDOW = Qwen2_5OmniCode2WavStreamConfig(chunk_blocks=24, first_chunk_blocks=1)


# ------------------------------------------------------------------ the plan
def test_full_plan_is_every_graph_at_load():
    now, later = capture_plan(CUDA_WINDOW, BLOCK, BUCKETS, beside_min_bucket=BESIDE_MIN_BUCKET)
    widths = window_widths(CUDA_WINDOW, BLOCK)
    first = first_window_width(CUDA_WINDOW, BLOCK)
    want = {("dit", b, w, False) for b in BUCKETS for w in widths}
    want |= {("dit", b, w, True) for b in BUCKETS if b >= BESIDE_MIN_BUCKET
             for w in widths if w != first}
    want |= {("vocoder", b, n) for b in BUCKETS for n in vocoder_lengths(CUDA_WINDOW, BLOCK)}
    assert later == [] and len(now) == len(set(now)) and set(now) == want


def test_lazy_plan_captures_batch_one_and_the_largest_bucket_then_bucket_by_bucket():
    full, _ = capture_plan(CUDA_WINDOW, BLOCK, BUCKETS, beside_min_bucket=BESIDE_MIN_BUCKET)
    now, later = capture_plan(CUDA_WINDOW, BLOCK, BUCKETS, beside_min_bucket=BESIDE_MIN_BUCKET,
                              lazy=True)
    first, whole = first_window_width(CUDA_WINDOW, BLOCK), full_window_width(CUDA_WINDOW, BLOCK)
    assert (first, whole) == (48, 648)  # chunk 0's window; a later chunk's (2 + 24 + 1 blocks)
    voc = vocoder_lengths(CUDA_WINDOW, BLOCK)
    # at load: what a first request needs at batch 1 (its first, later and last chunks,
    # BigVGAN), then every graph of the largest bucket (a burst pads up to it), beside ones
    top = BUCKETS[-1]
    assert now[:6] == [("dit", 1, first, False), ("dit", 1, whole, False),
                       *(("vocoder", 1, n) for n in voc), ("dit", 1, 216, False),
                       ("dit", 1, 360, False)]  # (the last chunks' quarter and half widths)
    assert now[6:] == [k for k in full if k[1] == top]
    assert ("dit", top, whole, True) in now and ("dit", top, first, False) in now
    assert not any(k[1] in (1, top) for k in later)
    # nothing lost, nothing twice; later ones in bucket order, each bucket's main widths first
    assert sorted(now + later) == sorted(full) and not set(now) & set(later)
    assert [k[1] for k in later] == sorted(k[1] for k in later)
    two = [k for k in later if k[1] == 2]
    assert two[:2] == [("dit", 2, first, False), ("dit", 2, whole, False)]
    assert not any(k[0] == "dit" and k[3] for k in later if k[1] < BESIDE_MIN_BUCKET)
    # no beside graphs without free SMs; widths over max_graph_frames never graphed
    _, plain = capture_plan(CUDA_WINDOW, BLOCK, BUCKETS, lazy=True)
    assert not any(k[0] == "dit" and k[3] for k in plain)
    _, narrow = capture_plan(CUDA_WINDOW, BLOCK, BUCKETS, max_graph_frames=400, lazy=True)
    assert not any(k[0] == "dit" and k[2] > 400 for k in narrow)


# ------------------------------------------------------------------ the decoder's routing
@pytest.fixture(scope="module")
def decoder() -> Qwen2_5OmniCode2WavDecoder:
    from tests.models.qwen2_5_omni.test_token2wav import tiny_token2wav_pair
    return Qwen2_5OmniCode2WavDecoder(tiny_token2wav_pair()[1], cuda_graphs=False)


def test_lazy_routing_pads_to_a_captured_bucket_or_runs_eagerly(decoder):
    dec = decoder
    dec.dit_graphs, dec.voc_graphs = {(4, 360, False): object()}, {(8, 100): object()}
    try:
        assert dec.dit_target(2, 360) == (2, 360, False)  # full: its own (captured at use)
        dec.lazy = True
        assert dec.dit_target(4, 360) == (4, 360, False)
        assert dec.dit_target(1, 360) == (4, 360, False)  # padded up: rows masked out
        assert dec.dit_target(2, 360, beside=True) == (4, 360, False)
        assert dec.dit_target(8, 360) is None  # no larger one: eagerly, never a capture
        assert dec.dit_target(1, 648) is None
        assert dec.voc_target(2, 100) == (8, 100) and dec.voc_target(16, 100) is None
        assert dec.voc_target(2, 101) is None
    finally:
        dec.lazy, dec.dit_graphs, dec.voc_graphs = False, {}, {}


def _fake_capture(dec: Qwen2_5OmniCode2WavDecoder, key: tuple) -> None:
    # a graph's bookkeeping, without CUDA
    if key[0] == "dit":
        dec.dit_graphs[dec._key(*key[1:])] = object()
    else:
        dec.voc_graphs[key[1:]] = object()


def test_capture_next_takes_one_graph_in_plan_order(decoder, monkeypatch):
    dec = decoder
    captured: list[tuple] = []

    def fake_capture(key):
        captured.append(key)
        _fake_capture(dec, key)

    monkeypatch.setattr(dec, "_capture", fake_capture)
    now, later = capture_plan(CUDA_WINDOW, BLOCK, (1, 2, 4), lazy=True)
    try:
        for key in now:
            fake_capture(key)
        dec.lazy, dec.later = True, deque(later)
        dec.dit_graphs[(2, 48, False)] = object()  # captured meanwhile (at first use): skipped
        assert dec.pending_captures() == len(later)
        dec.graphs.held[(1, 648, False)] = "a job"  # a job in progress: no capture
        assert dec.capture_next() is None and len(captured) == len(now)
        dec.graphs.drop_held()
        got = []
        while (key := dec.capture_next()) is not None:
            got.append(key)
            assert captured[-1] == key  # one graph per call
        assert got == [k for k in later if k != ("dit", 2, 48, False)]
        assert dec.pending_captures() == 0 and dec.stats()["captured_later"] == len(got)
    finally:
        dec.lazy, dec.dit_graphs, dec.voc_graphs = False, {}, {}
        dec.later.clear()


def test_capture_next_takes_graphs_steps_missed_first_beside_ones_before_others(decoder,
                                                                               monkeypatch):
    """A step that ran without its queued graph (a larger bucket or eagerly) marks it wanted:
    the next idle captures take wanted graphs first, `beside` ones (a wide step without one
    takes every SM from the AR stages) before the most missed, then the plan's order."""
    dec = decoder

    fake_capture = functools.partial(_fake_capture, dec)
    monkeypatch.setattr(dec, "_capture", fake_capture)
    monkeypatch.setattr(type(dec), "use_graphs", property(lambda self: True))
    monkeypatch.setattr(dec, "_on_device", contextlib.nullcontext)
    monkeypatch.setattr(dec.graphs, "free_sms", 32)  # beside graphs from BESIDE_MIN_BUCKET
    now, later = capture_plan(CUDA_WINDOW, BLOCK, BUCKETS, beside_min_bucket=BESIDE_MIN_BUCKET,
                              lazy=True)
    try:
        for key in now:
            fake_capture(key)
        dec.lazy, dec.later = True, deque(later)
        dec.wanted.clear()  # (the routing test above asked the module's decoder too)
        assert dec._graphed(1, 648, False) == (1, 648, False) and not dec.wanted  # captured
        for _ in range(3):
            # queued: padded up to the largest bucket (captured at load), and missed
            assert dec._graphed(4, 48, False) == (32, 48, False)
        for _ in range(2):
            assert dec.voc_target(2, 616) == (32, 616)
        assert dec._graphed(16, 648, True) == (32, 648, True)  # its beside graph: missed once
        assert dec.wanted == {("dit", 4, 48, False): 3, ("vocoder", 2, 616): 2,
                              ("dit", 16, 648, True): 1}
        assert dec.capture_next() == ("dit", 16, 648, True)  # beside first
        assert dec.capture_next() == ("dit", 4, 48, False)  # then the most missed
        assert dec.capture_next() == ("vocoder", 2, 616)
        assert not dec.wanted and dec.capture_next() == later[0]  # then the plan's order
    finally:
        dec.lazy, dec.dit_graphs, dec.voc_graphs = False, {}, {}
        dec.later.clear()
        dec.wanted.clear()


# ------------------------------------------------------------------ the worker's idle gaps
@dataclass
class _State(GenRequest):
    chunks: int = 0  # outputs ready to run
    total: int = 0


@dataclass
class _FakeCapturer:
    """A GenModel with a capture queue: records what ran and what was captured, in order."""

    streaming: bool = True
    queue: list[str] = field(default_factory=list)
    log: list[tuple[str, Any]] = field(default_factory=list)
    warmups: list[tuple] = field(default_factory=list)
    worker: Any = None
    threads: set[str] = field(default_factory=set)
    capture_threads: set[str] = field(default_factory=set)

    def new_state(self, request: int) -> _State:
        return _State(total=request)

    def add_input(self, state, data, finished):
        state.chunks += data

    def ready(self, state):
        return state.chunks > state.outputs

    def empty(self, state):
        return False

    def input_pending(self, state):
        return state.chunks < state.total

    def done(self, state):
        return state.outputs == state.total

    def batch_key(self, state):
        return None

    def batch_rows(self, state):
        return 1

    def is_held(self, batch):
        return False

    def intervals(self, batch):
        return 3

    def run(self, batch):
        self.threads.add(threading.current_thread().name)
        self.log.append(("step", len(batch)))
        return batch

    def begin(self, batch, beside):
        self.log.append(("begin", len(batch)))
        return {"batch": batch, "done": 0}

    def advance(self, job, intervals):
        job["done"] += intervals
        self.log.append(("part", job["done"]))
        return job["done"] >= 3

    def finish(self, job):
        return job["batch"]

    def outputs(self, result):
        return [{"audio": np.zeros(1)} for _ in result]

    def warmup(self, buckets=None, lazy=False):
        self.warmups.append((buckets, lazy))

    def drop_jobs(self):
        pass

    def stats(self):
        return {}

    def pending_captures(self) -> int:
        return len(self.queue)

    def capture_next(self):
        w = self.worker  # never while a step is pending: no job, nothing ready
        assert w.job is None and not any(w._ready(r) for r in w.requests.values())
        self.capture_threads.add(threading.current_thread().name)
        key = self.queue.pop(0)
        self.log.append(("capture", key))
        return key


def _worker(model, **options) -> GenStageWorker:
    config = GenEngineConfig(warmup=True, warmup_plan="lazy", **options)
    worker = GenStageWorker("c2w", model, CPU, config)
    model.worker = worker
    return worker


def _drain(worker: GenStageWorker, limit: int = 50) -> None:
    for _ in range(limit):
        if not worker.has_work():
            return
        worker.step()
    raise AssertionError("the worker never went idle")


@pytest.mark.parametrize("launch_thread", [False, True])
def test_one_capture_per_idle_call_and_none_while_a_step_is_pending(launch_thread):
    model = _FakeCapturer(queue=["g1", "g2", "g3", "g4"])
    worker = _worker(model, launch_thread=launch_thread, preempt_parts=1)
    assert model.warmups == [(None, True)] and model.log == []
    assert worker.stats()["captures_pending"] == 4  # (the server's gauge of that name)
    assert not worker.has_work()  # queued graphs are not work: steps never capture
    assert worker.idle_capture() and model.log == [("capture", "g1")]
    assert worker.stats()["captures_pending"] == 3
    worker.submit("a", 2)
    worker.add_input("a", 1, False)  # a first output ready: not idle, no capture
    assert not worker.idle_capture()
    worker.step()
    assert model.log[-1] == ("step", 1)
    worker.add_input("a", 1, True)  # a later output: a step in 3 parts (preempt_parts=1)
    worker.step()
    assert worker.job is not None and not worker.idle_capture()  # none between its parts
    worker.step()
    worker.step()
    assert [e[0] for e in model.log[2:]] == ["begin", "part", "part", "part"]
    assert worker.job is None and "a" not in worker.requests
    while worker.idle_capture():  # idle again: the rest, one graph per call
        pass
    assert [e[1] for e in model.log if e[0] == "capture"] == ["g1", "g2", "g3", "g4"]
    assert worker.stats()["idle_captures"] == 4 and worker.stats()["captures_pending"] == 0
    # on the calling (runtime) thread, never the launcher: a compile traces the whole process
    assert model.capture_threads == {threading.current_thread().name}


def test_requests_waiting_for_input_leave_idle_gaps():
    model = _FakeCapturer(queue=["g1", "g2"])
    worker = _worker(model)
    worker.submit("a", 3)  # no input yet: nothing ready, an idle call captures
    assert worker.idle_capture()
    worker.add_input("a", 1, False)
    worker.step()
    assert worker.idle_capture()
    assert model.log == [("capture", "g1"), ("step", 1), ("capture", "g2")]


def test_runtime_captures_only_when_no_stage_has_work(tiny_omni_dir):
    """The background runtime's idle passes drive the captures (AsyncOmniLLM, the server):
    after the request is done, the queued graphs are taken on the runtime thread while no
    stage has work."""
    import asyncio

    from omnistage.entrypoints.async_llm import AsyncOmniLLM

    llm = AsyncOmniLLM(str(tiny_omni_dir), device="cpu", code2wav_warmup_plan="lazy")
    queue, captured = ["g1", "g2"], []

    def capture_next():  # (the CPU decoder queues no graphs: these stand in)
        assert not any(h.has_work() for h in llm.runtime.local.values())  # nothing runs
        captured.append((queue.pop(0), threading.current_thread().name))

    async def run() -> None:
        async for out in llm.generate({"prompt": "hi"},
                                      {"thinker": SamplingParams(max_tokens=3)}):
            assert out.error is None
        deadline = time.monotonic() + 10
        while queue and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    try:
        worker = llm.pipeline.workers["code2wav"]
        worker.model.capture_next, worker.model.pending_captures = capture_next, queue.__len__
        asyncio.run(run())
    finally:
        llm.shutdown()
    assert [key for key, _ in captured] == ["g1", "g2"]
    assert {thread for _, thread in captured} == {"omnistage-runtime"}


def test_full_plan_and_models_without_lazy_capture_capture_at_load():
    model = _FakeCapturer(queue=["g1"])
    worker = GenStageWorker("c2w", model, CPU, GenEngineConfig(warmup=True))
    model.worker = worker
    assert model.warmups == [(None, False)] and not worker.has_work()

    class Hidden:  # a model without lazy capture (no capture_next / pending_captures)
        def __init__(self, inner: _FakeCapturer) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> Any:
            if name in ("capture_next", "pending_captures"):
                raise AttributeError(name)
            return getattr(self.inner, name)

    plain = _FakeCapturer(queue=["g1"])
    worker = _worker(Hidden(plain))
    assert plain.warmups == [(None, False)]  # lazy asked, everything captured at load
    assert not worker.lazy and not worker.has_work()


def test_warmup_plan_option_is_validated():
    with pytest.raises(ValueError, match="warmup_plan"):
        GenEngineConfig(warmup_plan="some")
    with pytest.raises(ValueError, match="code2wav_warmup_plan"):
        pop_stage_options({"code2wav_warmup_plan": True}, GenEngineConfig, {})
    config, _ = pop_stage_options({"code2wav_warmup_plan": "lazy"}, GenEngineConfig, {})
    assert config.warmup_plan == "lazy"


def test_warmup_plan_sets_every_stage_plan_not_given(tiny_omni_dir):
    """`warmup_plan` sets the thinker's, talker's and code2wav's plans (a stage's own option
    wins); without it every stage keeps its default, full, in both front ends."""
    from omnistage.entrypoints.async_llm import AsyncOmniLLM

    def plans(llm) -> tuple[str, ...]:
        workers = llm.pipeline.workers
        return (workers["thinker"].engine.config.graph_warmup_plan,
                workers["talker"].engine.config.graph_warmup_plan,
                workers["code2wav"].config.warmup_plan)

    cases = [(AsyncOmniLLM, {}, ("full",) * 3), (OmniLLM, {}, ("full",) * 3),
             (AsyncOmniLLM, {"warmup_plan": "lazy"}, ("lazy",) * 3),
             (OmniLLM, {"warmup_plan": "lazy", "code2wav_warmup_plan": "full"},
              ("lazy", "lazy", "full"))]
    for cls, options, want in cases:
        llm = cls(str(tiny_omni_dir), device="cpu", **options)
        try:
            assert plans(llm) == want, (cls.__name__, options)
        finally:
            llm.shutdown()
    with pytest.raises(ValueError, match="warmup_plan"):
        OmniLLM(str(tiny_omni_dir), device="cpu", warmup_plan="soon")


def test_serve_warmup_plan_flag_reaches_the_engine(tiny_omni_dir, monkeypatch):
    from omnistage.entrypoints import async_llm
    from omnistage.entrypoints.cli import main
    seen: list[dict] = []

    class Built(Exception):
        pass

    def engine(model, **kwargs):
        seen.append(kwargs)
        raise Built

    monkeypatch.setattr(async_llm, "AsyncOmniLLM", engine)
    for argv in (["--warmup-plan", "full"], ["--warmup-plan", "lazy"], []):
        with pytest.raises(Built):
            main(["serve", str(tiny_omni_dir), "--no-warmup", *argv])
    assert [kw.get("warmup_plan") for kw in seen] == ["full", "lazy", None]
    with pytest.raises(SystemExit):
        main(["serve", str(tiny_omni_dir), "--warmup-plan", "later"])


# ------------------------------------------------------------------ the tiny pipeline
def _generate(tiny_omni_dir, plan: str):
    llm = OmniLLM(str(tiny_omni_dir), code2wav_warmup_plan=plan)
    try:
        assert llm.pipeline.workers["code2wav"].config.warmup_plan == plan
        msgs = tiny_omni_test_messages()
        params = [{"thinker": SamplingParams(temperature=0.8, top_k=20, max_tokens=8,
                                             min_tokens=8, seed=i),
                   "talker": SamplingParams(temperature=0.9, top_p=0.8, max_tokens=30,
                                            min_tokens=30, stop_token_ids=TINY_TALKER_EOS,
                                            suppress_token_ids=[121], seed=100 + i)}
                  for i in range(2)]
        return llm.generate([{"messages": msgs[n]} for n in ("text_only", "audio_text")],
                            params, use_tqdm=False)
    finally:
        llm.shutdown()


def test_lazy_and_full_warmup_give_the_same_outputs(tiny_omni_dir):
    full, lazy = _generate(tiny_omni_dir, "full"), _generate(tiny_omni_dir, "lazy")
    for a, b in zip(full, lazy, strict=True):
        assert a.error is None and b.error is None
        assert a.token_ids == b.token_ids and len(a.token_ids) == 8
        assert a.stages["talker"].token_ids == b.stages["talker"].token_ids
        assert b.audio.shape == a.audio.shape == (30 * 480,) and np.abs(a.audio).max() > 0
        assert np.abs(a.audio - b.audio).max() < 1e-5


# ------------------------------------------------------------------ CUDA
@pytest.mark.gpu
def test_lazy_decoder_matches_full_and_never_captures_in_a_step():
    from tests.models.qwen2_5_omni.test_code2wav_fast import _cuda_streams, _max_diff
    from tests.models.qwen2_5_omni.test_token2wav import tiny_token2wav_pair
    model, streams = _cuda_streams(tiny_token2wav_pair()[1], ((40, 30), (41, 70)))
    config = streams[0].config
    reqs = [(streams[0], 2), (streams[1], 3), (streams[1], 1)]  # 3 later chunks: bucket 4
    full = Qwen2_5OmniCode2WavDecoder(model)
    full.warmup(config, (1, 2, 4))
    want = full.decode(reqs)
    lazy = Qwen2_5OmniCode2WavDecoder(model)
    lazy.warmup(config, (1, 2, 4), lazy=True)
    at_load = (lazy.stats()["dit_graphs"], lazy.stats()["vocoder_graphs"])
    assert lazy.pending_captures() > 0 and at_load[0] <= 2
    got = lazy.decode(reqs)  # bucket 4 not captured: eagerly, no capture in the step
    assert (lazy.stats()["dit_graphs"], lazy.stats()["vocoder_graphs"]) == at_load
    mel_diff, wav_diff = _max_diff(got, want)
    assert mel_diff < 1e-4 and wav_diff < 1e-4, (mel_diff, wav_diff)
    while lazy.capture_next() is not None:
        pass
    assert lazy.stats()["dit_graphs"] == full.stats()["dit_graphs"]
    mel_diff, wav_diff = _max_diff(lazy.decode(reqs), want)  # the same graphs now
    assert mel_diff < 1e-4 and wav_diff < 1e-4, (mel_diff, wav_diff)


# ------------------------------------------------------------------ AR decode graphs
def test_decode_capture_plan():
    from omnistage.engine.ar.cuda_graphs import decode_capture_plan
    sizes = [1, 2, 4, 8, 16, 32, 48, 64]
    assert decode_capture_plan(sizes, lazy=False) == (sizes, [])
    assert decode_capture_plan(sizes, lazy=True) == ([1, 2, 4, 64], [8, 16, 32, 48])
    assert decode_capture_plan(sizes, lazy=True, load_size=0) == ([1, 64], sizes[1:-1])
    assert decode_capture_plan([1], lazy=True, load_size=8) == ([1], [])


def _ar_engine(monkeypatch, max_num_seqs: int = 8):
    """A CPU engine on the decode-graph path whose "captures" are the eager stand-ins (each
    recorded): the graph bookkeeping of a CUDA engine, on the CPU."""
    from omnistage.engine.ar.engine import AREngine
    from omnistage.engine.ar.scheduler import EngineConfig
    from tests.engine.test_cuda_graphs import cpu_model
    cfg = EngineConfig(max_model_len=256, max_num_seqs=max_num_seqs, block_size=8,
                       max_num_batched_tokens=64, cuda_graphs="eager")
    eng = AREngine(cpu_model(False), cfg, CPU, torch.float32)
    graphs = eng.runner.graphs
    captured: list[int] = []
    real = graphs.capture_graph

    def stand_in(fn):
        captured.append(len(graphs.graphs) + len(graphs.heads))
        graphs.capture = False
        try:
            return real(fn)
        finally:
            graphs.capture = True

    graphs.capture = True
    monkeypatch.setattr(graphs, "capture_graph", stand_in)
    return eng, graphs, captured


def _decode(eng, n: int) -> list[list[int]]:
    from omnistage.engine.ar.sequence import Sequence
    g = torch.Generator().manual_seed(5)
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=6, ignore_eos=True)
    for i in range(n):
        prompt = torch.randint(0, 280, (3 + 4 * i,), generator=g).tolist()
        eng.add_request(Sequence(f"r{i}", prompt, params, seed=100 + i))
    out: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for u in eng.step():
            out.setdefault(u.request_id, []).extend(u.new_token_ids)
    return [out[f"r{i}"] for i in range(n)]


def test_lazy_decode_graphs_run_uncaptured_sizes_eagerly_then_capture_one_per_call(monkeypatch):
    full_eng, full, _ = _ar_engine(monkeypatch)
    with torch.inference_mode():
        full.warmup(None, [], lazy=False)
    assert sorted(k[0] for k in full.graphs) == [1, 2, 4, 8]
    want = _decode(full_eng, 3)

    eng, graphs, captured = _ar_engine(monkeypatch)
    with torch.inference_mode():
        graphs.warmup(None, [], lazy=True, load_size=1)
    # at load: size 1 and the largest (a step pads up to it until its own size is captured)
    assert sorted(k[0] for k in graphs.graphs) == [1, 8] and list(graphs.later) == [2, 4]
    assert graphs.step_size(3) == 8 and graphs.step_size(1) == 1
    n_captures = len(captured)
    assert _decode(eng, 3) == want  # 3 rows padded to the captured 8: the same tokens
    assert sorted(k[0] for k in graphs.graphs) == [1, 8]  # (its sampler head: on first use)
    n_captures = len(captured)
    # with no captured larger size, an uncaptured size runs eagerly (say 8 were still queued)
    graph8 = graphs.graphs.pop((8, False, False))
    graphs.later = deque([2, 4, 8])
    assert graphs.step_size(3) == 4
    assert _decode(eng, 3) == want  # size 4, queued: eagerly, nothing captured
    assert len(captured) == n_captures and set(graphs.graphs) == {(1, False, False)}
    graphs.graphs[(8, False, False)] = graph8
    graphs.later = deque([2, 4])
    assert graphs.capture_next() == 2 and (2, False, False) in graphs.graphs
    assert graphs.pending_captures() == 1 and graphs.step_size(3) == 8
    assert graphs.capture_next() == 4 and graphs.step_size(3) == 4
    assert graphs.capture_next() is None and graphs.pending_captures() == 0
    assert set(graphs.graphs) == set(full.graphs)


def test_tensor_parallel_decode_graphs_capture_everything_at_load(monkeypatch):
    _, graphs, _ = _ar_engine(monkeypatch)
    graphs.before_forward = lambda *args: None  # rank 0 of a tensor-parallel stage
    with torch.inference_mode():
        graphs.warmup(None, [], lazy=True)
    assert sorted(k[0] for k in graphs.graphs) == [1, 2, 4, 8] and not graphs.later


def test_ar_stage_lazy_plan_captures_only_when_idle(monkeypatch):
    """EngineConfig.graph_warmup_plan="lazy": the runner's warm-up leaves sizes > 4 queued;
    the stage worker's idle_capture takes one per call, never while a sequence is unfinished."""
    import dataclasses

    from omnistage.runtime.stage import ARStageWorker
    eng, graphs, _ = _ar_engine(monkeypatch, max_num_seqs=16)
    eng.runner.config = dataclasses.replace(eng.runner.config, graph_warmup_plan="lazy")
    eng.runner.warmup_graphs([SamplingParams(temperature=0)])
    assert sorted({k[0] for k in graphs.graphs}) == [1, 2, 4, 16] and list(graphs.later) == [8]
    worker = ARStageWorker("llm", eng)
    from omnistage.engine.ar.sequence import Sequence
    eng.add_request(Sequence("busy", [5, 6, 7], SamplingParams(temperature=0, max_tokens=2),
                             seed=0))
    assert not worker.idle_capture() and list(graphs.later) == [8]  # a sequence is unfinished
    assert worker.stats()["captures_pending"] == 1
    while eng.has_unfinished():
        eng.step()
    assert worker.idle_capture() and not graphs.later and (8, False, False) in graphs.graphs
    assert not worker.idle_capture()  # nothing left
    assert worker.stats()["captures_pending"] == 0


def test_graph_warmup_plan_is_validated():
    from omnistage.config.schema import EngineOptions
    from omnistage.engine.ar.scheduler import engine_config
    assert engine_config(256, graph_warmup_plan="lazy").graph_warmup_plan == "lazy"
    with pytest.raises(ValueError, match="graph_warmup_plan"):
        engine_config(256, graph_warmup_plan="later")
    with pytest.raises(ValueError, match="graph_warmup_plan"):
        EngineOptions(graph_warmup_plan="soon")
