"""The whole Qwen3-Omni pipeline (thinker -> talker with its code predictor -> streaming
code2wav) against transformers' Qwen3OmniMoeForConditionalGeneration.generate, tiny random
checkpoint in the released layout, fp32, CPU: greedy thinker tokens, all 16 codebooks and the
waveform, for each prompt layout alone and in one mixed batch.

transformers gets exactly our processed inputs (ids, audio features, pixels, grids): the
processor's own parity with transformers' processor is test_processor.py's."""

from __future__ import annotations

import logging
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from omnistage import OmniLLM, SamplingParams
from omnistage.testing.tiny_qwen3_omni import TINY_QWEN3_OMNI_EOS, enable_talker_audio_prompts

log = logging.getLogger(__name__)
THINKER_MAX, TALKER_MAX = 10, 40
CASES = ["text", "audio_text", "image_text", "audio_image_text", "video", "multi_turn"]


def _media() -> dict:
    rng = np.random.default_rng(0)
    sr = 16000
    tone = (0.3 * np.sin(2 * np.pi * 220 * np.arange(int(2.5 * sr)) / sr)
            + 0.05 * rng.standard_normal(int(2.5 * sr))).astype(np.float32)
    noise = (0.2 * rng.standard_normal(9000)).astype(np.float32)
    img = Image.fromarray(rng.integers(0, 255, (64, 96, 3), dtype=np.uint8))
    frames = rng.integers(0, 255, (4, 64, 64, 3), dtype=np.uint8)
    return {"tone": tone, "noise": noise, "img": img, "frames": frames}


def messages(case: str) -> list[dict]:
    m = _media()

    def user(*parts: dict) -> dict:
        return {"role": "user", "content": list(parts)}

    text = {"type": "text", "text": "What is this? Tell me."}
    audio = {"type": "audio", "audio": m["tone"]}
    image = {"type": "image", "image": m["img"]}
    return {
        "text": [user({"type": "text", "text": "Beautiful is better than ugly. Say more."})],
        "audio_text": [user(audio, text)],
        "image_text": [user(image, text)],
        "audio_image_text": [user(audio, image, text)],
        "video": [user({"type": "video", "video": m["frames"]}, text)],
        # the talker reads user turns only: system and earlier assistant turns are dropped
        "multi_turn": [{"role": "system", "content": "Be brief."},
                       user({"type": "audio", "audio": m["noise"]}, {"type": "text",
                                                                      "text": "Listen."}),
                       {"role": "assistant", "content": "Static."},
                       user(image, text)],
    }[case]


def greedy(talker_max: int = TALKER_MAX) -> dict[str, SamplingParams]:
    return {"thinker": SamplingParams(temperature=0, max_tokens=THINKER_MAX),
            "talker": SamplingParams(temperature=0, repetition_penalty=1.05,
                                     max_tokens=talker_max)}


class HFReference:
    """transformers' generate on our processed inputs, its code2wav input captured."""

    def __init__(self, path) -> None:
        from transformers import Qwen3OmniMoeForConditionalGeneration

        from omnistage.checkpoint import quiet_transformers
        with quiet_transformers():
            self.model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
                str(path), dtype=torch.float32).eval()
        enable_talker_audio_prompts(self.model)
        self.codes: list[torch.Tensor] = []
        decode = self.model.code2wav.chunked_decode

        def capture(codes, *args, **kwargs):
            self.codes.append(codes.clone())
            return decode(codes, *args, **kwargs)
        self.model.code2wav.chunked_decode = capture

    @staticmethod
    def inputs(processed) -> dict:
        p = processed
        kw: dict = {"input_ids": torch.tensor([p.input_ids])}
        if p.audio_features:
            frames = [f.shape[-1] for f in p.audio_features]
            feats = torch.zeros(len(frames), 128, max(frames))
            mask = torch.zeros(len(frames), max(frames), dtype=torch.long)
            for i, f in enumerate(p.audio_features):
                feats[i, :, :f.shape[-1]], mask[i, :f.shape[-1]] = f, 1
            kw.update(input_features=feats, feature_attention_mask=mask)
        if p.image_pixel_values is not None:
            kw.update(pixel_values=p.image_pixel_values, image_grid_thw=p.image_grid_thw)
        if p.video_pixel_values is not None:
            kw.update(pixel_values_videos=p.video_pixel_values, video_grid_thw=p.video_grid_thw,
                      video_second_per_grid=p.video_second_per_grid)
        kw["use_audio_in_video"] = p.use_audio_in_video
        return kw

    @torch.no_grad()
    def generate(self, processed, voice: str = "Ethan", talker_max: int = TALKER_MAX):
        kw = self.inputs(processed)
        self.codes.clear()
        with warnings.catch_warnings():  # its talker's repetition penalty note
            warnings.simplefilter("ignore", UserWarning)
            seqs, wav = self.model.generate(
                **kw, speaker=voice, thinker_eos_token_id=TINY_QWEN3_OMNI_EOS,
                thinker_max_new_tokens=THINKER_MAX, thinker_do_sample=False,
                talker_do_sample=False, talker_max_new_tokens=talker_max)
        P = kw["input_ids"].shape[1]
        codes = self.codes[0][0].T if self.codes else torch.zeros(0, 16, dtype=torch.long)
        return seqs[0, P:].tolist(), codes, wav.reshape(-1)


@pytest.fixture(scope="module")
def hf(tiny_qwen3_omni_dir):
    return HFReference(tiny_qwen3_omni_dir)


@pytest.fixture(scope="module")
def llm(tiny_qwen3_omni_dir):
    return OmniLLM(str(tiny_qwen3_omni_dir), device="cpu")


def processed(llm, messages_: list[dict]):
    return llm.pipeline.processor.process(messages_, add_audio_system_prompt=True)


def check_equal(out, ref, label: str) -> None:
    text_ids, ref_codes, ref_wav = ref
    assert out.error is None, out.error
    assert len(set(text_ids)) > 1, f"{label}: degenerate reference text {text_ids}"
    assert out.token_ids == text_ids, label
    codes = out.stages["talker"].codes
    assert ref_codes.shape[0] > 4 and ref_codes.unique().numel() > 16, label
    assert codes.shape == tuple(ref_codes.shape), label
    assert np.array_equal(codes, ref_codes.numpy()), f"{label}: codes differ"
    assert out.stages["talker"].token_ids[:len(codes)] == codes[:, 0].tolist()
    assert float(ref_wav.pow(2).mean().sqrt()) >= 0.01, f"{label}: silent reference"
    assert out.audio.shape == tuple(ref_wav.shape), label
    assert np.abs(out.audio - ref_wav.numpy()).max() < 1e-4, label


@pytest.mark.parametrize("case", CASES)
def test_tokens_codes_and_waveform_equal_transformers(hf, llm, case):
    msgs = messages(case)
    ref = hf.generate(processed(llm, msgs))
    out = llm.generate({"messages": msgs}, greedy(), use_tqdm=False)[0]
    check_equal(out, ref, case)


def test_video_with_its_audio_track_equals_transformers(hf, llm):
    """use_audio_in_video: the clip's soundtrack interleaved with its frames by time."""
    from tests.models.qwen2_5_omni.test_video import _frames, mux
    sr = 22050
    t = np.arange(3 * sr) / sr
    track = (0.3 * np.sin(2 * np.pi * 330 * t) * (1 + np.sin(2 * np.pi * 2 * t))).astype(
        np.float32)
    clip = mux(_frames(12, seed=1), track, sr=sr)
    msgs = [{"role": "user", "content": [{"type": "video", "video": clip},
                                         {"type": "text", "text": "What happens here?"}]}]
    proc = llm.pipeline.processor.process(msgs, add_audio_system_prompt=True,
                                          use_audio_in_video=True)
    assert proc.use_audio_in_video and len(proc.audio_features) == 1
    ref = hf.generate(proc)
    out = llm.generate({"messages": msgs, "use_audio_in_video": True}, greedy(),
                       use_tqdm=False)[0]
    check_equal(out, ref, "video_audio")


def test_mixed_batch_equals_transformers(hf, llm):
    names = CASES + ["text", "audio_text"]
    voices = ["Ethan", "chelsie", "AIDEN"] * 3
    lengths = [TALKER_MAX, 25, TALKER_MAX, 30, TALKER_MAX, 20, 33, TALKER_MAX]
    prompts = [{"messages": messages(n), "voice": v} for n, v in zip(names, voices)]
    outs = llm.generate(prompts, [greedy(n) for n in lengths], use_tqdm=False)
    assert llm.pipeline.code2wav.max_batch_seen > 1  # several utterances per code2wav step
    for name, voice, n, out in zip(names, voices, lengths, outs):
        ref = hf.generate(processed(llm, messages(name)), voice=voice, talker_max=n)
        check_equal(out, ref, f"{name}/{voice}")


def test_streamed_audio_equals_whole(tiny_qwen3_omni_dir, llm):
    """The async API's audio chunks (code2wav's stateful chunks, first chunk small) concatenate
    to the one-call result; several chunks arrive before the talker is done."""
    import asyncio

    from omnistage import AsyncOmniLLM

    prompt = {"messages": messages("audio_text")}
    params = greedy(60)
    allm = AsyncOmniLLM(str(tiny_qwen3_omni_dir), device="cpu")

    async def main():
        return [out async for out in allm.generate(prompt, params)]
    try:
        outs = asyncio.run(main())
    finally:
        allm.shutdown()
    chunks = [o.audio for o in outs if o.audio is not None and len(o.audio)]
    assert len(chunks) >= 3
    whole = llm.generate(prompt, params, use_tqdm=False)[0]
    streamed = np.concatenate(chunks)
    assert streamed.shape == whole.audio.shape
    assert np.abs(streamed - whole.audio).max() < 1e-5
    assert outs[-1].finished and outs[-1].error is None


def test_speakers_matched_case_insensitively_and_change_the_codes(llm):
    msgs = {"messages": messages("text")}
    outs = llm.generate([dict(msgs, voice=v) for v in ("Ethan", "ETHAN", "chelsie")],
                        greedy(), use_tqdm=False)
    codes = [o.stages["talker"].codes for o in outs]
    assert np.array_equal(codes[0], codes[1])
    assert not np.array_equal(codes[0], codes[2])
    with pytest.raises(ValueError, match=r"prompts\[0\]\.voice"):
        llm.generate(dict(msgs, voice="Nobody"), greedy(), use_tqdm=False)


def test_text_output_only_skips_the_talker(llm):
    out = llm.generate({"messages": messages("audio_text")}, greedy(),
                       output_modalities=["text"], use_tqdm=False)[0]
    assert out.audio is None and "talker" not in out.stages and len(out.token_ids) > 0


def test_sampled_talker_is_seeded(llm):
    """Sampling (transformers' talker defaults, the code predictor's top-k/top-p) is a pure
    function of the request seed: equal per seed, different across seeds."""
    msgs = {"messages": messages("text")}
    base = {"thinker": SamplingParams(temperature=0, max_tokens=THINKER_MAX)}
    a, b, c = llm.generate([msgs] * 3, [dict(base, talker=SamplingParams(
        temperature=0.9, top_k=50, repetition_penalty=1.05, max_tokens=30, seed=s))
        for s in (1, 1, 2)], use_tqdm=False)
    assert np.array_equal(a.stages["talker"].codes, b.stages["talker"].codes)
    assert not np.array_equal(a.stages["talker"].codes, c.stages["talker"].codes)
    codes = a.stages["talker"].codes
    assert codes.shape[1] == 16 and codes.max() < 2048


def test_thinking_checkpoint_serves_text_only(tiny_qwen3_omni_thinking_dir, tiny_qwen3_omni_dir):
    llm = OmniLLM(str(tiny_qwen3_omni_thinking_dir), device="cpu")
    assert llm.stage_names == ["thinker"]
    out = llm.generate({"messages": messages("image_text")},
                       SamplingParams(temperature=0, max_tokens=THINKER_MAX), use_tqdm=False)[0]
    assert out.audio is None and len(out.token_ids) > 0
    with pytest.raises(ValueError, match="audio"):
        llm.generate({"messages": messages("text")}, output_modalities=["text", "audio"],
                     use_tqdm=False)


def test_dummy_weights_and_fp8_experts(tiny_qwen3_omni_dir, tiny_omni_dir):
    """load_format="dummy" (seeded random weights, no safetensors read) and quantization="fp8"
    (MoE experts in e4m3): the pipeline runs; dummy weights are the same each time; FP8
    experts stay close to the bf16/fp32 ones on the same weights."""
    from omnistage.layers.moe import SparseMoE

    params = {"thinker": SamplingParams(temperature=0, max_tokens=6, min_tokens=6,
                                        ignore_eos=True),
              "talker": SamplingParams(temperature=0, max_tokens=10, min_tokens=10)}
    prompt = {"messages": messages("text")}
    outs = []
    for quantization in (None, None, "fp8"):
        llm = OmniLLM(str(tiny_qwen3_omni_dir), device="cpu", load_format="dummy",
                      quantization=quantization)
        moe = [m for m in llm.pipeline.thinker.modules() if isinstance(m, SparseMoE)]
        assert moe and all(m.experts.is_fp8 == (quantization == "fp8") for m in moe)
        outs.append(llm.generate(prompt, params, use_tqdm=False)[0])
        assert outs[-1].error is None and outs[-1].stages["talker"].codes.shape == (9, 16)
    assert outs[0].token_ids == outs[1].token_ids
    assert np.array_equal(outs[0].audio, outs[1].audio)
    with pytest.raises(ValueError, match="load_format"):
        OmniLLM(str(tiny_qwen3_omni_dir), device="cpu", load_format="npz")
    with pytest.raises(ValueError, match="quantization"):
        OmniLLM(str(tiny_omni_dir), device="cpu", quantization="int4")


def test_graph_decode_path_equals_transformers(hf, tiny_qwen3_omni_dir):
    """The decode-graph path (cuda_graphs="eager": the CUDA-graph code, uncaptured, on CPU),
    where the code predictor's inner loop runs inside the head graph: still exact."""
    llm = OmniLLM(str(tiny_qwen3_omni_dir), device="cpu", cuda_graphs="eager",
                  async_scheduling=False)
    cases = ["audio_text", "text"]
    outs = llm.generate([{"messages": messages(c)} for c in cases], greedy(), use_tqdm=False)
    graphs = llm.pipeline.engines["talker"].runner.graphs
    assert graphs is not None and graphs.residual and graphs.num_runs > 10
    assert all(graphs.residual_ran)  # the head drew codebooks 1.. (no eager fallback)
    for case, out in zip(cases, outs):
        check_equal(out, hf.generate(processed(llm, messages(case))), f"graphs/{case}")


def test_stage_processes_equal_in_process(tiny_qwen3_omni_dir, llm):
    """Every stage in a process of its own (rows, frames and the adapters cross processes):
    the same tokens, codes and audio as in-process."""
    prompt = {"messages": messages("audio_text"), "voice": "Aiden"}
    alone = llm.generate(prompt, greedy(), use_tqdm=False)[0]
    procs = OmniLLM(str(tiny_qwen3_omni_dir), device="cpu", stage_worker="process")
    try:
        out = procs.generate(prompt, greedy(), use_tqdm=False)[0]
    finally:
        procs.shutdown()
    assert out.error is None and out.token_ids == alone.token_ids
    assert np.array_equal(out.stages["talker"].codes, alone.stages["talker"].codes)
    assert out.audio.shape == alone.audio.shape and np.abs(out.audio - alone.audio).max() == 0
