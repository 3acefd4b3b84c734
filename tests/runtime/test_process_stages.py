"""One process per stage: the same results as in-process, little traffic through the
orchestrator, and a killed stage process fails only its requests and comes back."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import numpy as np
import pytest

from omnistage import AsyncOmniLLM, OmniLLM, SamplingParams
from omnistage.config.schema import load_pipeline
from omnistage.testing.tiny_omni import TINY_TALKER_EOS, tiny_omni_test_messages


def speech_params(thinker_tokens: int, codes: int, seed: int) -> dict:
    return {"thinker": SamplingParams(temperature=0.8, top_k=50, max_tokens=thinker_tokens,
                                      min_tokens=thinker_tokens, seed=seed),
            "talker": SamplingParams(temperature=0.9, top_k=40, top_p=0.8,
                                     repetition_penalty=1.05, max_tokens=codes, min_tokens=codes,
                                     stop_token_ids=TINY_TALKER_EOS, suppress_token_ids=[121],
                                     seed=seed)}


def test_same_results_in_process_and_one_process_per_stage(tiny_omni_dir):
    msgs = tiny_omni_test_messages()
    prompts = [{"messages": msgs[k]} for k in ("text_only", "audio_text", "image_text")]
    params = [speech_params(12, 40 + 10 * i, seed=i) for i in range(len(prompts))]
    with OmniLLM(str(tiny_omni_dir), device="cpu") as llm:
        ref = llm.generate(prompts, params, use_tqdm=False)
    llm = OmniLLM(str(tiny_omni_dir), device="cpu", stage_worker="process")
    try:
        assert not llm.pipeline.workers and set(llm.runtime.remote) == {
            "thinker", "talker", "code2wav"}
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.runtime.refresh_stats()
    finally:
        llm.shutdown()
    for a, b in zip(ref, outs, strict=True):
        assert a.error is None and b.error is None
        assert b.token_ids == a.token_ids and b.text == a.text
        codes = b.stages["talker"].token_ids
        assert codes == a.stages["talker"].token_ids and len(codes) > 0
        assert b.audio.shape == a.audio.shape == (len(codes) * 480,)
        assert float(np.abs(a.audio).max()) > 1e-3
        assert np.abs(b.audio - a.audio).max() < 1e-5
    # hidden rows and codes went stage process to stage process ...
    assert stats["talker"]["link_messages"] > 0 and stats["code2wav"]["link_messages"] > 0
    # ... so only control crosses the orchestrator: under 1 KB per stage step
    steps = sum(s["steps"] for s in stats.values())
    crossed = sum(s["control_bytes_up"] + s["control_bytes_down"] for s in stats.values())
    assert steps > 50
    assert crossed / steps < 1024, (crossed, steps)
    assert all(not s.proc.is_alive() for s in llm.runtime.remote.values())  # shut down


def test_killed_stage_process_fails_its_requests_and_is_restarted(tiny_omni_dir):
    llm = AsyncOmniLLM(str(tiny_omni_dir), device="cpu", stage_worker="process")
    llm.runtime.set_step_delay("talker", 0.02)  # test-only: the request is still running
    msg = {"messages": tiny_omni_test_messages()["text_only"]}

    async def last(gen, first_hook=None):
        outs = []
        async for o in gen:
            outs.append(o)
            if first_hook is not None:
                first_hook()
                first_hook = None
        return outs[-1]

    def kill_talker() -> None:
        os.kill(llm.runtime.remote["talker"].proc.pid, signal.SIGKILL)

    async def scenario():
        t0 = time.monotonic()
        dead = await asyncio.wait_for(last(llm.generate(msg, speech_params(8, 300, 1)),
                                           kill_talker), timeout=60)
        failed_after = time.monotonic() - t0
        ok = await asyncio.wait_for(last(llm.generate(msg, speech_params(8, 30, 2))), 120)
        return dead, failed_after, ok

    try:
        dead, failed_after, ok = asyncio.run(scenario())
        assert dead.finished and dead.error is not None and "talker" in dead.error
        assert failed_after < 10
        assert ok.error is None
        assert len(ok.stages["talker"].token_ids) == 30
        assert ok.stages["code2wav"].audio.shape == (30 * 480,)
        assert llm.runtime.remote["talker"].restarts == 1
        assert llm.runtime.stage_errors["talker"] == 1
    finally:
        llm.shutdown()
    assert all(not s.proc.is_alive() for s in llm.runtime.remote.values())


def test_llm_in_a_stage_process(tiny_qwen2):
    prompts = ["Hello there", "The quick brown fox", "1 2 3 4"]
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with OmniLLM(str(tiny_qwen2), device="cpu") as llm:
        ref = llm.generate(prompts, p, use_tqdm=False)
    with OmniLLM(str(tiny_qwen2), device="cpu", stage_worker="process") as llm:
        outs = llm.generate(prompts, p, use_tqdm=False)
        # the server's state reads what it needs off the pipeline, not off an engine here
        from omnistage.entrypoints.openai.serving import ServerConfig, ServerState
        state = ServerState(llm, ServerConfig(served_model_names=["tiny"]))
        assert not llm.pipeline.workers and state.max_model_len == llm.pipeline.max_model_len > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert all(len(o.token_ids) == 12 and o.text for o in outs)


def test_worker_key_in_yaml(tmp_path):
    cfg = load_pipeline("qwen2_5_omni").model_dump()
    cfg["stages"][2]["worker"] = "process"
    assert load_pipeline(cfg).stage("code2wav").worker == "process"
    cfg["stages"][2]["worker"] = "thread"
    with pytest.raises(ValueError, match=r"stages\.2\.worker"):
        load_pipeline(cfg)


@pytest.mark.parametrize("option, value, field", [
    ("stage_worker", "thread", "stage_worker"), ("code2wav_dit_dtype", "fp8", "code2wav_dit_dtype"),
    ("code2wav_warmup", "yes", "code2wav_warmup"), ("code2wav_window", 3, "code2wav_window"),
    ("code2wav_vocoder_dtype", "fp8", "code2wav_vocoder_dtype"),
    ("talker_handoff", "v4", "talker_handoff"), ("code2wav_free_sms", -8, "code2wav_free_sms"),
    ("code2wav_free_sms", "half", "code2wav_free_sms")])
def test_bad_pipeline_options_name_the_field(tiny_omni_dir, option, value, field):
    with pytest.raises(ValueError, match=field):
        OmniLLM(str(tiny_omni_dir), device="cpu", **{option: value})
