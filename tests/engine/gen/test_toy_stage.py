"""The non-AR engine (omnistage/engine/gen) with a toy model defined here: driven directly on the
CPU, and plugged into a pipeline YAML behind a tiny LM, served through OmniLLM / AsyncOmniLLM.
Each request's input ints become chunks of CHUNK ints, one chunk per output, each step running
INTERVALS intervals (in parts when preempt_parts is set)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import asyncio

import numpy as np
import pytest
import torch
import yaml

from omnistage import AsyncOmniLLM, OmniLLM, SamplingParams
from omnistage.engine.gen import GenEngineConfig, GenRequest, GenStageWorker
from omnistage.models.registry import (MODEL_REGISTRY, register_adapter, register_model,
                                       register_stage)

CHUNK, INTERVALS = 2, 3
CPU = torch.device("cpu")


@dataclass
class ToyState(GenRequest):
    ints: list[int] = field(default_factory=list)
    finished: bool = False


@dataclass
class ToyJob:
    batch: list[ToyState]
    done: int = 0


@register_model("ToyChunker")
class ToyChunker:
    """A GenModel: output k of a request is its ints [k CHUNK, (k + 1) CHUNK), times 10."""

    streaming = True

    def __init__(self) -> None:
        self.log: list[tuple[str, Any]] = []  # what ran, in order

    def new_state(self, request: list[int]) -> ToyState:
        return ToyState(ints=list(request), finished=bool(request))

    def add_input(self, state: ToyState, data: list[int], finished: bool) -> None:
        state.ints += data
        state.finished = finished

    def _chunks(self, state: ToyState) -> int:
        n = len(state.ints)
        return -(-n // CHUNK) if state.finished else n // CHUNK

    def ready(self, state: ToyState) -> bool:
        return self.empty(state) or self._chunks(state) > state.outputs

    def empty(self, state: ToyState) -> bool:
        return state.finished and not state.ints

    def input_pending(self, state: ToyState) -> bool:
        return not state.finished

    def done(self, state: ToyState) -> bool:
        return state.finished and state.outputs == self._chunks(state)

    def batch_key(self, state: ToyState) -> None:
        return None

    def batch_rows(self, state: ToyState) -> int:
        return 1

    def is_held(self, batch: list[ToyState]) -> bool:
        return False

    def intervals(self, batch: list[ToyState]) -> int:
        return INTERVALS

    def _tag(self, batch: list[ToyState]) -> list[tuple[int, int]]:
        return [(s.ints[0], s.outputs) for s in batch]

    def run(self, batch: list[ToyState]) -> list[list[int]]:
        self.log.append(("step", self._tag(batch)))
        return self._compute(batch)

    def begin(self, batch: list[ToyState], beside: bool) -> ToyJob:
        return ToyJob(list(batch))

    def advance(self, job: ToyJob, intervals: int) -> bool:
        job.done = min(INTERVALS, job.done + intervals)
        self.log.append(("part", self._tag(job.batch)))
        return job.done == INTERVALS

    def finish(self, job: ToyJob) -> list[list[int]]:
        return self._compute(job.batch)

    @staticmethod
    def _compute(batch: list[ToyState]) -> list[list[int]]:
        return [[10 * x for x in s.ints[s.outputs * CHUNK:(s.outputs + 1) * CHUNK]]
                for s in batch]

    def outputs(self, result: list[list[int]]) -> list[dict[str, Any]]:
        return [{"token_ids": chunk} for chunk in result]

    def warmup(self, buckets: tuple[int, ...] | None = None) -> None:
        pass

    def drop_jobs(self) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {}


def _worker(**config: Any) -> GenStageWorker:
    # built through the public registry, as a pipeline would name the model
    return GenStageWorker("toy", MODEL_REGISTRY["ToyChunker"](), CPU, GenEngineConfig(**config))


def _ids(events) -> list[tuple[str, list[int], bool]]:
    return [(e.request_id, e.token_ids, e.finished) for e in events]


def test_requests_join_and_leave_between_steps() -> None:
    w = _worker()
    w.submit("a", [1, 2, 3, 4])
    assert _ids(w.step()) == [("a", [10, 20], False)]
    w.submit("b", [5, 6])  # joins at the next step, beside a's second output (first outputs
    assert _ids(w.step()) == [("b", [50, 60], True), ("a", [30, 40], True)]  # first)
    assert not w.requests and not w.has_work()  # both left
    w.submit("c", [])
    w.add_input("c", [7], finished=False)  # not a whole chunk yet: nothing ready
    assert not w.has_work()
    w.add_input("c", [8, 9], finished=True)
    assert _ids(w.step()) == [("c", [70, 80], False)]
    assert _ids(w.step()) == [("c", [90], True)]
    w.submit("d", [])
    w.add_input("d", [], finished=True)  # empty: ends without an output
    assert _ids(w.step()) == [("d", [], True)]
    assert w.stats()["steps"] == 4 and w.stats()["max_batch_size"] == 2


def test_first_output_jumps_the_queue() -> None:
    w = _worker(max_batch=1)
    w.submit("a", [1, 2, 3, 4, 5, 6])
    w.step()  # a's first output
    w.submit("b", [7, 8])
    # b's first output goes ahead of a's later ones
    assert _ids(w.step()) == [("b", [70, 80], True)]
    assert _ids(w.step()) == [("a", [30, 40], False)]


@pytest.mark.parametrize("thread", [False, True], ids=["inline", "launcher_thread"])
def test_step_in_parts_preempted_by_a_first_output(thread: bool) -> None:
    w = _worker(preempt_parts=1, launch_thread=thread)
    model = w.model
    w.submit("a", [1, 2, 3, 4])
    assert _ids(w.step()) == [("a", [10, 20], False)]
    launched = w.launch()  # a's second output: the first of its 3 parts
    assert w.job is not None and launched.state[0] == []
    assert w.collect(launched) == []
    w.submit("b", [5, 6])
    assert _ids(w.step()) == [("b", [50, 60], True)]  # between two parts of a's step
    events = []
    while w.has_work():
        events += w.step()
    assert _ids(events) == [("a", [30, 40], True)] and w.job is None
    assert model.log == [("step", [(1, 0)]), ("part", [(1, 1)]), ("step", [(5, 0)]),
                         ("part", [(1, 1)]), ("part", [(1, 1)])]


def test_busy_seconds_of_a_launch_that_failed_on_its_thread() -> None:
    """A launch that raised on the launcher thread recorded no end event: its busy time is the
    host's, and asking for it does not raise again (collect reported the error; raising in the
    runtime's loop would stop every stage)."""
    from concurrent.futures import Future

    from omnistage.engine.step import LaunchedStep
    failed: Future = Future()
    failed.set_exception(RuntimeError("stack expects each tensor to be equal size"))
    class NeverRecorded:  # the end event its thread never recorded
        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            raise AssertionError("no end event to wait for")

    step = LaunchedStep(state=None, end=NeverRecorded(), pending=failed, wall_seconds=0.25)
    assert step.done() and step.busy_seconds() == 0.25


def test_first_outputs_alone_only_when_no_one_waits_for_input() -> None:
    w = _worker(first_output_alone=True)
    w.submit("a", [1, 2])
    w.submit("b", [])
    w.add_input("b", [3], finished=False)  # b waits for input for its first output
    launched = w.launch()
    assert not launched.exclusive
    w.collect(launched)
    w.add_input("b", [4], finished=True)
    launched = w.launch()
    assert launched.exclusive and w.alone_steps == 1
    assert _ids(w.collect(launched)) == [("b", [30, 40], True)]


def test_bad_config_names_the_field() -> None:
    for name, value in (("max_batch", 0), ("preempt_parts", -1), ("free_sms", "half"),
                        ("cuda_graphs", "on"), ("launch_thread", "yes")):
        with pytest.raises(ValueError, match=name):
            GenEngineConfig(**{name: value})


def test_qwen2_5_omni_code2wav_runs_on_the_engine() -> None:
    from omnistage.models.qwen2_5_omni.code2wav_stage import code2wav_worker
    from tests.models.qwen2_5_omni.test_token2wav import tiny_token2wav_pair
    stage = code2wav_worker("code2wav", tiny_token2wav_pair()[1], CPU, None)
    assert type(stage) is type(_worker()) is GenStageWorker


# ------------------------------------------------------------ the toy stage in a pipeline YAML
@dataclass
class ToySpeakerState(ToyState):
    seed: int = 0


class ToySpeaker(ToyChunker):
    """ToyChunker behind an LM: its input is the LM's tokens, each output an "audio" chunk (the
    chunk's token ids / 1000), its request the seed the pipeline gives the stage."""

    def new_state(self, request: int) -> ToySpeakerState:
        return ToySpeakerState(seed=request)

    def _tag(self, batch: list[ToyState]) -> list[tuple[int, int]]:
        return [(len(s.ints), s.outputs) for s in batch]

    def outputs(self, result: list[list[int]]) -> list[dict[str, Any]]:
        return [{"audio": np.asarray(chunk, dtype=np.float32) / 10_000} for chunk in result]


@register_adapter("toy_lm_tokens")
class ToyTokensAdapter:
    """The LM's new tokens (and its end) -> the toy stage's input."""

    def send(self, ev, upstream) -> tuple[list[int], bool] | None:
        return (list(ev.token_ids), ev.finished) if ev.token_ids or ev.finished else None

    def receive(self, request_id: str, msg: tuple[list[int], bool], downstream) -> None:
        downstream.add_input(request_id, *msg)


@register_stage("ToySpeaker", "gen", sample_rate=8000)
def build_toy_speaker(ctx) -> GenStageWorker:
    return GenStageWorker(ctx.name, ToySpeaker(), ctx.device, GenEngineConfig(preempt_parts=1))


TOY_YAML = {"name": "lm_then_toy", "stages": [
    {"name": "llm", "kind": "ar", "model": "causal_lm", "output": "text"},
    {"name": "speaker", "kind": "gen", "model": "ToySpeaker", "output": "audio",
     "inputs": [{"upstream": "llm", "adapter": "toy_lm_tokens"}]}]}
PROMPTS = ["Hello there", "A toy stage"]


def _pipeline_file(tmp_path) -> str:
    path = tmp_path / "lm_then_toy.yaml"
    path.write_text(yaml.safe_dump(TOY_YAML))
    return str(path)


def _expected_audio(token_ids: list[int]) -> np.ndarray:
    return np.asarray([10 * t for t in token_ids], dtype=np.float32) / 10_000


def test_toy_stage_streams_through_omnillm(tiny_qwen2, tmp_path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=7, min_tokens=7, seed=3)
    with OmniLLM(str(tiny_qwen2), pipeline=_pipeline_file(tmp_path), device="cpu") as llm:
        assert type(llm.pipeline.workers["speaker"]) is GenStageWorker
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        log = llm.pipeline.workers["speaker"].model.log
    for out in outs:
        assert out.error is None and len(out.token_ids) == 7 and out.sample_rate == 8000
        assert np.array_equal(out.audio, _expected_audio(out.token_ids))  # every chunk, in order
    assert any(kind == "part" for kind, _ in log)  # later chunks ran in parts


def test_toy_stage_streams_through_async_omnillm(tiny_qwen2, tmp_path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=7, min_tokens=7, seed=3)

    async def run() -> tuple[list[np.ndarray], list[int]]:
        llm = AsyncOmniLLM(str(tiny_qwen2), pipeline=_pipeline_file(tmp_path), device="cpu")
        try:
            chunks, ids = [], []
            async for out in llm.generate(PROMPTS[0], params):
                if out.audio is not None:
                    chunks.append(out.audio)
                ids = out.token_ids
            return chunks, ids
        finally:
            llm.shutdown()

    chunks, ids = asyncio.run(run())
    assert [len(c) for c in chunks] == [CHUNK, CHUNK, CHUNK, 1]  # streamed chunk by chunk
    assert np.array_equal(np.concatenate(chunks), _expected_audio(ids))
