"""Request-fatal against stage-fatal errors (issue 24, defect 1): a batched step that raises
because of one request fails that request alone; the others in the same step finish exactly as
they would alone. A stage that raises for every request fails them all and keeps serving."""

from __future__ import annotations

import numpy as np
import pytest

from omnistage import OmniLLM, SamplingParams
from omnistage.testing.tiny_omni import TINY_TALKER_EOS, tiny_omni_test_messages
from tests.faults import poison_talker

POISON = 7  # the request seed of the request whose steps raise


def speech_params(seed: int, thinker_tokens: int = 6, codes: int = 24) -> dict:
    return {"thinker": SamplingParams(temperature=0, max_tokens=thinker_tokens,
                                      min_tokens=thinker_tokens, seed=seed),
            "talker": SamplingParams(temperature=0, repetition_penalty=1.05, max_tokens=codes,
                                     min_tokens=codes, stop_token_ids=TINY_TALKER_EOS,
                                     suppress_token_ids=[121])}


@pytest.fixture(scope="module")
def workload():
    msgs = tiny_omni_test_messages()
    names = list(msgs)
    seeds = [1, 2, POISON, 4, 5]
    prompts = [{"messages": msgs[names[i % len(names)]]} for i in range(len(seeds))]
    params = [speech_params(s, 4 + i, 16 + 4 * i) for i, s in enumerate(seeds)]
    return prompts, params, seeds


@pytest.fixture(scope="module")
def alone(tiny_omni_dir, workload):
    """Each request run by itself, with no fault anywhere."""
    prompts, params, _ = workload
    llm = OmniLLM(str(tiny_omni_dir))
    outs = [llm.generate(p, sp, use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    llm.shutdown()
    for out in outs:
        assert out.error is None and np.abs(out.audio).max() > 1e-3  # not silence
    return outs


def _poison_talker(llm: OmniLLM) -> dict:
    return poison_talker(llm, POISON + 1)


def _poison_code2wav(llm: OmniLLM) -> dict:
    """code2wav raises on any step whose batch holds the poisoned request (seed + 2)."""
    model = llm.pipeline.workers["code2wav"].model
    seen = {"raised": 0, "batch": 0}

    def guard(method):
        def run(batch, *args, **kwargs):
            if any(r.seed == POISON + 2 for r in batch):
                seen["raised"] += 1
                seen["batch"] = max(seen["batch"], len(batch))
                raise RuntimeError("injected: this request's noise cannot be drawn")
            return method(batch, *args, **kwargs)
        return run
    model.run, model.begin = guard(model.run), guard(model.begin)
    return seen


@pytest.mark.parametrize("poison", [_poison_talker, _poison_code2wav],
                         ids=["talker_ar", "code2wav_gen"])
def test_a_request_that_breaks_a_batched_step_fails_alone(tiny_omni_dir, workload, alone,
                                                          poison):
    prompts, params, seeds = workload
    llm = OmniLLM(str(tiny_omni_dir))
    seen = poison(llm)
    stage = "talker" if poison is _poison_talker else "code2wav"
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert seen["raised"] >= 2 and seen["batch"] > 1  # in a batch with others, then alone
    assert llm.runtime.stage_errors[stage] >= 1
    for seed, out, ref in zip(seeds, outs, alone):
        if seed == POISON:
            assert out.error is not None and "injected" in out.error and stage in out.error
            continue
        assert out.error is None, out.error
        assert out.token_ids == ref.token_ids
        assert out.stages["talker"].token_ids == ref.stages["talker"].token_ids
        assert out.audio.shape == ref.audio.shape
        assert np.abs(out.audio - ref.audio).max() < 1e-5
    for engine in llm.pipeline.engines.values():  # the culprit's blocks came back too
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert not llm.pipeline.workers["code2wav"].requests
    llm.shutdown()


def test_a_broken_stage_fails_every_request_and_serves_again(tiny_omni_dir, workload):
    prompts, params, _ = workload
    llm = OmniLLM(str(tiny_omni_dir))
    engine = llm.pipeline.workers["talker"].engine
    launch, broken = engine.launch, {"on": True}

    def launch_or_raise():
        if broken["on"]:
            raise RuntimeError("injected: the device is gone")
        return launch()
    engine.launch = launch_or_raise
    outs = llm.generate(prompts[:3], params[:3], use_tqdm=False)
    assert all(o.error is not None and "the device is gone" in o.error for o in outs)
    broken["on"] = False
    ok = llm.generate(prompts[0], params[0], use_tqdm=False)[0]
    assert ok.error is None and ok.audio.shape[0] == 16 * 480
    for e in llm.pipeline.engines.values():
        assert e.blocks.num_free_blocks == e.blocks.num_blocks
    llm.shutdown()


def test_a_handoff_that_raises_fails_its_request_alone(tiny_omni_dir, workload, alone):
    """A link adapter (thinker -> talker rows) that raises for one request fails that request
    in every stage; the others' handoffs go on."""
    prompts, params, seeds = workload
    llm = OmniLLM(str(tiny_omni_dir))
    host = llm.runtime.local["thinker"]
    forward = host._forward

    def forward_poisoned(events):
        for ev in events:
            req = llm.runtime.requests.get(ev.request_id)
            if req is not None and req.seed == POISON and ev.token_ids:
                for link in host.links.get(ev.request_id, ()):
                    link.adapter.send = _raise
        return forward(events)
    host._forward = forward_poisoned
    outs = llm.generate(prompts[:3], params[:3], use_tqdm=False)
    for seed, out, ref in zip(seeds[:3], outs, alone[:3]):
        if seed == POISON:
            assert out.error is not None and "handoff failed" in out.error
        else:
            assert out.error is None and out.token_ids == ref.token_ids
            assert np.abs(out.audio - ref.audio).max() < 1e-5
    for engine in llm.pipeline.engines.values():
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    llm.shutdown()


def _raise(*args, **kwargs):
    raise KeyError("injected: a row the handoff cannot place")
