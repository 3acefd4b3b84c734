"""Start-up phases (issue 24): where building a pipeline spent its seconds, per stage and part,
in the log and on the server's omnistage_startup_seconds gauge."""

from __future__ import annotations

import logging

import pytest

from omnistage import OmniLLM
from omnistage.entrypoints.openai.metrics import ServerMetrics
from omnistage.runtime import startup


def test_phases_nest_and_add_up():
    with startup.recording() as phases:
        with startup.phase("a"):
            with startup.phase("x"):
                pass
            with startup.phase("x"):  # repeats add up
                pass
        with startup.phase("b"):
            pass
    assert set(phases) == {"a", "a.x", "b", "total", "other"}
    assert 0 <= phases["a.x"] <= phases["a"] <= phases["total"]
    # what no top-level phase covers: the rest of the total
    assert phases["other"] == pytest.approx(phases["total"] - phases["a"] - phases["b"],
                                            abs=1e-9)
    with startup.phase("outside"):  # no recording under way: nothing kept, nothing raised
        pass
    assert "outside" not in phases


def test_omni_pipeline_reports_each_stage(tiny_omni_dir, caplog):
    with caplog.at_level(logging.INFO, logger="omnistage"):
        llm = OmniLLM(str(tiny_omni_dir))
    try:
        phases = llm.startup_seconds
        for stage in ("thinker", "talker"):
            parts = [phases[f"{stage}.{p}"] for p in ("weights", "engine", "graphs")]
            assert all(v >= 0 for v in parts) and sum(parts) <= phases[stage]
        assert phases["code2wav"] > 0 and "runtime" in phases
        assert sum(phases[s] for s in ("thinker", "talker", "code2wav", "runtime")) \
            <= phases["total"]
        line = next(r.getMessage() for r in caplog.records if "start-up" in r.getMessage())
        assert "thinker" in line and "weights" in line and "total" in line
        text = ServerMetrics(llm, lambda: 0).render().decode()
        assert 'omnistage_startup_seconds{phase="thinker.weights"}' in text
        assert 'omnistage_startup_seconds{phase="total"}' in text
    finally:
        llm.shutdown()


def test_warmup_runs_every_stage_and_leaves_the_engine_idle(tiny_omni_dir):
    from omnistage import AsyncOmniLLM
    for cls in (OmniLLM, AsyncOmniLLM):
        llm = cls(str(tiny_omni_dir))
        try:
            stats_before = llm.runtime.stats()
            seconds = llm.warmup()
            assert seconds is not None and seconds > 0
            assert llm.startup_seconds["warmup"] == seconds
            stats = llm.runtime.stats()
            assert stats["thinker"]["steps"] > stats_before["thinker"]["steps"]
            assert stats["talker"]["steps"] > stats_before["talker"]["steps"]
            assert stats["code2wav"]["steps"] > stats_before["code2wav"]["steps"]
            assert llm.runtime.num_active() == 0
            for engine in llm.pipeline.engines.values():
                assert not engine.has_unfinished()
        finally:
            llm.shutdown()


def test_gen_stage_graph_warmup_is_its_own_phase(tiny_omni_dir):
    # the code2wav worker's warm-up (its graphs: most of a cold start on CUDA) shows as
    # `code2wav.graphs`, inside the stage's own phase
    from omnistage import OmniLLM
    with OmniLLM(str(tiny_omni_dir), device="cpu") as llm:
        phases = dict(llm.startup_seconds)
    assert "code2wav.graphs" in phases, phases
    assert 0 <= phases["code2wav.graphs"] <= phases["code2wav"] <= phases["total"], phases



def test_a_stage_that_cannot_be_built_is_named(tiny_omni_dir, monkeypatch):
    # e.g. its KV cache does not fit what is left of the device: the error says which stage
    from omnistage.runtime import build
    real = build.build_stage_worker

    def build_or_refuse(path, config, pipeline, name, *args):
        if name == "talker":
            raise ValueError("num_kv_blocks: memory for 3 blocks cannot hold one sequence")
        return real(path, config, pipeline, name, *args)

    monkeypatch.setattr(build, "build_stage_worker", build_or_refuse)
    with pytest.raises(ValueError, match=r"^stage talker: num_kv_blocks: memory for 3 blocks"):
        OmniLLM(str(tiny_omni_dir), device="cpu")


def _graph_keys(llm) -> dict[str, tuple[set, set]]:
    """Each AR stage's (decode graph keys, prefill graph keys) registered so far."""
    keys = {}
    for name, engine in llm.pipeline.engines.items():
        runner = engine.runner
        keys[name] = (set(runner.graphs.graphs),
                      set(runner.prefill_graphs.graphs) if runner.prefill_graphs else set())
    return keys


@pytest.mark.parametrize("ckpt", ["tiny_omni_dir", "tiny_qwen3_omni_dir"])
def test_warmup_leaves_no_graph_for_the_first_requests(ckpt, request):
    # On CUDA every graph key registered after the warm-up is a capture on a user's request,
    # stalling it (a talker prefill capture added 50-90 ms to the first requests' TTFA on the
    # H200). cuda_graphs="eager" runs the same bookkeeping on the CPU: after warmup(), requests
    # of other prompt lengths and a prefix-cache hit (the same prompt again) register no key.
    from omnistage import SamplingParams
    llm = OmniLLM(str(request.getfixturevalue(ckpt)), cuda_graphs="eager")
    try:
        llm.warmup()
        after_warmup = _graph_keys(llm)
        assert after_warmup["talker"][1], "the warm-up request prefilled no talker graph"
        params = {name: SamplingParams(**{**p.__dict__, "max_tokens": 6, "min_tokens": 6,
                                          "ignore_eos": True})
                  for name, p in llm.pipeline.default_params.items()}
        prompts = ["Tell me a short story about a lighthouse keeper and a storm.", "Hi.",
                   "Tell me a short story about a lighthouse keeper and a storm."]
        for text in prompts:
            out = llm.generate([{"messages": [{"role": "user", "content": text}]}], params,
                               use_tqdm=False)[0]
            assert out.error is None and out.metrics.tokens_per_stage["talker"] == 6
            assert _graph_keys(llm) == after_warmup, text
    finally:
        llm.shutdown()


def test_jobs_of_stages_that_wait_for_them_are_submitted_first(monkeypatch):
    # code2wav waits for its kernels compiled ahead, the AR stages take those done in time:
    # the pool starts code2wav's first although its stage builds last
    import dataclasses

    import torch

    from omnistage.config.schema import load_pipeline
    from omnistage.models.registry import STAGE_BUILDERS
    from omnistage.runtime import build
    started: dict[str, list] = {}
    monkeypatch.setattr(build, "stage_context", lambda *args: None)
    monkeypatch.setattr(build, "cuda_target", lambda dev: ("cuda", 90, 32))
    monkeypatch.setattr(build.KernelsAhead, "start",
                        classmethod(lambda cls, jobs: started.update(jobs)))
    pipeline = load_pipeline("qwen2_5_omni")
    for stage in pipeline.stages:
        monkeypatch.setitem(STAGE_BUILDERS, stage.model, dataclasses.replace(
            STAGE_BUILDERS[stage.model], kernels_ahead=lambda ctx, name=stage.name: [name]))
    local = [(s.name, s, torch.device("cuda"), torch.bfloat16, None) for s in pipeline.stages]
    build.start_kernels_ahead(None, {}, pipeline, local, {})
    assert [unit for unit in started] == ["code2wav", "thinker", "talker"]
    assert started["talker"] == (("cuda", 90, 32), ["talker"])


def test_kernels_ahead_are_awaited_where_each_stage_first_needs_them(tiny_omni_dir,
                                                                      monkeypatch):
    # an AR stage takes its kernels compiled ahead after its weights and engine, just before
    # its graphs, without waiting for those not done (it compiles them); a generation stage,
    # whose warm-up is inside its build, waits for them before its build; each unit once
    import contextlib

    from omnistage.runtime import build
    events: list[str] = []
    timeouts: dict[str, float] = {}

    class Ahead:
        def listed(self, unit: str) -> bool:
            return True

        def wait(self, unit: str, timeout: float) -> list:
            events.append(f"wait {unit}")
            timeouts[unit] = timeout
            return []

        def close(self) -> None:
            events.append("close")

    real_phase = startup.phase

    @contextlib.contextmanager
    def phase(name: str):
        events.append(name)
        with real_phase(name):
            yield

    monkeypatch.setattr(build, "start_kernels_ahead", lambda *args: Ahead())
    monkeypatch.setattr(startup, "phase", phase)
    with OmniLLM(str(tiny_omni_dir), device="cpu") as llm:
        phases = dict(llm.startup_seconds)
    for unit in ("thinker", "talker"):
        at = events.index(unit)
        mine = events[at:events.index("graphs", at) + 1]
        assert mine[-3:] == ["kernels_ahead", f"wait {unit}", "graphs"], mine
        assert "weights" in mine and "engine" in mine
        assert f"{unit}.kernels_ahead" in phases
    at = events.index("code2wav")
    assert events[at + 1:at + 3] == ["kernels_ahead", "wait code2wav"], events[at:]
    assert sorted(e for e in events if e.startswith("wait")) == [
        "wait code2wav", "wait talker", "wait thinker"]
    assert timeouts == {"thinker": build.AR_WAIT_SECONDS, "talker": build.AR_WAIT_SECONDS,
                        "code2wav": build.WAIT_SECONDS} and build.AR_WAIT_SECONDS == 0
