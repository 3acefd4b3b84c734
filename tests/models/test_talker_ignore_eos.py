"""`ignore_eos` on an Omni talker: its end codes are stop ids (no tokenizer eos), so the flag
bans them and every request runs to the talker's max_tokens: fixed-length audio, as the
serving benchmark and a user asking for it expect. Before, ignore_eos did nothing there, and
sampled talkers (temperature 0.9) ended early at random under load."""

from __future__ import annotations

import pytest

from omnistage import OmniLLM, SamplingParams

CODES = 24
REQUESTS = 8


@pytest.mark.parametrize("family", ["qwen2_5_omni", "qwen3_omni"])
def test_talker_ignore_eos_runs_to_max_tokens(family, tiny_omni_dir, tiny_qwen3_omni_dir):
    path = tiny_omni_dir if family == "qwen2_5_omni" else tiny_qwen3_omni_dir
    with OmniLLM(str(path), device="cpu") as llm:
        talker = llm.pipeline.roles["talker"].name
        defaults = llm.pipeline.default_params[talker]
        assert defaults.stop_token_ids, "the talker's end codes are stop ids"

        def run(ignore_eos: bool) -> list:
            params = [{"thinker": SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                 seed=seed),
                       talker: SamplingParams(**{**defaults.__dict__, "max_tokens": CODES,
                                                 "ignore_eos": ignore_eos})}
                      for seed in range(REQUESTS)]
            prompts = [{"messages": [{"role": "user", "content": "Say something."}]}] * REQUESTS
            return llm.generate(prompts, params, use_tqdm=False)

        outs = run(True)
        for out in outs:
            assert out.error is None, out.error
            stage = out.stages[talker]
            assert (len(stage.token_ids), stage.finish_reason) == (CODES, "length")
            assert not set(stage.token_ids) & set(defaults.stop_token_ids)
        audio = {len(out.audio) for out in outs}
        assert len(audio) == 1 and audio.pop() > 0  # every request the same audio length
        if family == "qwen2_5_omni":  # the control: without the flag some sampled talker ends
            # early, so the check bites (the tiny Qwen3 talker samples its eos too rarely)
            assert any(len(out.stages[talker].token_ids) < CODES for out in run(False))
