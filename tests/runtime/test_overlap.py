"""Overlapped stage steps (launch all, then collect each when done): the same outputs as
stepping the stages one after another, and a request aborted while its step is in flight
leaves nothing behind."""

from __future__ import annotations

import numpy as np
import pytest

from omnistage import OmniLLM, SamplingParams
from omnistage.engine.ar.sequence import Sequence
from omnistage.testing.tiny_omni import TINY_TALKER_EOS, tiny_omni_test_messages


def _params(seed: int) -> dict:
    return {"thinker": SamplingParams(temperature=0.8, top_k=20, max_tokens=12, min_tokens=12,
                                      seed=seed),
            "talker": SamplingParams(temperature=0.9, top_p=0.8, repetition_penalty=1.05,
                                     max_tokens=40, min_tokens=40, stop_token_ids=TINY_TALKER_EOS,
                                     suppress_token_ids=[121], seed=seed + 100)}


def _run(tiny_omni_dir, monkeypatch, overlap: str, graphs: str = "0", **options):
    # graphs "eager": the AR stages take the decode-graph path (uncaptured on the CPU), where
    # async scheduling launches each decode step before the previous one's tokens are read
    llm = OmniLLM(str(tiny_omni_dir), overlap=overlap == "1",
                  cuda_graphs="off" if graphs == "0" else graphs, **options)
    assert llm.runtime.overlap == (overlap == "1")
    llm.runtime.trace = []
    msgs = tiny_omni_test_messages()
    prompts = [{"messages": msgs[name]} for name in ("text_only", "audio_text", "image_text")]
    outs = llm.generate(prompts, [_params(i) for i in range(3)], use_tqdm=False)
    trace, stats = llm.runtime.trace, llm.runtime.stats()
    llm.shutdown()
    return outs, trace, stats


@pytest.mark.parametrize("graphs", ["0", "eager"])
def test_overlapped_steps_give_the_serial_outputs(tiny_omni_dir, monkeypatch, graphs):
    serial, _, serial_stats = _run(tiny_omni_dir, monkeypatch, "0")
    overlapped, trace, stats = _run(tiny_omni_dir, monkeypatch, "1", graphs)
    assert serial_stats["talker"]["ahead_steps"] == 0
    if graphs == "eager":  # most decode steps of both AR stages went ahead
        for name in ("thinker", "talker"):
            assert stats[name]["ahead_steps"] > stats[name]["steps"] // 2, stats[name]
    for a, b in zip(serial, overlapped, strict=True):
        assert b.error is None and len(b.token_ids) == 12
        assert a.token_ids == b.token_ids and a.text == b.text
        assert a.stages["talker"].token_ids == b.stages["talker"].token_ids
        assert len(b.stages["talker"].token_ids) == 40
        assert b.audio.shape == a.audio.shape == (40 * 480,)
        assert float(np.abs(b.audio).max()) > 0
        assert np.abs(a.audio - b.audio).max() < 1e-5
    # still streamed: codes before the thinker's last token, audio in several chunks
    first_code = next(i for i, (stage, _, n, _) in enumerate(trace) if stage == "talker" and n)
    last_token = max(i for i, (stage, _, n, _) in enumerate(trace) if stage == "thinker" and n)
    assert first_code < last_token
    assert sum(1 for *_, audio in trace if audio) > 3
    assert all(stats[s]["busy_seconds"] > 0 for s in ("thinker", "talker", "code2wav"))


def test_abort_while_a_step_is_in_flight(tiny_qwen2):
    llm = OmniLLM(str(tiny_qwen2), block_size=8)
    llm.shutdown()  # drive the engine by hand
    engine, tok = llm.engine, llm.tokenizer
    free_at_start = engine.blocks.num_free_blocks
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i in range(3):
        engine.add_request(Sequence(f"r{i}", tok("Flat is better than nested. " * (i + 1))
                                    .input_ids, p, seed=0))
    engine.step()  # prefill
    launched = engine.launch()
    assert engine.abort("r1")
    updates = engine.collect(launched)
    assert sorted(u.request_id for u in updates) == ["r0", "r2"]
    while engine.has_unfinished():
        engine.step()
    assert engine.blocks.num_free_blocks == free_at_start
    assert all(c == 0 for c in engine.blocks.ref_count)


def test_code2wav_abort_while_a_chunk_is_in_flight(tiny_omni_dir):
    llm = OmniLLM(str(tiny_omni_dir))
    llm.shutdown()
    stage = llm.pipeline.workers["code2wav"]
    voice = next(iter(llm.pipeline.voices.values()))
    from omnistage.models.qwen2_5_omni.code2wav_stage import Code2WavRequest
    for rid in ("a", "b"):
        stage.submit(rid, Code2WavRequest(voice["cond"], voice["ref_mel"], seed=1))
        stage.add_input(rid, [5] * 30, finished=True)
    launched = stage.launch()
    stage.abort("a")
    events = stage.collect(launched)
    assert [e.request_id for e in events] == ["b"]
    assert events[0].audio is not None and len(events[0].audio) > 0
    assert "a" not in stage.requests


def test_first_chunk_steps_run_alone(tiny_omni_dir, monkeypatch):
    """code2wav_first_alone: a code2wav step with first chunks holds only first chunks,
    no other stage launches while it is in flight, and the outputs stay those of serial steps."""
    from omnistage.runtime.orchestrator import Orchestrator
    from omnistage.engine.gen import GenStageWorker
    serial, _, _ = _run(tiny_omni_dir, monkeypatch, "0")
    launches: list[tuple[str, bool]] = []  # (stage, an exclusive step was in flight)
    # code2wav steps: (exclusive, the chunks it decoded, another request waited for audio)
    steps: list[tuple[bool, list[int], bool]] = []
    real_launch, real_c2w = Orchestrator._launch, GenStageWorker.launch

    def launch(self, name, host):
        launches.append((name, any(s.exclusive for s in self.inflight.values())))
        return real_launch(self, name, host)

    class SlowEnd:  # on the CPU a step is done at once: keep exclusive ones in flight a while
        def __init__(self) -> None:
            self.polls = 0

        def query(self) -> bool:
            self.polls += 1
            return self.polls > 3

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, end) -> float:
            return 1.0

    def c2w_launch(self):
        chunks = {rid: r.next_chunk for rid, r in self.requests.items()}
        ready = {rid: self._ready(r) for rid, r in self.requests.items()}
        launched = real_c2w(self)
        if launched is not None and launched.state is not None:
            mine = [rid for rid, _ in launched.state[0]]
            # another request waited for its first audio, and for codes (the AR stages)
            others_wait = any(n == 0 and rid not in mine and not ready[rid]
                              for rid, n in chunks.items())
            steps.append((launched.exclusive, [chunks[rid] for rid in mine], others_wait))
            if launched.exclusive:
                launched.start, launched.end = SlowEnd(), SlowEnd()
        return launched

    monkeypatch.setattr(Orchestrator, "_launch", launch)
    monkeypatch.setattr(GenStageWorker, "launch", c2w_launch)
    overlapped, _, _ = _run(tiny_omni_dir, monkeypatch, "1", code2wav_first_alone=True)
    assert launches and not any(held for _, held in launches)
    # alone: only first chunks, and no other request still waited for codes for its first audio
    alone = [(chunks, wait) for exclusive, chunks, wait in steps if exclusive]
    assert alone and all(set(chunks) == {0} and not wait for chunks, wait in alone)
    # a step with first chunks while another request waited: shared, as before
    assert all(wait for exclusive, chunks, wait in steps if not exclusive and 0 in chunks)
    assert sum(chunks.count(0) for _, chunks, _ in steps) == 3  # each first chunk once
    for a, b in zip(serial, overlapped, strict=True):
        assert b.error is None and a.token_ids == b.token_ids
        assert b.audio.shape == a.audio.shape and np.abs(a.audio - b.audio).max() < 1e-5


def test_first_chunk_step_alone_only_when_no_one_else_waits(tiny_omni_dir, monkeypatch):
    llm = OmniLLM(str(tiny_omni_dir), code2wav_first_alone=True)
    llm.shutdown()
    stage = llm.pipeline.workers["code2wav"]
    assert stage.first_alone
    voice = next(iter(llm.pipeline.voices.values()))
    from omnistage.models.qwen2_5_omni.code2wav_stage import Code2WavRequest
    for rid in ("a", "b"):
        stage.submit(rid, Code2WavRequest(voice["cond"], voice["ref_mel"], seed=1))
    stage.add_input("a", [5] * 120, finished=False)
    launched = stage.launch()  # a's first chunk while b still waits for its first audio
    assert not launched.exclusive and [rid for rid, _ in launched.state[0]] == ["a"]
    stage.collect(launched)
    stage.add_input("b", [7] * 120, finished=False)
    assert stage.requests["a"].stream.ready_chunks() > 1  # a's next chunk is ready too
    launched = stage.launch()  # b is the last one waiting: its first chunk alone
    assert launched.exclusive and [rid for rid, _ in launched.state[0]] == ["b"]
    events = stage.collect(launched)
    assert [e.request_id for e in events] == ["b"] and len(events[0].audio) > 0
    launched = stage.launch()
    assert not launched.exclusive and sorted(rid for rid, _ in launched.state[0]) == ["a", "b"]
    stage.collect(launched)
    # more first chunks ready than a step holds: each step of them alone, as none waits for codes
    monkeypatch.setattr(stage, "max_batch", 1)
    for rid in ("c", "d"):
        stage.submit(rid, Code2WavRequest(voice["cond"], voice["ref_mel"], seed=1))
        stage.add_input(rid, [9] * 120, finished=False)
    for rid in ("c", "d"):
        launched = stage.launch()
        assert launched.exclusive and [r for r, _ in launched.state[0]] == [rid]
        stage.collect(launched)

