"""CPU smoke test of benchmarks/qwen3_omni_gpu.py: `--small` runs our engine and transformers'
reference through the script's own code on a tiny config with the real vocabularies and ids;
both are built from the same dummy weights, so their greedy text must agree. The real-size
config must describe Qwen3-Omni-30B-A3B (35.3 B parameters in transformers' own model)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import qwen3_omni_gpu as bench

SAMPLES_PER_FRAME, FIRST_CHUNK_TRIM = 1920, 555  # code2wav at 24 kHz, 12.5 Hz frames


def audio_s(frames: int) -> float:
    return (frames * SAMPLES_PER_FRAME - FIRST_CHUNK_TRIM) / bench.SR


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    res = bench.main(["--small", "--ckpt", str(out / "ckpt"), "--concurrency", "1,2",
                      "--text-tokens", "6", "--frames", "10", "--warmup-text-tokens", "2",
                      "--warmup-frames", "5", "--out", str(out / "ours.json")])
    return res, json.loads((out / "ours.json").read_text())


def test_small_run_reports_every_metric(ours):
    res, saved = ours
    assert saved["summary"] == res["summary"] and saved["runs"].keys() == {"c1", "c2"}
    assert res["engine_options"] == {"load_format": "dummy", "quantization": None}
    assert res["engine_defaults"]["thinker"]["max_num_seqs"] == 64
    assert res["tokenizer"].startswith(("placeholder", "real"))
    for name, c in (("c1", 1), ("c2", 2)):
        run = res["runs"][name]
        assert run["concurrency"] == c and run["per_request_text_tokens"] == 6
        assert run["per_request_audio_s"] == pytest.approx(audio_s(10), abs=1e-3)
        assert run["audio_s_per_s"] > 0 and 0 < run["ttft"]["p50"] <= run["ttfa"]["p50"]
        assert run["ttfa"]["p50"] < run["e2e"]["p50"]
        assert run["rtf"]["p50"] == pytest.approx(run["e2e"]["p50"] / audio_s(10), rel=0.2)
        assert run["stages"]["talker"]["steps"] >= 10 and run["stages"]["code2wav"]["steps"] > 0
    decode = res["thinker_decode_bs1"]
    assert decode["text_tokens"] == 6 and decode["ms_per_token"] > 0
    load = res["checkpoint_load"]
    assert load["part"] == "talker" and load["GB"] > 0 and load["disk_GB_per_s"] > 0
    assert res["load_s"] > 0 and res["summary"]["c1"]["rtf_p50"] > 0


def test_reference_gets_the_same_weights(ours):
    """transformers on the script's dummy weights greedily writes the text our c1 request
    wrote: the weights are the same (a different seed or a misnamed tensor changes it)."""
    text = ours[0]["runs"]["c1"]["first_request_text_ids"]
    assert len(text) == 6 and len(set(text)) > 1
    ref = bench.main(["--small", "--reference", "transformers", "--text-tokens", "128",
                      "--frames", "256", "--ref-text-tokens", "6", "--ref-frames", "3"])
    r = ref["reference"]
    assert r["text_ids"] == text
    assert r["tensors"] > 300 and r["batch1"]["text_tokens"] == 6
    assert r["batch1"]["audio_s_total"] == pytest.approx(audio_s(3), abs=0.01)  # (rounded)
    scaled = r["scaled_to_workload"]
    assert scaled["frames"] == 256 and scaled["e2e_s"] > r["batch1"]["e2e_s"]
    assert scaled["rtf"] == pytest.approx(scaled["e2e_s"] / (256 * bench.FRAME_S), rel=0.01)


def test_fp8_experts_run(tmp_path):
    res = bench.main(["--small", "--fp8", "--ckpt", str(tmp_path / "ckpt"), "--concurrency", "1",
                      "--text-tokens", "3", "--frames", "4", "--warmup-text-tokens", "2",
                      "--warmup-frames", "2", "--load-part", "none"])
    assert res["engine_options"]["quantization"] == "fp8" and "checkpoint_load" not in res
    assert res["runs"]["c1"]["per_request_audio_s"] == pytest.approx(audio_s(4), abs=1e-3)


def test_real_config_is_qwen3_omni_30b_a3b():
    """The full-size config in transformers' own model (on the meta device: no memory)."""
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    from omnistage.checkpoint import quiet_transformers
    tok, _ = bench.bench_tokenizer()
    with quiet_transformers(), torch.device("meta"):
        hf = Qwen3OmniMoeForConditionalGeneration._from_config(
            Qwen3OmniMoeConfig(**bench.config_kwargs(tok, small=False)))
    counts = {part: sum(p.numel() for p in getattr(hf, part).parameters())
              for part in ("thinker", "talker", "code2wav")}
    assert sum(counts.values()) == pytest.approx(35.26e9, rel=0.01), counts
    text = hf.thinker.model.language_model
    assert len(text.layers) == 48 and text.embed_tokens.weight.shape == (152064, 2048)
    assert text.layers[0].mlp.experts.gate_up_proj.shape == (128, 2 * 768, 2048)
    assert hf.talker.model.layers[0].mlp.experts.gate_up_proj.shape == (128, 2 * 384, 1024)
    assert len(hf.talker.code_predictor.model.layers) == 5
    assert len(hf.thinker.model.audio_tower.layers) == 32
    assert len(hf.thinker.model.visual.blocks) == 27


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="--frames"):
        bench.main(["--small", "--frames", "0"])
    with pytest.raises(ValueError, match="--load-part"):
        bench.main(["--small", "--load-part", "thinker"])
    with pytest.raises(ValueError, match="--fp8"):
        bench.main(["--small", "--fp8", "--reference", "transformers"])
