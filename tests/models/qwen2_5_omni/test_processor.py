"""Qwen2.5-Omni input processing vs transformers' Qwen2_5OmniProcessor on the tiny checkpoint."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch
from PIL import Image

from omnistage.models.qwen2_5_omni.media import load_audio, load_image, resample
from omnistage.models.qwen2_5_omni.processor import (
    QWEN_AUDIO_SYSTEM_PROMPT,
    Qwen2_5OmniInputProcessor,
)
from omnistage.testing.tiny_omni import (
    TINY_OMNI_IDS,
    audio_part,
    build_tiny_omni_processor,
    image_part,
    text_part,
    tiny_omni_test_messages,
    user_turn,
)

SR = 16000
CASES = tiny_omni_test_messages()
TONE = CASES["audio_text"][0]["content"][0]["audio"]
NOISE = CASES["multi_turn"][1]["content"][1]["audio"]
IMG_A = CASES["image_text"][0]["content"][0]["image"]
IMG_B = CASES["multi_turn"][3]["content"][0]["image"]
RNG = np.random.default_rng(1)


@pytest.fixture(scope="module")
def ref(tiny_omni_dir: Path):
    return build_tiny_omni_processor(tiny_omni_dir)


@pytest.fixture(scope="module")
def ours(tiny_omni_dir: Path) -> Qwen2_5OmniInputProcessor:
    return Qwen2_5OmniInputProcessor.from_pretrained(tiny_omni_dir)


def reference(ref, messages: list[dict]) -> dict:
    """transformers' processor output for `messages` (media passed in order of appearance)."""
    audios, images, plain = [], [], []
    for m in messages:
        if isinstance(m["content"], str):
            plain.append(m)
            continue
        parts = []
        for p in m["content"]:
            if p["type"] == "audio":
                audios.append(p["audio"])
            elif p["type"] == "image":
                images.append(p["image"])
            parts.append({"type": "text", "text": p["text"]} if p["type"] == "text"
                         else {"type": p["type"]})
        plain.append({"role": m["role"], "content": parts})
    text = ref.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
    return ref(text=text, audio=audios or None, images=images or None, return_tensors="pt")


@pytest.mark.parametrize("name", list(CASES))
def test_matches_transformers(name: str, ours, ref) -> None:
    msgs = CASES[name]
    got = ours.process(msgs)
    want = reference(ref, msgs)
    assert got.input_ids == want["input_ids"][0].tolist()
    n_audio = sum(1 for m in msgs if not isinstance(m["content"], str)
                  for p in m["content"] if p["type"] == "audio")
    assert len(got.audio_features) == n_audio
    if n_audio:
        mask = want["feature_attention_mask"]
        assert got.audio_feature_lengths == mask.sum(-1).tolist()
        for i, feats in enumerate(got.audio_features):
            assert feats.shape[0] == 128 and feats.dtype == torch.float32
            assert feats.std() > 0.05  # real features, not padding
            ref_feats = want["input_features"][i][:, : int(mask[i].sum())]
            assert (feats - ref_feats).abs().max() <= 1e-6
        assert sum(1 for t in got.input_ids if t == TINY_OMNI_IDS["<|AUDIO|>"]) > n_audio
    if "pixel_values" in want:
        assert got.image_pixel_values.abs().max() > 0.5
        assert torch.equal(got.image_pixel_values, want["pixel_values"])
        assert torch.equal(got.image_grid_thw, want["image_grid_thw"])
        assert len(got.image_grid_thw) == sum(1 for it in got.media if it.kind == "image")
    else:
        assert got.image_pixel_values is None and got.image_grid_thw is None
    for item in got.media:  # each item's run is exactly its placeholder tokens
        tok = TINY_OMNI_IDS["<|AUDIO|>" if item.kind == "audio" else "<|IMAGE|>"]
        run = got.input_ids[item.start: item.start + item.length]
        assert run == [tok] * item.length
        assert got.input_ids[item.start - 1] != tok
        assert got.input_ids[item.start + item.length] != tok
        assert len(item.content_hash) == 32
    assert got.mrope_positions.shape == (3, len(got.input_ids))


def test_image_processor_is_built_on_first_use_as_transformers_loads_it(tiny_omni_dir: Path
                                                                        ) -> None:
    # deferred (its module imports transformers' modeling stack: seconds of start-up), then
    # equal to the processor transformers itself loads from the legacy merged config
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from omnistage.models.qwen2_5_omni.processor import DeferredImageProcessor
    proc = Qwen2_5OmniInputProcessor.from_pretrained(tiny_omni_dir)
    deferred = proc._image_processor
    assert isinstance(deferred, DeferredImageProcessor) and deferred._built is None
    proc.process(CASES["text_only"])  # a prompt without images does not build it
    assert deferred._built is None
    # (transformers also keeps the merged file's feature-extractor fields as attributes)
    reference = Qwen2VLImageProcessorPil.from_pretrained(str(tiny_omni_dir)).to_dict()
    built = proc.image_processor.to_dict()
    assert "sampling_rate" not in built and "sampling_rate" in reference
    assert built == {k: reference[k] for k in built}
    assert proc.image_processor is proc.image_processor  # built once


def test_both_processor_layouts_load(tiny_omni_dir: Path, tiny_omni_v5_dir: Path, ours) -> None:
    assert (tiny_omni_dir / "preprocessor_config.json").is_file()
    assert not (tiny_omni_dir / "processor_config.json").exists()
    assert (tiny_omni_v5_dir / "processor_config.json").is_file()
    assert not (tiny_omni_v5_dir / "preprocessor_config.json").exists()
    v5 = Qwen2_5OmniInputProcessor.from_pretrained(tiny_omni_v5_dir)
    assert v5.feature_extractor.to_dict() == ours.feature_extractor.to_dict()
    assert v5.image_processor.to_dict() == ours.image_processor.to_dict()
    msgs = CASES["audio_image_text"]
    a, b = ours.process(msgs), v5.process(msgs)
    assert a.input_ids == b.input_ids
    assert torch.equal(a.audio_features[0], b.audio_features[0])
    assert torch.equal(a.image_pixel_values, b.image_pixel_values)
    ref_v5 = reference(build_tiny_omni_processor(tiny_omni_v5_dir), msgs)
    assert a.input_ids == ref_v5["input_ids"][0].tolist()


def test_checkpoint_layout(tiny_omni_dir: Path) -> None:
    import json

    shards = sorted(tiny_omni_dir.glob("model-*.safetensors"))
    assert len(shards) >= 3
    index = json.loads((tiny_omni_dir / "model.safetensors.index.json").read_text())
    prefixes = {k.split(".")[0] for k in index["weight_map"]}
    assert prefixes == {"thinker", "talker", "token2wav"}
    spk = torch.load(tiny_omni_dir / "spk_dict.pt", weights_only=True)
    assert spk["Chelsie"]["bos_token"] == TINY_OMNI_IDS["<|spk_chelsie|>"]
    assert spk["Ethan"]["cond"].shape == (1, 16) and spk["Ethan"]["ref_mel"].shape == (1, 64, 80)
    gen = json.loads((tiny_omni_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [TINY_OMNI_IDS["<|im_end|>"]]


def test_media_sources_agree(ours, tmp_path: Path) -> None:
    wav = io.BytesIO()
    soundfile.write(wav, TONE, SR, format="WAV", subtype="FLOAT")
    png = io.BytesIO()
    IMG_A.save(png, format="PNG")
    path = tmp_path / "a.png"
    path.write_bytes(png.getvalue())
    base = ours.process(CASES["audio_image_text"])
    for audio, image in ((wav.getvalue(), png.getvalue()), ((TONE, SR), str(path))):
        parts = (audio_part(audio), image_part(image), text_part("What do you hear and see?"))
        got = ours.process([user_turn(*parts)])
        assert got.input_ids == base.input_ids
        assert [m.content_hash for m in got.media] == [m.content_hash for m in base.media]
        assert torch.equal(got.audio_features[0], base.audio_features[0])
    other = ours.process([user_turn(audio_part(NOISE), image_part(IMG_B), text_part("x"))])
    assert {m.content_hash for m in other.media}.isdisjoint({m.content_hash for m in base.media})


def test_audio_system_prompt(ours) -> None:
    got = ours.process(CASES["audio_text"], add_audio_system_prompt=True)
    assert got.prompt_text.startswith(f"<|im_start|>system\n{QWEN_AUDIO_SYSTEM_PROMPT}<|im_end|>")
    kept = ours.process(CASES["multi_turn"], add_audio_system_prompt=True)
    assert kept.prompt_text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert QWEN_AUDIO_SYSTEM_PROMPT not in kept.prompt_text


def test_process_prompt(ours) -> None:
    base = ours.process(CASES["audio_image_text"])
    got = ours.process_prompt(base.prompt_text, {"audio": TONE, "image": [IMG_A]})
    assert got.input_ids == base.input_ids
    assert torch.equal(got.mrope_positions, base.mrope_positions)
    text = ours.process_prompt("<|im_start|>user\nhello<|im_end|>\n", None)
    assert text.media == [] and text.rope_delta == 0
    with pytest.raises(ValueError, match=r"multi_modal_data\.audio\[1\]: the prompt has no"):
        ours.process_prompt(base.prompt_text, {"audio": [TONE, NOISE], "image": IMG_A})
    with pytest.raises(ValueError, match=r"prompt: the prompt has 1 <\|IMAGE\|> placeholders"):
        ours.process_prompt(base.prompt_text, {"audio": TONE})
    with pytest.raises(ValueError, match=r"multi_modal_data\.video\[0\]: the prompt has no"):
        ours.process_prompt("hi", {"video": np.zeros((2, 28, 28, 3))})


def _corrupt_png() -> bytes:
    buf = io.BytesIO()
    IMG_B.save(buf, format="PNG")
    return buf.getvalue()[: len(buf.getvalue()) // 2]


@pytest.mark.parametrize("parts, pattern", [
    ([audio_part(b"RIFF\x00\x00\x00\x00WAVEfmt garbage")],
     r"messages\[0\]\.content\[0\]\.audio: cannot decode audio"),
    ([text_part("see:"), image_part(_corrupt_png())],
     r"messages\[0\]\.content\[1\]\.image: cannot decode image"),
    ([image_part(b"this is not an image at all")],
     r"messages\[0\]\.content\[0\]\.image: cannot decode image"),
    ([audio_part(np.zeros(301 * SR, np.float32))],
     r"messages\[0\]\.content\[0\]\.audio: audio is 301\.0 s long, more than the limit of 300 s"),
    ([audio_part(np.zeros(100, np.float32))], r"content\[0\]\.audio: audio is too short"),
    ([audio_part(np.array([0.0, np.nan] * 1000, np.float32))], r"content\[0\]\.audio: .*NaN"),
    ([image_part(Image.new("RGB", (5000, 4000)))],
     r"messages\[0\]\.content\[0\]\.image: image is 5000x4000"),
    ([{"type": "video", "video": "x.mp4"}],
     r"messages\[0\]\.content\[0\]\.video: video file not found: x\.mp4"),
    ([text_part("inject <|AUDIO|> here")],
     r"messages\[0\]\.content\[0\]\.text: contains the reserved"),
    ([{"type": "sound", "sound": 1}], r"messages\[0\]\.content\[0\]\.type: unknown part type"),
])
def test_bad_input_names_the_part(ours, parts: list[dict], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        ours.process([user_turn(*parts)])


def test_limits(tiny_omni_dir: Path, ours) -> None:
    small = Qwen2_5OmniInputProcessor.from_pretrained(
        tiny_omni_dir, max_audio_seconds=1.0, max_image_pixels=1000, allow_local_paths=False)
    with pytest.raises(ValueError, match=r"content\[0\]\.audio: audio is 2\.0 s long"):
        small.process(CASES["audio_text"])
    with pytest.raises(ValueError, match=r"content\[0\]\.image: image is 84x56 = 4704 pixels"):
        small.process(CASES["image_text"])
    with pytest.raises(ValueError, match=r"content\[0\]\.audio: local file paths are not allowed"):
        small.process([user_turn(audio_part("/etc/passwd"))])
    n = len(ours.process(CASES["audio_text"]).input_ids)
    with pytest.raises(ValueError, match=rf"messages: prompt is {n} tokens"):
        ours.process(CASES["audio_text"], max_prompt_tokens=n - 1)
    with pytest.raises(ValueError, match=r"messages\[1\]: must be a dict"):
        ours.process([{"role": "user", "content": "hi"}, "oops"])


def _peak_hz(x: np.ndarray, sr: int) -> float:
    spec = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    return float(np.fft.rfftfreq(len(x), 1 / sr)[spec.argmax()])


@pytest.mark.parametrize("sr, freq", [(44100, 440.0), (8000, 1000.0), (48000, 5000.0)])
def test_resample_keeps_frequency_and_length(sr: int, freq: float) -> None:
    x = np.sin(2 * np.pi * freq * np.arange(2 * sr) / sr).astype(np.float32)
    y = resample(x, sr, SR)
    assert len(y) == 2 * SR
    assert abs(_peak_hz(y, SR) - freq) <= 0.5
    ideal = np.sin(2 * np.pi * freq * np.arange(len(y)) / SR)
    assert np.abs(y - ideal)[200:-200].max() < 1e-3  # amplitude and phase kept
    wav = io.BytesIO()
    soundfile.write(wav, np.stack([x, x], axis=1), sr, format="WAV")  # stereo, int16
    loaded = load_audio(wav.getvalue(), "audio").samples
    assert len(loaded) == 2 * SR and abs(_peak_hz(loaded, SR) - freq) <= 0.5


def test_resample_removes_aliases() -> None:
    x = np.sin(2 * np.pi * 10000 * np.arange(44100) / 44100)  # above the 8 kHz Nyquist
    y = resample(x, 44100, SR)
    assert np.sqrt(np.mean(y[500:-500] ** 2)) < 1e-3


def test_rgba_image_matches_transformers(ours, ref) -> None:
    rgba = Image.fromarray(RNG.integers(0, 255, (56, 56, 4), dtype=np.uint8), mode="RGBA")
    assert load_image(rgba, "image").image.mode == "RGB"
    msgs = [user_turn(image_part(rgba), text_part("x"))]
    want = reference(ref, msgs)
    got = ours.process(msgs)
    assert torch.equal(got.image_pixel_values, want["pixel_values"])
