"""The tiny Qwen3-Omni checkpoint (released layout, runs in transformers' generate) and our
Qwen3-Omni input processor against transformers' Qwen3OmniMoeProcessor + get_rope_index.

transformers' video processor needs torchvision (absent beside torch 2.13 CPU): the reference
processor gets `build_tiny_qwen3_omni_processor`'s frame video processor (transformers' image
processor per frame pair). transformers cannot decode files here (no torchcodec): its processor
gets the frames and audio track we decoded."""

from __future__ import annotations

import fractions
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen3OmniMoeForConditionalGeneration
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    _get_feat_extract_output_lengths,
)

from omnistage.models.qwen2_5_omni.video import load_video
from omnistage.models.qwen3_omni.processor import Qwen3OmniInputProcessor
from omnistage.models.qwen3_omni.rope_index import (
    TALKER_ASSISTANT_PROMPT_LEN,
    audio_tokens_for_frames,
    mrope_positions,
    talker_positions,
)
from omnistage.testing.tiny_omni import (
    audio_part,
    image_part,
    text_part,
    user_turn,
    video_part,
)
from omnistage.testing.tiny_qwen3_omni import (
    TINY_QWEN3_OMNI_EOS,
    TINY_QWEN3_OMNI_IDS,
    TINY_SPEAKERS,
    build_tiny_qwen3_omni_processor,
    enable_talker_audio_prompts,
)

SR = 16000
IDS = TINY_QWEN3_OMNI_IDS
AUDIO_PAD, IMAGE_PAD, VIDEO_PAD = IDS["<|audio_pad|>"], IDS["<|image_pad|>"], IDS["<|video_pad|>"]
RNG = np.random.default_rng(0)
TONE = (0.3 * np.sin(2 * np.pi * 220 * np.arange(2 * SR) / SR)
        + 0.05 * RNG.standard_normal(2 * SR)).astype(np.float32)
NOISE = (0.2 * RNG.standard_normal(12345)).astype(np.float32)  # not a whole number of frames
IMG_A = Image.fromarray(RNG.integers(0, 255, (56, 84, 3), dtype=np.uint8))
IMG_B = Image.fromarray(RNG.integers(0, 255, (100, 70, 3), dtype=np.uint8))


def _frames(n: int, seed: int, h: int = 40, w: int = 56) -> np.ndarray:
    # moving gradients plus a little noise: non-trivial, and compressible
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    out = [np.stack([(xx * 4 + 9 * t) % 256, (yy * 4 + 5 * t) % 256,
                     ((xx + yy) * 2 + 20 * t) % 256], -1) for t in range(n)]
    return np.clip(np.array(out) + rng.integers(-8, 8, (n, h, w, 3)), 0, 255).astype(np.uint8)


FRAMES = _frames(4, seed=2)


CASES = {
    "text_only": [{"role": "user", "content": "Beautiful is better than ugly. Say something."}],
    "audio_text": [user_turn(audio_part(TONE), text_part("What do you hear?"))],
    "odd_audio_text": [user_turn(audio_part(NOISE), text_part("And now?"))],
    "image_text": [user_turn(image_part(IMG_A), text_part("What is this?"))],
    "audio_image_text": [{"role": "system", "content": "Be brief."},
                         user_turn(audio_part(TONE), image_part(IMG_A),
                                   text_part("What do you hear and see?"))],
    "two_images_two_turns": [user_turn(image_part(IMG_A), text_part("And this?")),
                             {"role": "assistant", "content": "A picture."},
                             user_turn(image_part(IMG_B), text_part("Compare them."))],
}


@pytest.fixture(scope="module")
def ref(tiny_qwen3_omni_dir: Path):
    return build_tiny_qwen3_omni_processor(tiny_qwen3_omni_dir)


@pytest.fixture(scope="module")
def ours(tiny_qwen3_omni_dir: Path) -> Qwen3OmniInputProcessor:
    return Qwen3OmniInputProcessor.from_pretrained(tiny_qwen3_omni_dir)


@pytest.fixture(scope="module")
def hf(tiny_qwen3_omni_dir: Path) -> Qwen3OmniMoeForConditionalGeneration:
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        tiny_qwen3_omni_dir, dtype=torch.float32).eval()
    enable_talker_audio_prompts(model)
    return model


def reference(ref, messages: list[dict], **kw: object) -> dict:
    """transformers' processor output for `messages` (media in order of appearance)."""
    audios, images, videos, plain = [], [], [], []
    for m in messages:
        if isinstance(m["content"], str):
            plain.append(m)
            continue
        for p in m["content"]:
            {"audio": audios, "image": images, "video": videos}.get(p["type"], []).append(
                p.get(p["type"]))
        plain.append({"role": m["role"], "content": [
            p if p["type"] == "text" else {"type": p["type"]} for p in m["content"]]})
    text = ref.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
    kw = {"audio": kw.pop("audio", audios or None), "videos": kw.pop("videos", videos or None),
          **kw}
    return dict(ref(text=text, images=images or None, return_tensors="pt", **kw))


def hf_positions(hf, want: dict, use_audio_in_video: bool = False):
    ids = want["input_ids"]
    fam = want.get("feature_attention_mask")
    pos, delta = hf.thinker.get_rope_index(
        ids, want.get("image_grid_thw"), want.get("video_grid_thw"), torch.ones_like(ids),
        use_audio_in_video, None if fam is None else fam.sum(-1),
        want.get("video_second_per_grid"))
    return pos[:, 0], delta


def assert_matches(got, want: dict, hf, *, use_audio_in_video: bool = False,
                   shorter_audios: tuple[int, ...] = ()) -> None:
    assert got.input_ids == want["input_ids"][0].tolist()
    fam = want.get("feature_attention_mask")
    assert len(got.audio_features) == (0 if fam is None else fam.shape[0])
    for i, feats in enumerate(got.audio_features):
        assert feats.shape[0] == 128 and feats.std() > 0.05  # real features, not padding
        assert feats.shape[1] == int(fam[i].sum())
        ref_feats = want["input_features"][i][:, :feats.shape[1]]
        if i in shorter_audios:  # transformers zero-pads it to the longest: its last frame
            feats, ref_feats = feats[:, :-1], ref_feats[:, :-1]
        assert torch.equal(feats, ref_feats)
    if "pixel_values" in want:
        assert got.image_pixel_values.abs().max() > 0.5
        assert torch.equal(got.image_pixel_values, want["pixel_values"])
        assert torch.equal(got.image_grid_thw, want["image_grid_thw"])
    else:
        assert got.image_pixel_values is None and got.image_grid_thw is None
    if "pixel_values_videos" in want:
        assert got.video_pixel_values.abs().max() > 0.5
        assert (got.video_pixel_values - want["pixel_values_videos"]).abs().max() <= 2e-6
        assert got.video_grid_thw.tolist() == want["video_grid_thw"].tolist()
        assert got.video_second_per_grid.tolist() == want["video_second_per_grid"].tolist()
    else:
        assert got.video_pixel_values is None
    pos, delta = hf_positions(hf, want, use_audio_in_video)
    assert got.mrope_positions.dtype == torch.long
    assert torch.equal(got.mrope_positions, pos.long()) and torch.equal(pos, pos.round())
    assert got.rope_delta == int(delta)
    pad_of = {"audio": AUDIO_PAD, "image": IMAGE_PAD, "video": VIDEO_PAD}
    for item in got.media:
        run = got.input_ids[item.start:item.start + item.length]
        if item.audio_tokens:
            assert sorted(set(run)) == [VIDEO_PAD, AUDIO_PAD]
            assert run.count(AUDIO_PAD) == item.audio_tokens
        else:
            assert run == [pad_of[item.kind]] * item.length
        assert len(item.content_hash) == 32


# ------------------------------------------------------------------------------ checkpoint


def test_checkpoint_layout(tiny_qwen3_omni_dir: Path) -> None:
    root = tiny_qwen3_omni_dir
    for name in ("config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json", "chat_template.json", "preprocessor_config.json"):
        assert (root / name).is_file(), name
    # as released: one merged root preprocessor config, no nested / video processor files
    assert not (root / "processor_config.json").exists()
    assert not (root / "video_preprocessor_config.json").exists()
    assert len(list(root.glob("model-*.safetensors"))) >= 3
    names = list(json.loads((root / "model.safetensors.index.json").read_text())["weight_map"])
    assert {n.split(".")[0] for n in names} == {"thinker", "talker", "code2wav"}
    assert "thinker.model.layers.0.mlp.experts.7.gate_proj.weight" in names
    assert "talker.model.layers.1.mlp.experts.0.down_proj.weight" in names
    assert "talker.model.layers.0.mlp.shared_expert.up_proj.weight" in names
    assert not any("gate_up_proj" in n for n in names)
    cfg = json.loads((root / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3OmniMoeForConditionalGeneration"]
    assert cfg["enable_audio_output"] is True
    talker, thinker = cfg["talker_config"], cfg["thinker_config"]
    vocab = talker["text_config"]["vocab_size"]
    assert talker["speaker_id"] == TINY_SPEAKERS and talker["num_code_groups"] == 16
    specials = [talker[k] for k in ("codec_pad_id", "codec_bos_id", "codec_eos_token_id",
                                    "codec_nothink_id", "codec_think_bos_id",
                                    "codec_think_eos_id")] + list(TINY_SPEAKERS.values())
    assert all(vocab - 1024 <= s < vocab for s in specials) and len(set(specials)) == 9
    assert 0 < talker["accept_hidden_layer"] < thinker["text_config"]["num_hidden_layers"]
    assert cfg["code2wav_config"]["codebook_size"] == vocab - 1024
    assert thinker["text_config"]["head_dim"] == 2 * sum(
        thinker["text_config"]["rope_parameters"]["mrope_section"])
    gen = json.loads((root / "generation_config.json").read_text())
    assert gen["eos_token_id"] == TINY_QWEN3_OMNI_EOS
    pre = json.loads((root / "preprocessor_config.json").read_text())
    assert (pre["feature_size"], pre["n_samples"], pre["patch_size"], pre["merge_size"],
            pre["image_mean"]) == (128, 300 * SR, 16, 2, [0.5, 0.5, 0.5])


def test_thinking_layout(tiny_qwen3_omni_thinking_dir: Path, tiny_qwen3_omni_dir: Path) -> None:
    root = tiny_qwen3_omni_thinking_dir
    cfg = json.loads((root / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3OmniMoeForConditionalGeneration"]
    assert cfg["enable_audio_output"] is False
    index = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    assert {n.split(".")[0] for n in index} == {"thinker"}
    assert len(set(index.values())) >= 3
    full = json.loads((tiny_qwen3_omni_dir / "model.safetensors.index.json").read_text())
    assert set(index) == {n for n in full["weight_map"] if n.startswith("thinker.")}


def test_checkpoint_generates_text_and_audio(hf, ref) -> None:
    captured = {}
    decode = hf.code2wav.chunked_decode

    def capture(codes: torch.Tensor, **kw: object) -> torch.Tensor:
        captured["codes"] = codes
        return decode(codes, **kw)

    hf.code2wav.chunked_decode = capture
    try:
        for messages in (CASES["text_only"], CASES["audio_image_text"]):
            want = reference(ref, messages)
            with torch.no_grad():
                seq, wav = hf.generate(
                    **want, speaker="Ethan", thinker_eos_token_id=TINY_QWEN3_OMNI_EOS,
                    thinker_do_sample=False, talker_do_sample=False, thinker_max_new_tokens=10,
                    talker_max_new_tokens=12)
            text_ids = seq[0, want["input_ids"].shape[1]:].tolist()
            assert len(set(text_ids)) >= 4  # greedy text does not loop on one token
            codes = captured["codes"][0]
            assert codes.shape[0] == 16 and codes.shape[1] >= 8
            assert all(len(set(row.tolist())) >= 4 for row in codes)
            rms = float(wav.pow(2).mean().sqrt())
            assert 0.05 < rms < 0.5, rms
    finally:
        hf.code2wav.chunked_decode = decode
    other = torch.randint(0, 2048, codes.shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = hf.code2wav(codes[None]), hf.code2wav(other[None])
    assert (a - b).pow(2).mean().sqrt() > 0.3 * a.pow(2).mean().sqrt()  # codes matter


# -------------------------------------------------------------------------------- processor


@pytest.mark.parametrize("name", list(CASES))
def test_matches_transformers(name: str, ours, ref, hf) -> None:
    assert_matches(ours.process(CASES[name]), reference(ref, CASES[name]), hf)


def test_two_audios_match_transformers(ours, ref, hf) -> None:
    # transformers featurises a prompt's audios as one batch padded to the longest; ours each
    # alone. Whole frames (no partial one) keep the counts equal; then only the shorter one's
    # last frame differs (zeros vs reflection past its end).
    short = NOISE[:12320]
    msgs = [user_turn(text_part("Listen:"), audio_part(short), audio_part(TONE),
                      text_part("Which is longer?"))]
    assert_matches(ours.process(msgs), reference(ref, msgs), hf, shorter_audios=(0,))


@pytest.mark.parametrize("fps", [2.0, 1.0])
def test_video_frames_match_transformers(fps: float, ours, ref, hf) -> None:
    msgs = [user_turn(video_part(FRAMES, fps=fps), image_part(IMG_A), text_part("What happens?"))]
    got = ours.process(msgs)
    assert got.video_grid_thw.tolist()[0][0] == 2
    assert_matches(got, reference(ref, msgs, fps=fps), hf)


def _mux(frames: np.ndarray, audio: np.ndarray | None, fps: int = 4) -> bytes:
    """A Matroska clip: frames at `fps` (ffv1, lossless) + a 16-bit PCM mono track at 16 kHz."""
    av = pytest.importorskip("av", reason="video files need PyAV")
    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska") as box:
        vs = box.add_stream("ffv1", rate=fps)
        vs.width, vs.height, vs.pix_fmt = frames.shape[2], frames.shape[1], "bgr0"
        if audio is not None:
            track = box.add_stream("pcm_s16le", rate=SR)
            track.layout = "mono"
            pcm = np.round(audio * 32768).astype(np.int16)
            for i in range(0, len(pcm), 1024):
                f = av.AudioFrame.from_ndarray(pcm[None, i:i + 1024], format="s16", layout="mono")
                f.sample_rate, f.pts, f.time_base = SR, i, fractions.Fraction(1, SR)
                box.mux(track.encode(f))
            box.mux(track.encode())
        for fr in frames:
            box.mux(vs.encode(av.VideoFrame.from_ndarray(fr, format="rgb24")))
        box.mux(vs.encode())
    return buf.getvalue()


@pytest.fixture(scope="module")
def clip(ours) -> dict:
    """3 s at 4 fps (sampled to 6 frames at 2 fps) with a 3 s tone as its audio track."""
    speech = np.round(0.3 * np.sin(2 * np.pi * 330 * np.arange(3 * SR) / SR) * 32767) / 32768
    data = _mux(_frames(12, seed=1), speech.astype(np.float32))
    decoded = load_video(data, "clip", ours.video_config, with_audio=True)
    assert decoded.fps == 2.0 and decoded.audio.shape == (3 * SR,)
    return {"bytes": data, "frames": decoded.frames, "track": decoded.audio, "fps": decoded.fps}


def test_video_file_without_its_audio(clip, ours, ref, hf) -> None:
    msgs = [user_turn(video_part(clip["bytes"]), text_part("What happens?"))]
    got = ours.process(msgs)
    assert got.audio_features == [] and got.video_grid_thw.tolist()[0][0] == 3
    assert_matches(got, reference(ref, msgs, videos=[clip["frames"]], fps=clip["fps"]), hf)


@pytest.mark.parametrize("with_audio_first", [False, True])
def test_video_with_its_audio_matches_transformers(with_audio_first: bool, clip, ours, ref,
                                                   hf) -> None:
    parts = [image_part(IMG_B), video_part(clip["bytes"]), text_part("What happens?")]
    audio, slots = [clip["track"]], [0]
    if with_audio_first:
        parts.insert(0, audio_part(TONE))
        audio, slots = [TONE, clip["track"]], [None, 0]
    msgs = [user_turn(*parts)]
    got = ours.process(msgs, use_audio_in_video=True)
    want = reference(ref, msgs, videos=[clip["frames"]], fps=clip["fps"], audio=audio,
                     load_audio_from_video=True, audio_from_video_indices=slots)
    assert_matches(got, want, hf, use_audio_in_video=True,
                   shorter_audios=(0,) if with_audio_first else ())
    item = next(m for m in got.media if m.kind == "video")
    run = got.input_ids[item.start:item.start + item.length]
    # merged by time: the first frame pair (t = 0), then audio until t = 13, ...
    first_audio = run.index(AUDIO_PAD)
    assert first_audio == int(got.video_grid_thw[0, 1:].prod()) // 4
    assert run[first_audio:first_audio + 13] == [AUDIO_PAD] * 13
    assert run[first_audio + 13] == VIDEO_PAD
    assert got.input_ids[item.start - 2:item.start] == [IDS["<|vision_start|>"],
                                                        IDS["<|audio_start|>"]]


def test_video_with_a_short_audio_track_ends_after_its_last_run(ours, ref, hf) -> None:
    # 2 grid steps (t = 0, 13) of 15 x 20 merged patches, a 1.3 s track (17 audio pads): the
    # audio outlasts the video, and the end tokens follow the last audio pad (16), below the
    # block's largest position (w = 19), as transformers places them
    track = (0.3 * np.sin(2 * np.pi * 330 * np.arange(int(1.3 * SR)) / SR)).astype(np.float32)
    data = _mux(_frames(8, seed=3, h=480, w=640), track)
    decoded = load_video(data, "clip", ours.video_config, with_audio=True)
    msgs = [user_turn(video_part(data), text_part("x"))]
    got = ours.process(msgs, use_audio_in_video=True)
    want = reference(ref, msgs, videos=[decoded.frames], fps=decoded.fps, audio=[decoded.audio],
                     load_audio_from_video=True, audio_from_video_indices=[0])
    assert_matches(got, want, hf, use_audio_in_video=True)
    item = got.media[0]
    assert got.video_grid_thw.tolist() == [[2, 30, 40]] and item.audio_tokens == 17
    block = got.mrope_positions[:, item.start - 2:item.start + item.length]
    end = got.mrope_positions[:, item.start + item.length]
    assert (end == block[:, -1] + 1).all() and int(end[0]) < int(block.max()) + 1


def test_talker_positions_match_transformers(clip, ours, hf, tiny_qwen3_omni_dir) -> None:
    cfg = json.loads((tiny_qwen3_omni_dir / "config.json").read_text())
    talker_cfg = {**cfg["talker_config"], "audio_config": cfg["thinker_config"]["audio_config"]}
    tts_pad = cfg["tts_pad_token_id"]
    cases = [(CASES["audio_image_text"], False), (CASES["two_images_two_turns"], False),
             ([user_turn(video_part(FRAMES), text_part("x"))], False),
             ([user_turn(audio_part(TONE), video_part(clip["bytes"]), text_part("x"))], True)]
    for messages, use_audio_in_video in cases:
        got = ours.process(messages, use_audio_in_video=use_audio_in_video)
        role, users = None, []  # user-turn tokens, as transformers' generate selects them
        for i, t in enumerate(got.input_ids):
            if t == cfg["im_start_token_id"]:
                role = got.input_ids[i + 1]
            if role == cfg["user_token_id"]:
                users.append(i)
        pos, delta = talker_positions(got.input_ids, users, tts_pad, got, talker_cfg)
        ids = torch.tensor([[got.input_ids[i] for i in users]
                            + [tts_pad] * TALKER_ASSISTANT_PROMPT_LEN])
        want, want_delta = hf.talker.get_rope_index(
            ids, got.image_grid_thw, got.video_grid_thw, torch.ones_like(ids), False,
            torch.tensor(got.audio_feature_lengths), got.video_second_per_grid)
        assert torch.equal(pos, want[:, 0].long()) and delta == int(want_delta)


# ------------------------------------------------------------------------- rope index, API


def test_audio_token_rule_equals_transformers() -> None:
    frames = torch.arange(1, 3001)
    for n_window in (50, 25):
        want = _get_feat_extract_output_lengths(frames, n_window).tolist()
        assert [audio_tokens_for_frames(int(f), n_window) for f in frames] == want


def test_positions_reject_mismatched_runs(ours) -> None:
    got = ours.process(CASES["audio_image_text"])
    ids = list(got.input_ids)
    cut = ids.index(IMAGE_PAD)
    with pytest.raises(ValueError, match="image #0 at"):
        mrope_positions(ids[:cut] + ids[cut + 1:], got.image_grid_thw,
                        got.audio_feature_lengths, ours.rope_config)
    with pytest.raises(ValueError, match="more image placeholders"):
        mrope_positions(ids + ids, got.image_grid_thw, got.audio_feature_lengths * 2,
                        ours.rope_config)
    with pytest.raises(ValueError, match="but no grid_thw"):
        mrope_positions(ids, None, got.audio_feature_lengths, ours.rope_config)


def test_fractional_video_times_are_truncated(ours, ref, hf) -> None:
    # 3 fps: seconds per grid step 2/3, x 13 = 8.67 positions; transformers keeps floats
    msgs = [user_turn(video_part(FRAMES, fps=3.0), text_part("x"))]
    got = ours.process(msgs)
    pos, _ = hf_positions(hf, reference(ref, msgs, fps=3.0))
    video = got.input_ids.index(VIDEO_PAD)
    n = int(got.video_grid_thw.prod()) // 4
    assert not torch.equal(pos, pos.round())
    assert torch.equal(got.mrope_positions[:, :video + n], pos[:, :video + n].long())


def test_process_prompt_and_system_prompt(ours) -> None:
    base = ours.process(CASES["audio_image_text"])
    got = ours.process_prompt(base.prompt_text, {"audio": TONE, "image": [IMG_A]})
    assert got.input_ids == base.input_ids
    assert torch.equal(got.mrope_positions, base.mrope_positions)
    # Qwen3-Omni speaks without Qwen2.5's system prompt: the flag changes nothing
    plain = ours.process(CASES["audio_text"], add_audio_system_prompt=True)
    assert plain.prompt_text.startswith("<|im_start|>user\n")
    assert plain.input_ids == ours.process(CASES["audio_text"]).input_ids
    with pytest.raises(ValueError, match=r"multi_modal_data\.audio\[1\]: the prompt has no"):
        ours.process_prompt(base.prompt_text, {"audio": [TONE, NOISE], "image": IMG_A})
    with pytest.raises(ValueError, match=r"prompt: the prompt has 1 <\|image_pad\|>"):
        ours.process_prompt(base.prompt_text, {"audio": TONE})


@pytest.mark.parametrize("parts, pattern", [
    ([text_part("inject <|audio_pad|> here")], r"content\[0\]\.text: contains the reserved"),
    ([audio_part(np.zeros(300, np.float32))], r"content\[0\]\.audio: audio is too short"),
    ([image_part(Image.new("RGB", (5000, 4000)))], r"content\[0\]\.image: image is 5000x4000"),
    ([video_part(np.zeros((2, 28, 28), np.uint8))], r"content\[0\]\.video: video frame array"),
])
def test_bad_input_names_the_part(ours, parts: list[dict], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        ours.process([user_turn(*parts)])
