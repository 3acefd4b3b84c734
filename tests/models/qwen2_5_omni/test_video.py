"""Video input (with and without its audio track) against transformers' Qwen2.5-Omni, tiny
checkpoint, fp32, CPU.

transformers' video processor needs torchvision, which does not import beside torch 2.13 CPU:
our preprocessing is compared with transformers' Qwen2VLVideoProcessor where torchvision
imports, and everywhere with transformers' Qwen2-VL image processor applied per frame pair
(`build_tiny_omni_video_processor`). transformers cannot decode files here (no torchcodec), so
its processor gets the frames and audio track that we decoded; the decoding itself is checked
against the source of a losslessly encoded clip."""

from __future__ import annotations

import fractions
import io
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from PIL import Image

from omnistage import OmniLLM
from omnistage.models.qwen2_5_omni.media import load_audio
from omnistage.models.qwen2_5_omni.processor import Qwen2_5OmniInputProcessor
from omnistage.models.qwen2_5_omni.rope_index import audio_tokens_for_frames, mrope_positions
from omnistage.models.qwen2_5_omni.video import (Qwen2_5OmniVideoConfig, load_video,
                                                 preprocess_video, sample_frame_indices)
from omnistage.testing.tiny_omni import (TINY_OMNI_IDS, _TinyOmniFrameVideoProcessor,
                                         build_tiny_omni_video_processor)
from tests.models.qwen2_5_omni.test_talker import HFReference, assert_codes_match, greedy_params
from tests.models.qwen2_5_omni.test_thinker import GREEDY, TEXT_OUT, near_tie_ok

av = pytest.importorskip("av", reason="video decoding needs PyAV (pip install av)")
FPS, SECONDS, SIZE = 4, 3.0, 56  # 12 frames -> 6 sampled at 2 fps -> grid [3, 24, 24]


def _frames(n: int, seed: int, h: int = SIZE, w: int = SIZE) -> np.ndarray:
    # smooth moving gradients plus a little noise: non-trivial, and compressible
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    out = [np.stack([(xx * 4 + 9 * t) % 256, (yy * 4 + 5 * t) % 256,
                     ((xx + yy) * 2 + 20 * t) % 256], -1) for t in range(n)]
    return np.clip(np.array(out) + rng.integers(-8, 8, (n, h, w, 3)), 0, 255).astype(np.uint8)


def mux(frames: np.ndarray | None, audio: np.ndarray | None = None, sr: int = 22050,
        vcodec: str = "ffv1") -> bytes:
    """A Matroska clip: frames at FPS (ffv1 lossless) + a 16-bit PCM mono track."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska") as box:
        if frames is not None:
            vs = box.add_stream(vcodec, rate=FPS)
            vs.width, vs.height = frames.shape[2], frames.shape[1]
            vs.pix_fmt = "bgr0" if vcodec == "ffv1" else "yuv420p"
        if audio is not None:
            ast = box.add_stream("pcm_s16le", rate=sr)
            ast.layout = "mono"
            pcm = np.clip(np.round(audio * 32768), -32768, 32767).astype(np.int16)
            for i in range(0, len(pcm), 1024):
                f = av.AudioFrame.from_ndarray(pcm[None, i:i + 1024], format="s16", layout="mono")
                f.sample_rate, f.pts, f.time_base = sr, i, fractions.Fraction(1, sr)
                box.mux(ast.encode(f))
            box.mux(ast.encode())
        for fr in [] if frames is None else frames:
            box.mux(vs.encode(av.VideoFrame.from_ndarray(fr, format="rgb24")))
        if frames is not None:
            box.mux(vs.encode())
    return buf.getvalue()


@pytest.fixture(scope="module")
def speech() -> tuple[np.ndarray, int]:
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (apt-get install -y espeak-ng)")
    wav = subprocess.run(["espeak-ng", "--stdout", "Hello, this is a short video with sound."],
                         check=True, capture_output=True).stdout
    x, sr = sf.read(io.BytesIO(wav), dtype="float32")
    n = int(SECONDS * sr)
    x = np.pad(x, (0, max(0, n - len(x))))[:n]
    return (np.round(x * 32767) / 32768).astype(np.float32), sr  # exact in 16-bit PCM


@pytest.fixture(scope="module")
def clip(speech) -> dict:
    frames = _frames(int(SECONDS * FPS), seed=1)
    return {"frames": frames, "bytes": mux(frames, *speech), "silent": mux(frames)}


# ------------------------------------------------------------------------------ preprocessing


@pytest.mark.parametrize("shape", [(6, 56, 56), (5, 56, 84), (4, 100, 70), (1, 30, 200),
                                   (3, 420, 644)])
def test_preprocess_equals_image_processor_per_frame_pair(shape):
    frames = np.random.default_rng(0).integers(0, 256, (*shape, 3), dtype=np.uint8)
    got, grid = preprocess_video(frames, Qwen2_5OmniVideoConfig())
    want = _TinyOmniFrameVideoProcessor()([frames])
    assert got.abs().max() > 1.0 and got.std() > 0.3
    assert want["video_grid_thw"].tolist() == [grid]
    assert (got - want["pixel_values_videos"]).abs().max() <= 2e-6


def test_preprocess_equals_transformers_video_processor():
    vp_mod = pytest.importorskip(
        "transformers.models.qwen2_vl.video_processing_qwen2_vl",
        reason="transformers' video processor needs torchvision (absent beside torch 2.13 CPU)",
        exc_type=ImportError)
    vp = vp_mod.Qwen2VLVideoProcessor(cap_pixels_per_frame=True)
    rng = np.random.default_rng(0)
    for shape in [(6, 56, 56), (5, 56, 84), (3, 30, 200), (8, 720, 1280)]:
        frames = rng.integers(0, 256, (*shape, 3), dtype=np.uint8)
        want = vp(videos=[frames], return_tensors="pt")
        got, grid = preprocess_video(frames, Qwen2_5OmniVideoConfig())
        assert want["video_grid_thw"].tolist() == [grid]
        assert torch.equal(got, want["pixel_values_videos"])


def test_frame_sampling_follows_qwen():
    assert sample_frame_indices(12, 4.0).tolist() == [0, 2, 4, 7, 9, 11]  # 2 fps
    assert len(sample_frame_indices(300, 30.0)) == 20
    assert sample_frame_indices(3, 30.0).tolist() == [0, 2]  # min 4 frames, but only 3: 2
    assert len(sample_frame_indices(5, 30.0)) == 4  # at least 4 frames
    assert len(sample_frame_indices(100_000, 30.0)) == 768  # at most 768
    assert len(sample_frame_indices(100_000, 30.0, max_frames=31)) == 30  # even counts


def test_decoding_gives_source_frames_and_audio_track(clip, speech):
    video = load_video(clip["bytes"], "v", with_audio=True)
    assert np.array_equal(video.frames, clip["frames"][[0, 2, 4, 7, 9, 11]])  # lossless
    assert video.fps == 2.0 and video.second_per_grid(2) == 1.0
    want = load_audio(speech, "a").samples  # same samples, same 16 kHz resampler
    assert video.audio.shape == want.shape == (int(SECONDS * 16000),)
    assert np.abs(want).max() > 0.1 and np.abs(video.audio - want).max() < 1e-6
    h264 = load_video(mux(clip["frames"], vcodec="libx264"), "v")
    assert h264.audio is None and h264.frames.shape == video.frames.shape
    assert np.abs(h264.frames.astype(int) - video.frames).mean() < 8  # lossy, but the same
    assert load_video(clip["bytes"], "v").content_hash != video.content_hash  # audio is keyed
    assert load_video(clip["frames"], "v", fps=4).content_hash != \
        load_video(clip["frames"], "v").content_hash  # fps sets the positions: keyed too


# ------------------------------------------------------------------------------ prompts


def _user(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def cases(clip, speech) -> dict[str, dict]:
    """name -> our prompt + what transformers' processor gets (our decoded media)."""
    tone = (0.3 * np.sin(np.arange(24000) / 16000 * 2 * np.pi * 220)).astype(np.float32)
    img = _frames(1, seed=5, h=56, w=84)[0]
    frames = _frames(4, seed=2)
    sampled = clip["frames"][[0, 2, 4, 7, 9, 11]]
    track = load_audio(speech, "a").samples
    text = {"type": "text", "text": "What happens here?"}
    return {
        "video_only": dict(messages=_user({"type": "video", "video": frames}), av=False,
                           videos=[frames], audio=None, slots=None),
        "video_text": dict(messages=_user({"type": "video", "video": clip["silent"]}, text),
                           av=False, videos=[sampled], audio=None, slots=None),
        "video_audio": dict(messages=_user({"type": "video", "video": clip["bytes"]}, text),
                            av=True, videos=[sampled], audio=[track], slots=[0]),
        "video_image_audio": dict(
            messages=_user({"type": "audio", "audio": tone},
                           {"type": "image", "image": Image.fromarray(img)},
                           {"type": "video", "video": clip["bytes"]}, text),
            av=True, videos=[sampled], audio=[tone, track], slots=[None, 0]),
    }


CASES = ["video_only", "video_text", "video_audio", "video_image_audio"]


def hf_inputs(proc, case: dict) -> dict:
    text = proc.apply_chat_template(case["messages"], add_generation_prompt=True,
                                     tokenize=False)
    kw = dict(text=text, videos=case["videos"], return_tensors="pt", fps=2.0)
    if case["audio"] is not None:
        kw.update(audio=case["audio"])
    if case["av"]:
        kw.update(load_audio_from_video=True, audio_from_video_indices=case["slots"])
    imgs = [p["image"] for m in case["messages"] if not isinstance(m["content"], str)
            for p in m["content"] if p["type"] == "image"]
    if imgs:
        kw["images"] = imgs
    out = dict(proc(**kw))
    out["use_audio_in_video"] = case["av"]
    for k in ("pixel_values", "pixel_values_videos"):  # un-prefixed ones reach the talker
        if k in out:
            out["thinker_" + k] = out.pop(k)
    return out


@pytest.fixture(scope="module")
def hf(tiny_omni_dir):
    return HFReference(tiny_omni_dir), build_tiny_omni_video_processor(tiny_omni_dir)


@pytest.fixture(scope="module")
def llm(tiny_omni_dir):
    return OmniLLM(str(tiny_omni_dir), block_size=8, talker_handoff="transformers5")


@pytest.fixture(scope="module")
def prompts(clip, speech):
    return cases(clip, speech)


@pytest.mark.parametrize("name", CASES)
def test_processor_equals_transformers(tiny_omni_dir, hf, prompts, name):
    case = prompts[name]
    ours = Qwen2_5OmniInputProcessor.from_pretrained(tiny_omni_dir).process(
        case["messages"], use_audio_in_video=case["av"])
    want = hf_inputs(hf[1], case)
    assert ours.input_ids == want["input_ids"][0].tolist()
    assert ours.video_grid_thw.tolist() == want["video_grid_thw"].tolist()
    assert ours.video_second_per_grid.tolist() == want["video_second_per_grid"].tolist()
    pv = want["thinker_pixel_values_videos"]
    assert ours.video_pixel_values.abs().max() > 1.0
    assert (ours.video_pixel_values - pv).abs().max() <= 2e-6
    if case["audio"] is not None:
        mask = want["feature_attention_mask"]
        assert ours.audio_feature_lengths == mask.sum(-1).tolist()
        for i, f in enumerate(ours.audio_features):
            assert f.std() > 0.05
            assert (f - want["input_features"][i][:, :f.shape[1]]).abs().max() <= 1e-5
    n_video = sum(1 for t in ours.input_ids if t == TINY_OMNI_IDS["<|VIDEO|>"])
    assert n_video == int(ours.video_grid_thw.prod()) // 4
    thinker = hf[0].model.thinker
    ids = want["input_ids"]
    pos, delta = thinker.get_rope_index(
        ids, want.get("image_grid_thw"), want["video_grid_thw"], torch.ones_like(ids),
        case["av"], want["feature_attention_mask"].sum(-1) if case["audio"] else None,
        want["video_second_per_grid"])
    assert torch.equal(ours.mrope_positions, pos[:, 0]) and ours.rope_delta == int(delta)
    if case["av"]:  # interleaved: video, audio, video, audio (2-second chunks)
        run = ours.input_ids[ours.media[-1].start:ours.media[-1].start + ours.media[-1].length]
        flips = sum(1 for a, b in zip(run, run[1:]) if a != b)
        assert flips == 3 and ours.media[-1].audio_tokens == audio_tokens_for_frames(300)


@pytest.fixture(scope="module")
def alone(llm, prompts):
    return {name: llm.generate({"messages": prompts[name]["messages"],
                                "use_audio_in_video": prompts[name]["av"]}, GREEDY,
                               **TEXT_OUT)[0] for name in CASES}


@pytest.mark.parametrize("name", CASES)
def test_greedy_tokens_equal_transformers(hf, prompts, alone, name):
    model, proc = hf[0].model, hf[1]
    inputs = hf_inputs(proc, prompts[name])
    out = alone[name]
    assert out.error is None and out.prompt_token_ids == inputs["input_ids"][0].tolist()
    seq = model.generate(**inputs, generation_mode="text", thinker_do_sample=False,
                         thinker_max_new_tokens=GREEDY.max_tokens)
    ref = seq[0, inputs["input_ids"].shape[1]:].tolist()
    assert len(ref) > 0
    near_tie_ok(model, inputs, out.token_ids, ref, name)


def test_talker_codes_equal_transformers(hf, llm, prompts):
    ref, proc = hf
    case = dict(prompts["video_audio"])
    case["messages"] = [{"role": "system", "content": _system()}] + case["messages"]
    inputs = hf_inputs(proc, case)
    ref.codes.clear()
    ref.logits.clear()
    ref.restore_mask = False
    torch.manual_seed(5 + 2)
    seq, wav = ref.model.generate(
        **inputs, speaker="Chelsie", thinker_do_sample=False, thinker_max_new_tokens=8,
        talker_do_sample=False, talker_max_new_tokens=32, talker_eos_token_id=[120, 122])
    P = inputs["input_ids"].shape[1]
    out = llm.generate({"messages": prompts["video_audio"]["messages"],
                        "use_audio_in_video": True}, greedy_params(), use_tqdm=False)[0]
    assert out.error is None and out.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert out.token_ids == seq[0, P:].tolist()
    codes, ref_codes = out.stages["talker"].token_ids, ref.codes[0][0].tolist()
    assert len(ref_codes) > 0
    assert_codes_match(codes, ref_codes, ref, P, "video_audio")
    assert out.audio.shape[0] == len(codes) * 480
    if codes == ref_codes:
        assert float(wav.reshape(-1).pow(2).mean().sqrt()) >= 0.01
        assert np.abs(out.audio - wav.reshape(-1).numpy()).max() < 1e-4


def _system() -> str:
    from omnistage.models.qwen2_5_omni.processor import QWEN_AUDIO_SYSTEM_PROMPT
    return QWEN_AUDIO_SYSTEM_PROMPT


def test_mixed_batch_equals_alone(llm, prompts, alone):
    names = ["video_audio", "video_only", "video_image_audio", "video_text", "video_audio"]
    batch = llm.generate([{"messages": prompts[n]["messages"],
                           "use_audio_in_video": prompts[n]["av"]} for n in names]
                         + [{"messages": _user({"type": "text", "text": "Hi there."})}],
                         GREEDY, **TEXT_OUT)
    for name, out in zip(names, batch):
        assert out.error is None and out.token_ids == alone[name].token_ids, name
    assert batch[-1].error is None and len(batch[-1].token_ids) > 0


def test_prefix_cache_keys_videos_by_content(tiny_omni_dir, prompts):
    llm = OmniLLM(str(tiny_omni_dir), block_size=4)
    msg = {"messages": prompts["video_audio"]["messages"], "use_audio_in_video": True}
    first = llm.generate(msg, GREEDY, **TEXT_OUT)[0]
    ids = first.prompt_token_ids
    start = ids.index(TINY_OMNI_IDS["<|VIDEO|>"])
    end = len(ids) - ids[::-1].index(TINY_OMNI_IDS["<|AUDIO|>"])
    again = llm.generate(msg, GREEDY, **TEXT_OUT)[0]
    assert again.metrics.num_cached_tokens >= end // 4 * 4 > start
    assert again.token_ids == first.token_ids
    other = dict(msg, messages=_user({"type": "video", "video": _frames(4, seed=9)}))
    llm.generate(other, GREEDY, **TEXT_OUT)
    shifted = dict(msg, messages=_user({"type": "video", "video": _frames(4, seed=8)}))
    out = llm.generate(shifted, GREEDY, **TEXT_OUT)[0]  # same ids as `other`, other frames
    assert 0 < out.metrics.num_cached_tokens <= out.prompt_token_ids.index(
        TINY_OMNI_IDS["<|VIDEO|>"])


def _bad_parts(clip, speech) -> list[tuple[dict, str]]:
    wav = io.BytesIO()
    sf.write(wav, speech[0], speech[1], format="WAV")
    junk = clip["bytes"][:64] + bytes(range(256)) * 8
    return [
        ({"type": "video", "video": wav.getvalue()}, "no video stream"),
        ({"type": "video", "video": np.zeros((0, 56, 56, 3), np.uint8)}, "no frames"),
        ({"type": "video", "video": np.zeros((769, 28, 28, 3), np.uint8)}, "769 frames"),
        ({"type": "video", "video": junk}, "cannot decode video"),
        ({"type": "video", "video": b"definitely not a video"}, "cannot decode video"),
        ({"type": "video", "video": np.zeros((4, 56, 56), np.uint8)}, r"\[T, H, W, 3\]"),
    ]


def test_bad_video_fails_that_request_naming_the_part(llm, clip, speech):
    for part, msg in _bad_parts(clip, speech):
        bad = {"messages": _user(part, {"type": "text", "text": "hi"}), "use_audio_in_video": True}
        with pytest.raises(ValueError, match=r"prompts\[1\]\.messages\[0\]\.content\[0\]\.video: "
                           r".*" + msg):
            llm.generate(["fine", bad], GREEDY, **TEXT_OUT)
    with pytest.raises(ValueError, match=r"prompts\[0\]\.use_audio_in_video"):
        llm.generate({"messages": _user({"type": "text", "text": "x"}),
                      "use_audio_in_video": "yes"}, GREEDY, **TEXT_OUT)
    assert llm.generate("fine", GREEDY, **TEXT_OUT)[0].error is None


def test_audio_in_video_end_tokens_follow_the_last_chunk(hf, tiny_omni_dir):
    # the last chunk is audio whose positions end below the video's: transformers puts both
    # end tokens after the audio chunk, not after the video's largest position
    thinker = hf[0].model.thinker
    proc = Qwen2_5OmniInputProcessor.from_pretrained(Path(tiny_omni_dir))
    from omnistage.models.qwen2_5_omni.rope_index import video_audio_layout
    frames = 235  # 60 audio tokens: chunks [0, 50), [50, 60); video t = 0, 25, 50, 75
    runs = video_audio_layout([4, 2, 2], 1.0, audio_tokens_for_frames(frames), proc.rope_config)
    ids = [100, TINY_OMNI_IDS["<|vision_bos|>"], TINY_OMNI_IDS["<|audio_bos|>"]]
    for is_video, n in runs:
        ids += [TINY_OMNI_IDS["<|VIDEO|>" if is_video else "<|AUDIO|>"]] * n
    ids += [TINY_OMNI_IDS["<|audio_eos|>"], TINY_OMNI_IDS["<|vision_eos|>"], 101]
    ids_t = torch.tensor([ids])
    want, want_delta = thinker.get_rope_index(
        ids_t, None, torch.tensor([[4, 2, 2]]), torch.ones_like(ids_t), True,
        torch.tensor([frames]), torch.tensor([1.0]))
    got, delta = mrope_positions(ids, None, [frames], proc.rope_config,
                                 video_grid_thw=[[4, 2, 2]], second_per_grid=[1.0],
                                 use_audio_in_video=True)
    assert torch.equal(got, want[:, 0]) and delta == int(want_delta)
    assert int(got[0, -3]) < int(got[0].max())  # the end token sits below the video's top


def test_prompt_embeddings_equal_transformers(hf, llm, prompts, tiny_omni_dir):
    # encoder rows at audio / image / video placeholders (interleaved audio track included)
    from omnistage.models.qwen2_5_omni.thinker import thinker_sequence
    model, case = hf[0].model, prompts["video_image_audio"]
    inputs = hf_inputs(hf[1], case)
    seen = []
    hook = model.thinker.model.language_model.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw["inputs_embeds"][0].clone()), with_kwargs=True)
    try:
        with torch.no_grad():
            model.thinker(**{k.removeprefix("thinker_"): v for k, v in inputs.items()})
    finally:
        hook.remove()
    proc = Qwen2_5OmniInputProcessor.from_pretrained(tiny_omni_dir)
    seq = thinker_sequence("r", proc.process(case["messages"], use_audio_in_video=True),
                           GREEDY, 0)
    llm.pipeline.thinker.encode_media([seq])
    mask = seq.prompt_embeds_mask
    ids = torch.tensor(seq.prompt_token_ids)
    media = [TINY_OMNI_IDS[t] for t in ("<|AUDIO|>", "<|IMAGE|>", "<|VIDEO|>")]
    assert torch.equal(mask, torch.isin(ids, torch.tensor(media)))
    got, want = seq.prompt_embeds[mask], seen[0][mask]
    assert want.abs().max() > 0.1
    assert (got - want).abs().max() < 1e-4
