"""bf16 thinker logits at Qwen2.5-Omni-7B widths on the GPU: omnistage's engine (chunked prefill
over a paged prefix, then batched decode steps in CUDA graphs) against transformers' thinker
forward on the same random weights, teacher-forced over 4 x (160 + 48 - 1) = 828 positions.

NOTE: by default the thinker keeps 4 of its 28 decoder layers (all widths, vocab, encoders as in
the 7B model) so the test builds in seconds; OMNISTAGE_BF16_LAYERS=28 checks the whole thinker
(~1 min to build on an H100, ~50 GB). The benchmark's --hf-only run reports the same numbers
for all 28 layers in its "bf16_logits" section."""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks.hf_omni_gpu import (build_hf_model, build_stage, copy_into_hf, id_range,
                                    omni_config, thinker_logit_parity, with_thinker_layers)

MIN_TOP1 = 0.99


@pytest.mark.gpu
def test_bf16_thinker_logits_match_transformers():
    layers = int(os.environ.get("OMNISTAGE_BF16_LAYERS", "4"))
    cfg = with_thinker_layers(omni_config(tiny=False), layers)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    hf = build_hf_model(cfg, dev, dtype, thinker_only=True)
    thinker = build_stage("thinker", cfg, dev, dtype)
    copy_into_hf(hf, thinker, "thinker")
    r = thinker_logit_parity(thinker, hf, dev, dtype, id_range(thinker.vocab_size, tiny=False))
    print(r)
    native, fp32 = r["native_head"], r["fp32_head"]
    assert r["positions"] >= 512
    assert native["ref_logit_std"] > 0.1  # non-trivial logits
    # NOTE: random weights give flat logits; ~4% of positions have their top two rounded to the
    # same bf16 value (a coin flip for any two implementations), so the >= 99% target applies
    # to the decoder stack's output through an fp32 head and to the positions without a tie.
    # NOTE: raw top-1 agreement is not asserted: random weights give flat logits (std ~0.58)
    # and on the H100 ~2-7% of positions have a top-2 gap below bf16 resolution (0.0 in bf16),
    # where any two implementations break the tie differently (measured: native 93.2%, fp32
    # head 97.6%; 99.9% / 100% on the other positions)
    assert fp32["top1_agreement_clear"] >= MIN_TOP1, r
    assert native["top1_agreement_clear"] >= MIN_TOP1, r
    assert native["mean_abs_logit_diff"] < 0.05 * native["ref_logit_std"], r
    # the rows the engine exported are the ones it sampled from (graph logits vs a recompute)
    assert r["greedy_self_consistency"] >= 0.95, r
