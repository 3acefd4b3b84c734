"""Numeric fields bounded at the edge (issue 24, defect 1): the Python API
(SamplingParams.validate), the pipeline YAML (SamplingDefaults), the stage-seed wrap and the
code2wav noise seed. A seed or count out of int64 used to raise inside a stage and fail every
request in it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import yaml

from omnistage.config.schema import BUILTIN_DIR, SamplingDefaults, load_pipeline
from omnistage.models.qwen2_5_omni.token2wav import Qwen2_5OmniToken2Wav
from omnistage.sampling_params import (INT32_MAX, INT64_MAX, INT64_MIN, SamplingParams,
                                       stage_seed)


# ---------------------------------------------------------------- stage seeds
@pytest.mark.parametrize("seed,offset,expected", [
    (0, 1, 1), (5, 2, 7), (-3, 2, -1), (INT64_MIN, 1, INT64_MIN + 1),
    (INT64_MAX, 1, INT64_MIN), (INT64_MAX, 2, INT64_MIN + 1), (INT64_MAX - 1, 2, INT64_MIN)])
def test_stage_seed_wraps_into_int64(seed, offset, expected):
    assert stage_seed(seed, offset) == expected


def test_stage_seed_keeps_torch_draws():
    """The wrap is modulo 2^64, as torch reads a seed: the same draws as the unwrapped s + k."""
    for seed, offset in ((INT64_MAX, 1), (INT64_MAX, 2), (-7, 2)):
        wrapped = torch.Generator().manual_seed(stage_seed(seed, offset))
        plain = torch.Generator().manual_seed((seed + offset) % (1 << 64))
        assert torch.equal(torch.randn(8, generator=wrapped), torch.randn(8, generator=plain))


def test_initial_noise_takes_any_int_seed():
    """code2wav's noise seed: in range by construction (2^64 used to overflow manual_seed)."""
    noise = Qwen2_5OmniToken2Wav.initial_noise
    assert torch.equal(noise(1 << 64, 2, max_frames=4), noise(0, 2, max_frames=4))
    assert torch.equal(noise(INT64_MIN - 1, 2, max_frames=4), noise(INT64_MAX, 2, max_frames=4))
    assert torch.equal(noise(-1, 2, max_frames=4), noise((1 << 64) - 1, 2, max_frames=4))


# ---------------------------------------------------------------- Python API
@pytest.mark.parametrize("field,value", [
    ("seed", 1 << 63), ("seed", (1 << 64) - 1), ("seed", INT64_MIN - 1),
    ("top_k", 1 << 63), ("top_k", INT32_MAX + 1), ("top_k", -2),
    ("max_tokens", INT32_MAX + 1), ("min_tokens", 1 << 63),
    ("temperature", 1e300), ("repetition_penalty", 1e9),
    ("stop_token_ids", [1 << 63]), ("suppress_token_ids", [-1]),
])
def test_out_of_range_field_named(field, value):
    extra = {"max_tokens": None} if field == "min_tokens" else {}
    p = SamplingParams(**{field: value, **extra})
    with pytest.raises(ValueError, match=rf"^sampling_params\.{field}(\[0\])?: "):
        p.validate()


def test_token_ids_checked_against_the_vocabulary():
    with pytest.raises(ValueError, match=r"stop_token_ids\[1\]: must be in \[0, 99\]"):
        SamplingParams(stop_token_ids=[3, 100]).validate(vocab_size=100)
    with pytest.raises(ValueError, match=r"suppress_token_ids\[0\]"):
        SamplingParams(suppress_token_ids=[100]).validate(vocab_size=100)


def test_edges_are_valid():
    for p in (SamplingParams(seed=INT64_MIN, top_k=-1), SamplingParams(seed=INT64_MAX, top_k=0),
              SamplingParams(top_k=INT32_MAX, max_tokens=INT32_MAX, min_tokens=INT32_MAX,
                             temperature=100.0, stop_token_ids=[INT64_MAX])):
        p.validate()


# ---------------------------------------------------------------- pipeline YAML
def _pipeline_with_talker_sampling(**sampling) -> dict:
    data = yaml.safe_load((BUILTIN_DIR / "qwen2_5_omni.yaml").read_text())
    data["stages"][1]["default_sampling"] = sampling
    return data


@pytest.mark.parametrize("field,value", [
    ("top_k", 1 << 63), ("max_tokens", 1 << 40), ("min_tokens", -1), ("temperature", 1e9),
    ("repetition_penalty", 0.0)])
def test_yaml_bounds_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"stages\.1\.default_sampling\.{field}: "):
        load_pipeline(_pipeline_with_talker_sampling(**{field: value}))


def test_yaml_defaults_apply_validates():
    cfg = load_pipeline(_pipeline_with_talker_sampling(top_k=INT32_MAX, max_tokens=8))
    assert cfg.stages[1].default_sampling.apply(SamplingParams()).top_k == INT32_MAX
    with pytest.raises(ValueError, match=r"default_sampling\.min_tokens: 9 exceeds"):
        SamplingDefaults(min_tokens=9).apply(SamplingParams(max_tokens=8))


# ---------------------------------------------------------------- pipelines derive stage seeds
@pytest.mark.parametrize("model", ["tiny_omni_dir", "tiny_qwen3_omni_dir"])
def test_pipeline_stage_seeds_wrap(model, request):
    """A request seed of 2^63-1: the talker (s+1) and Qwen2.5's code2wav (s+2) wrap to
    -2^63 and -2^63+1; a code2wav seed out of int64 is refused by name."""
    from omnistage.entrypoints.llm import OmniLLM
    llm = OmniLLM(str(request.getfixturevalue(model)), device="cpu")
    try:
        pipe = llm.pipeline
        params = {name: dataclasses.replace(p, seed=None)
                  for name, p in pipe.default_params.items()}
        params[pipe.roles["thinker"].name].seed = INT64_MAX
        prompt = {"messages": [{"role": "user", "content": "Hello"}]}
        req = pipe.prepare(prompt, params, ["text", "audio"], "prompts[0]", 0)
        assert req.stage_requests[pipe.roles["talker"].name].seed == INT64_MIN
        code2wav = pipe.roles["code2wav"].name
        if hasattr(req.stage_requests[code2wav], "seed"):  # Qwen3's code2wav draws no noise
            assert req.stage_requests[code2wav].seed == INT64_MIN + 1
            params[code2wav] = dataclasses.replace(params[code2wav], seed=1 << 64)
            with pytest.raises(ValueError, match=rf"sampling_params\[0\]\[{code2wav}\]\.seed"):
                pipe.prepare(prompt, params, ["text", "audio"], "prompts[0]", 1)
    finally:
        llm.shutdown()
