"""The runtime: stages overlap and stream, concurrency with aborts, crashes, timeouts."""

from __future__ import annotations

import asyncio
import random
import time

import numpy as np
import pytest

from omnistage import AsyncOmniLLM, OmniLLM, SamplingParams
from omnistage.testing.tiny_omni import TINY_TALKER_EOS, tiny_omni_test_messages


def speech_params(thinker_tokens: int, codes: int, seed: int = 1) -> dict:
    return {"thinker": SamplingParams(temperature=0, max_tokens=thinker_tokens,
                                      min_tokens=thinker_tokens, seed=seed),
            "talker": SamplingParams(temperature=0, repetition_penalty=1.05, max_tokens=codes,
                                     min_tokens=codes, stop_token_ids=TINY_TALKER_EOS,
                                     suppress_token_ids=[121])}


def test_talker_starts_before_the_thinker_finishes(tiny_omni_dir):
    llm = OmniLLM(str(tiny_omni_dir))
    llm.runtime.step_delay["thinker"] = 0.002  # test-only: a slower thinker
    llm.runtime.trace = []
    out = llm.generate({"messages": tiny_omni_test_messages()["text_only"]},
                       speech_params(64, 256), use_tqdm=False)[0]
    assert len(out.token_ids) == 64 and len(out.stages["talker"].token_ids) == 256
    trace = llm.runtime.trace
    first_code = next(i for i, (stage, _, n, _) in enumerate(trace) if stage == "talker" and n)
    last_token = max(i for i, (stage, _, n, _) in enumerate(trace) if stage == "thinker" and n)
    assert first_code < last_token  # streamed: speech began while text was being written
    thinker_at_first_code = max(n for stage, _, n, _ in trace[:first_code] if stage == "thinker")
    assert thinker_at_first_code < 64
    first_audio = next(i for i, (stage, _, _, audio) in enumerate(trace) if audio)
    thinker_at_first_audio = max(n for stage, _, n, _ in trace[:first_audio]
                                 if stage == "thinker")
    assert thinker_at_first_audio < 64  # audio out while the text is still being written
    assert sum(1 for *_, audio in trace if audio) > 1  # in several chunks
    assert out.audio.shape[0] == 256 * 480
    llm.shutdown()


def test_streamed_audio_against_one_shot(tiny_omni_dir, caplog):
    from omnistage.models.qwen2_5_omni.code2wav_stream import Qwen2_5OmniCode2WavStreamConfig
    msg = {"messages": tiny_omni_test_messages()["audio_text"]}
    params = speech_params(16, 90)
    outs = {}
    for name, window in [("one_shot", None), ("default", Qwen2_5OmniCode2WavStreamConfig()),
                         ("whole", Qwen2_5OmniCode2WavStreamConfig(past_blocks=64,
                                                                   future_blocks=64))]:
        llm = OmniLLM(str(tiny_omni_dir), code2wav_window=window)
        outs[name] = llm.generate(msg, params, use_tqdm=False)[0].audio
        llm.shutdown()
    ref = outs["one_shot"]
    assert ref.shape == outs["default"].shape == outs["whole"].shape == (90 * 480,)
    assert np.abs(outs["whole"] - ref).max() < 1e-4  # a window covering everything = one-shot
    noise = outs["default"] - ref
    snr = 10 * np.log10(float((ref ** 2).sum()) / max(float((noise ** 2).sum()), 1e-30))
    print(f"default-window SNR vs one-shot: {snr:.1f} dB")
    assert snr > 20


def _run_concurrent(llm: AsyncOmniLLM, prompts, params, abort_ids: set[int]):
    async def one(i):
        outs = []
        gen = llm.generate(prompts[i], params[i], request_id=f"req-{i}")
        async for out in gen:
            outs.append(out)
            if i in abort_ids and len(outs) == 2:
                await gen.aclose()  # the consumer goes away mid-stream
                return None
        return outs

    async def main():
        return await asyncio.gather(*(one(i) for i in range(len(prompts))))
    return asyncio.run(main())


def test_32_concurrent_mixed_requests_with_aborts(tiny_omni_dir):
    msgs = tiny_omni_test_messages()
    names = list(msgs)
    rng = random.Random(0)
    prompts, params = [], []
    for i in range(32):
        prompts.append({"messages": msgs[names[i % len(names)]],
                        "voice": "Ethan" if i % 3 else "Chelsie"})
        params.append(speech_params(rng.randint(4, 12), rng.randint(8, 40), seed=i))
    aborts = set(rng.sample(range(32), 6))
    llm = AsyncOmniLLM(str(tiny_omni_dir), max_num_seqs=16)
    free_before = {n: e.blocks.num_free_blocks for n, e in llm.pipeline.engines.items()}
    results = _run_concurrent(llm, prompts, params, aborts)
    deadline = time.time() + 10
    while llm.runtime.num_active() and time.time() < deadline:
        time.sleep(0.05)
    assert llm.runtime.num_active() == 0
    for name, engine in llm.pipeline.engines.items():  # aborted requests freed every block
        assert engine.blocks.num_free_blocks == free_before[name], name
        assert not engine.has_unfinished()
    assert llm.runtime.stats()["code2wav"]["max_batch_size"] > 1
    alone_llm = OmniLLM(str(tiny_omni_dir))
    for i, outs in enumerate(results):
        if i in aborts:
            assert outs is None
            continue
        final = outs[-1]
        assert final.finished and final.error is None
        streamed = "".join(o.text_delta for o in outs)
        assert streamed == final.text
        audio = np.concatenate([o.audio for o in outs if o.audio is not None])
        alone = alone_llm.generate(prompts[i], params[i], use_tqdm=False)[0]
        assert final.token_ids == alone.token_ids
        assert final.stages["talker"].token_ids == alone.stages["talker"].token_ids
        assert audio.shape == alone.audio.shape
        assert np.abs(audio - alone.audio).max() < 1e-5
    llm.shutdown()
    alone_llm.shutdown()
    assert not llm.runtime.alive


def test_transient_stage_fault_fails_no_request(tiny_omni_dir):
    """A step that raises once and not again when its requests are re-run alone (a transient
    fault) fails no request: the runtime finds no culprit and goes on."""
    llm = OmniLLM(str(tiny_omni_dir))
    engine = llm.pipeline.workers["talker"].engine
    real_launch = engine.launch  # what a step runs first, with or without overlap
    crashes = {"left": 1}

    def flaky_launch():
        if crashes["left"]:
            crashes["left"] -= 1
            raise RuntimeError("injected fault")
        return real_launch()
    engine.launch = flaky_launch
    msg = {"messages": tiny_omni_test_messages()["text_only"]}
    t0 = time.time()
    out = llm.generate(msg, speech_params(6, 16), use_tqdm=False)[0]
    assert time.time() - t0 < 10
    assert crashes["left"] == 0 and llm.runtime.stage_errors["talker"] == 1
    assert out.error is None and out.audio.shape[0] == 16 * 480
    for engine in llm.pipeline.engines.values():
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    llm.shutdown()


def test_request_timeout(tiny_omni_dir):
    llm = OmniLLM(str(tiny_omni_dir), request_timeout=0.3)
    llm.runtime.step_delay["thinker"] = 0.05
    out = llm.generate({"messages": tiny_omni_test_messages()["text_only"]},
                       speech_params(64, 64), use_tqdm=False)[0]
    assert out.error == "request timed out"
    assert all(not e.has_unfinished() for e in llm.pipeline.engines.values())
    llm.shutdown()


def test_async_bad_input_raises_before_work(tiny_omni_dir):
    llm = AsyncOmniLLM(str(tiny_omni_dir))

    async def main():
        with pytest.raises(ValueError, match="voice"):
            async for _ in llm.generate({"messages": [{"role": "user", "content": "hi"}],
                                         "voice": "alloy"}):
                pass
    asyncio.run(main())
    assert llm.runtime.num_active() == 0
    llm.shutdown()
