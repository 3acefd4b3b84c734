"""Tensor parallelism with weight-only FP8 (quantization="fp8", CPU, gloo): a TP=2 stage gives
the TP=1 FP8 stage's greedy tokens (near-tie rule; MoE: router-gap rule) for the tiny Qwen2
(dense projections in FP8) and the tiny Qwen3-Omni thinker (experts in FP8). The row-parallel
weights (o_proj, down_proj, the experts' down_proj) are scaled by their whole rows, so every
rank's FP8 values are its slice of TP=1's: the logits agree to fp32 rounding, not only to the
quantisation error."""

from __future__ import annotations

import torch

from tests.engine.test_tensor_parallel import (assert_router_close, first_divergence,
                                               omni_seqs, qwen2_seqs, run_stage)


def _assert_logprobs_close(ref: dict, got: dict, atol: float) -> None:
    for rid, steps in ref["logprobs"].items():
        first = steps[0]  # the prompt's next token: no earlier divergence can affect it
        have = got["logprobs"][rid][0]
        for token, lp in first.items():
            if token in have:
                assert abs(have[token] - lp) < atol, (rid, token, have[token], lp)


def test_qwen2_tp2_fp8_matches_tp1_fp8(tiny_qwen2):
    plain = run_stage(tiny_qwen2, "llm", "llm", 1, qwen2_seqs)
    ref = run_stage(tiny_qwen2, "llm", "llm", 1, qwen2_seqs, quantization="fp8")
    got = run_stage(tiny_qwen2, "llm", "llm", 2, qwen2_seqs, quantization="fp8")
    assert ref["fp8_layers"] == got["fp8_layers"] == 2  # every decoder layer quantised
    first_divergence(ref, got)
    _assert_logprobs_close(ref, got, 1e-5)
    # FP8 is really on: the 16-bit model's first logprobs differ by more than that
    diffs = [abs(plain["logprobs"][r][0][t] - lp) for r in ref["logprobs"]
             for t, lp in ref["logprobs"][r][0].items() if t in plain["logprobs"][r][0]]
    assert max(diffs) > 1e-4
    # the projections left as parameters are gone on every rank; the rest is 1/TP
    for report in got["reports"]:
        assert not any(n.endswith(("o_proj.weight", "down_proj.weight"))
                       for n in report.param_shapes)
        assert report.param_shapes["model.embed_tokens.weight"][0] * 2 == \
            ref["reports"][0].param_shapes["model.embed_tokens.weight"][0]


def test_qwen3_omni_thinker_tp2_fp8_matches_tp1_fp8(tiny_qwen3_omni_dir):
    from omnistage.models.qwen3_omni.processor import Qwen3OmniInputProcessor
    from omnistage.models.qwen3_omni.thinker import thinker_sequence
    make = omni_seqs(Qwen3OmniInputProcessor, thinker_sequence)
    make.path = tiny_qwen3_omni_dir
    ref = run_stage(tiny_qwen3_omni_dir, "qwen3_omni", "thinker", 1, make, record_router=True,
                    quantization="fp8")
    got = run_stage(tiny_qwen3_omni_dir, "qwen3_omni", "thinker", 2, make, record_router=True,
                    quantization="fp8")
    assert ref["fp8_experts"] == got["fp8_experts"] > 0
    assert_router_close(ref, got, first_divergence(ref, got))
    assert torch.isfinite(torch.tensor([lp for r in got["logprobs"].values()
                                        for step in r for lp in step.values()])).all()
