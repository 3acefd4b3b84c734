"""Seeded speech under load against the same requests alone (issue 24, defect 7): the guarantee
of docs/quickstart.md ("Determinism"). On CPU in float32, the thinker's tokens and the talker's
codes are identical; the audio, as the server sends it (pcm16), is within 1 LSB.

Why not bit-identical: code2wav decodes the chunks of concurrent requests in one batch, and
BigVGAN's convolutions (oneDNN on CPU) sum in a different order at another batch size (~1e-7 in
float32); a sample that lands near a rounding boundary then rounds to the neighbouring int16.
Running the vocoder row by row would remove it, at 1.6-2.6x its time (measured on 2 CPU
cores); the DiT's windows are bit-identical in any batch."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np

from omnistage import AsyncOmniLLM, OmniLLM, SamplingParams
from omnistage.entrypoints.openai.serving import to_pcm16

TEXTS = ["Hello there.", "How are you today?", "The weather is nice.", "Good morning!",
         "See you later.", "Thank you very much."]
CODES = 48  # per request: 48 x 480 samples, a few code2wav chunks each


def _requests(llm) -> list[tuple[dict, dict[str, SamplingParams]]]:
    """Seeded speech requests (as /v1/audio/speech builds them), the talker held to CODES."""
    talker = dataclasses.replace(llm.pipeline.default_params["talker"], min_tokens=CODES,
                                 max_tokens=CODES)
    out = []
    for i, text in enumerate(TEXTS):
        prompt = {"messages": [{"role": "user", "content": text}], "forced_reply": text,
                  "voice": "Chelsie" if i % 2 else "Ethan"}
        out.append((prompt, {"thinker": SamplingParams(seed=100 + i), "talker": talker}))
    return out


def _concurrent(llm: AsyncOmniLLM, requests) -> list:
    async def one(prompt, params):
        outs = [out async for out in llm.generate(prompt, params)]
        audio = np.concatenate([o.audio for o in outs if o.audio is not None])
        return outs[-1], audio

    async def main():
        return await asyncio.gather(*(one(p, sp) for p, sp in requests))
    return asyncio.run(main())


def test_seeded_speech_under_load_matches_alone_within_one_lsb(tiny_omni_dir):
    concurrent_llm = AsyncOmniLLM(str(tiny_omni_dir))
    try:
        results = _concurrent(concurrent_llm, _requests(concurrent_llm))
        batched = concurrent_llm.runtime.stats()["code2wav"]["max_batch_size"]
    finally:
        concurrent_llm.shutdown()
    assert batched > 1  # code2wav did decode chunks of several requests together
    alone_llm = OmniLLM(str(tiny_omni_dir))
    try:
        alone = [alone_llm.generate(p, sp, use_tqdm=False)[0]
                 for p, sp in _requests(alone_llm)]
    finally:
        alone_llm.shutdown()

    float_diff, lsb_diff, lsb_samples = 0.0, 0, 0
    for (final, audio), ref in zip(results, alone, strict=True):
        assert final.error is None and ref.error is None, (final.error, ref.error)
        assert final.token_ids == ref.token_ids  # thinker tokens
        assert final.stages["talker"].token_ids == ref.stages["talker"].token_ids  # codes
        assert len(final.stages["talker"].token_ids) == CODES
        assert audio.shape == ref.audio.shape == (CODES * 480,)
        float_diff = max(float_diff, float(np.abs(audio - ref.audio).max()))
        d = np.abs(to_pcm16(audio).astype(np.int32) - to_pcm16(ref.audio).astype(np.int32))
        lsb_diff, lsb_samples = max(lsb_diff, int(d.max())), lsb_samples + int((d > 0).sum())
    print(f"concurrent (code2wav batch up to {batched}) vs alone: max |float diff| "
          f"{float_diff:.3g}, max int16 diff {lsb_diff} LSB ({lsb_samples} of "
          f"{len(TEXTS) * CODES * 480} samples differ)")
    assert lsb_diff <= 1
    assert float_diff < 1e-5
