"""Tensor parallelism of the Qwen2.5-Omni talker (CPU, gloo): TP=2 and TP=4 give TP=1's codes
on the tiny checkpoint (near-tie rule, tests/engine/test_tensor_parallel.py), every rank holding
1/TP of each sharded parameter (the codec embedding and head split over the codec vocabulary)
and of the KV cache. The talker's inputs are the thinker's rows: seeded random rows of the
talker's embedding width, given to the handoff adapter as the thinker would (prompt rows,
reply rows, the three special rows), so prompt steps carry replacement rows and decode steps
additive rows through the step messages."""

from __future__ import annotations

import pytest
import torch

from omnistage.checkpoint import load_config
from omnistage.engine.ar.sequence import Sequence
from tests.engine.test_tensor_parallel import assert_shares, first_divergence, greedy, run_stage

REPLY_ROWS = 4  # the thinker's reply: then <|tts_eos|>, then <|tts_pad|> rows


def talker_seqs(path):
    def make(worker) -> list[Sequence]:
        from omnistage.models.qwen2_5_omni.processor import Qwen2_5OmniInputProcessor
        from omnistage.models.qwen2_5_omni.talker import (Qwen2_5OmniThinkerToTalker,
                                                          ThinkerRows, talker_sequence,
                                                          talker_token_ids)
        from omnistage.models.qwen2_5_omni.thinker import thinker_sequence
        from omnistage.testing.tiny_omni import tiny_omni_test_messages
        cfg = load_config(path)["talker_config"]
        codec_ids, text_ids = talker_token_ids(cfg)
        width = cfg["embedding_size"]
        proc = Qwen2_5OmniInputProcessor.from_pretrained(path)
        msgs = tiny_omni_test_messages()
        g = torch.Generator().manual_seed(0)
        seqs = []
        for case in ("text_only", "audio_text"):
            thinker = thinker_sequence(case, proc.process(msgs[case]), greedy(), 3)
            P = thinker.num_prompt_tokens
            adapter = Qwen2_5OmniThinkerToTalker(
                list(thinker.prompt_token_ids), [(m.start, m.end) for m in thinker.media],
                speaker_bos_id=0, text_ids=text_ids)
            rows = torch.randn(P + REPLY_ROWS, width, generator=g)
            specials = torch.randn(3, width, generator=g)
            adapter.receive(case, ThinkerRows(0, rows.to(worker.engine.runner.device),
                                              specials.to(worker.engine.runner.device), True),
                            worker)
            seqs.append(talker_sequence(f"talker-{case}", thinker, adapter, codec_ids,
                                        greedy(), 3))
        return seqs
    return make


@pytest.fixture(scope="module")
def talker_ref(tiny_omni_dir):
    return run_stage(tiny_omni_dir, "qwen2_5_omni", "talker", 1, talker_seqs(tiny_omni_dir))


@pytest.mark.parametrize("tp", [2, 4])
def test_qwen2_5_omni_talker_tp_matches_tp1(tiny_omni_dir, talker_ref, tp):
    got = run_stage(tiny_omni_dir, "qwen2_5_omni", "talker", tp, talker_seqs(tiny_omni_dir))
    first_divergence(talker_ref, got)
    assert_shares(talker_ref, got, tp)
    assert all(len(t) == 6 for t in got["tokens"].values())
    shapes = got["reports"][1].param_shapes
    assert shapes["codec_head.weight"] == (128 // tp, 32)  # codec vocabulary 128, hidden 32
    assert shapes["model.embed_tokens.weight"] == (128 // tp, 64)  # embedding_size 64


def test_qwen2_5_omni_talker_tp_graph_path(tiny_omni_dir, talker_ref):
    """The decode graphs' path (uncaptured on CPU): graph step messages carrying the
    additive thinker rows, steps launched ahead."""
    got = run_stage(tiny_omni_dir, "qwen2_5_omni", "talker", 2, talker_seqs(tiny_omni_dir),
                    graphs="eager")
    first_divergence(talker_ref, got)
    assert got["graph_forwards"] and got["ahead"] > 0


def test_pipeline_with_tp2_talker_equals_tp1(tiny_omni_dir, tmp_path):
    """The whole Qwen2.5-Omni pipeline (OmniLLM, pipeline YAML) with its talker at
    tensor_parallel_size 2 on the CPU: the thinker's tokens, the talker's greedy codes (near-tie
    rule) and the audio of the one-rank talker's pipeline."""
    import numpy as np
    import yaml

    from omnistage import OmniLLM
    from omnistage.config.schema import load_pipeline
    from omnistage.sampling_params import SamplingParams
    from omnistage.testing.tiny_omni import TINY_TALKER_EOS, tiny_omni_test_messages
    data = load_pipeline("qwen2_5_omni").model_dump(mode="json", exclude_defaults=True)
    data["stages"][1].update(tensor_parallel_size=2, devices=["cpu", "cpu"])
    path = tmp_path / "talker_tp2.yaml"
    path.write_text(yaml.safe_dump(data))
    msgs = tiny_omni_test_messages()
    prompts = [{"messages": msgs[k]} for k in ("text_only", "audio_text")]
    params = [{"thinker": SamplingParams(temperature=0.8, top_k=50, max_tokens=8, min_tokens=8,
                                         seed=i),
               "talker": SamplingParams(temperature=0, max_tokens=24, min_tokens=24,
                                        stop_token_ids=TINY_TALKER_EOS, suppress_token_ids=[121],
                                        logprobs=2)}
              for i in range(len(prompts))]
    runs = []
    for pipeline in (None, str(path)):
        with OmniLLM(str(tiny_omni_dir), device="cpu", pipeline=pipeline) as llm:
            if pipeline is not None:
                assert llm.pipeline.engines["talker"].runner.tp.size == 2
            runs.append(llm.generate(prompts, params, use_tqdm=False))
    for a, b in zip(*runs, strict=True):
        assert a.error is None and b.error is None, (a.error, b.error)
        assert b.token_ids == a.token_ids  # the thinker: one rank in both
        ta, tb = a.stages["talker"], b.stages["talker"]
        diverged = first_divergence({"tokens": {0: ta.token_ids}, "logprobs": {0: ta.logprobs}},
                                    {"tokens": {0: tb.token_ids}, "logprobs": {0: tb.logprobs}})
        assert len(ta.token_ids) == 24
        if diverged[0] is None:  # the same codes: the same audio
            assert b.audio.shape == a.audio.shape and float(np.abs(a.audio).max()) > 1e-3
            assert np.abs(b.audio - a.audio).max() < 1e-4
