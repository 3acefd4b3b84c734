"""The thinker stage against transformers' Qwen2.5-Omni (tiny random checkpoint, fp32, CPU)."""

from __future__ import annotations

import io
import logging

import numpy as np
import pytest
import torch
from PIL import Image

from omnistage import OmniLLM, SamplingParams
from omnistage.testing.tiny_omni import build_tiny_omni_processor, tiny_omni_test_messages

log = logging.getLogger(__name__)
MAX_NEW = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)
TEXT_OUT = {"output_modalities": ["text"], "use_tqdm": False}  # thinker stage only


def hf_inputs(proc, messages):
    inputs = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                      return_dict=True, return_tensors="pt")
    if "pixel_values" in inputs:  # un-prefixed kwargs also reach the talker, which rejects it
        inputs["thinker_pixel_values"] = inputs.pop("pixel_values")
    return inputs


def hf_thinker_greedy(model, inputs) -> tuple[list[int], list[torch.Tensor]]:
    seq = model.generate(**inputs, generation_mode="text", thinker_do_sample=False,
                         thinker_max_new_tokens=MAX_NEW)
    ids = seq[0, inputs["input_ids"].shape[1]:].tolist()
    return ids, []


def near_tie_ok(model, inputs, ours: list[int], ref: list[int], label: str) -> None:
    """Equal, or the first divergence sits where transformers' top-2 logit gap is < 1e-4."""
    if ours == ref:
        return
    i = next((k for k, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
    kw = {k.removeprefix("thinker_"): v for k, v in inputs.items()}
    out = model.thinker.generate(**kw, do_sample=False, max_new_tokens=i + 1,
                                 output_scores=True, return_dict_in_generate=True)
    top2 = out.scores[i][0].topk(2).values
    gap = (top2[0] - top2[1]).item()
    assert gap < 1e-4, f"{label}: token {i} differs ({ours[i:i+1]} vs {ref[i:i+1]}), gap {gap}"
    log.warning("%s: near-tie divergence at token %d (gap %.3g) accepted", label, i, gap)


@pytest.fixture(scope="module")
def hf(tiny_omni_dir):
    from transformers import Qwen2_5OmniForConditionalGeneration
    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(str(tiny_omni_dir)).eval()
    return model, build_tiny_omni_processor(tiny_omni_dir)


@pytest.fixture(scope="module")
def llm(tiny_omni_dir):
    return OmniLLM(str(tiny_omni_dir), block_size=8)


@pytest.fixture(scope="module")
def alone(llm):
    msgs = tiny_omni_test_messages()
    return {name: llm.generate({"messages": m}, GREEDY, **TEXT_OUT)[0]
            for name, m in msgs.items()}


@pytest.mark.parametrize("case", list(tiny_omni_test_messages()))
def test_greedy_tokens_equal_transformers(hf, alone, case):
    model, proc = hf
    messages = tiny_omni_test_messages()[case]
    inputs = hf_inputs(proc, messages)
    out = alone[case]
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    ref, _ = hf_thinker_greedy(model, inputs)
    assert len(ref) > 0
    near_tie_ok(model, inputs, out.token_ids, ref, case)


def test_mixed_batch_equals_alone(llm, alone):
    msgs = tiny_omni_test_messages()
    names = list(msgs) + ["image_text", "audio_text"]  # 8 prompts, duplicates included
    outs = llm.generate([{"messages": msgs[n]} for n in names], GREEDY, **TEXT_OUT)
    assert len(outs) >= 8
    for name, out in zip(names, outs):
        assert out.error is None
        assert out.token_ids == alone[name].token_ids, name


def test_v5_processor_layout_gives_same_tokens(tiny_omni_v5_dir, alone):
    llm = OmniLLM(str(tiny_omni_v5_dir))
    msgs = tiny_omni_test_messages()
    outs = llm.generate([{"messages": msgs[n]} for n in ("audio_image_text", "two_images")],
                        GREEDY, **TEXT_OUT)
    assert outs[0].token_ids == alone["audio_image_text"].token_ids
    assert outs[1].token_ids == alone["two_images"].token_ids


def _image_prompt(img: Image.Image) -> dict:
    return {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Describe the picture in detail, please."},
        {"type": "image", "image": img}, {"type": "text", "text": "Now."}]}]}


def test_prefix_cache_keys_images_by_content(tiny_omni_dir):
    rng = np.random.default_rng(3)
    img_x = Image.fromarray(rng.integers(0, 255, (112, 112, 3), dtype=np.uint8))
    img_y = Image.fromarray(rng.integers(0, 255, (112, 112, 3), dtype=np.uint8))
    llm = OmniLLM(str(tiny_omni_dir), block_size=4)
    first = llm.generate(_image_prompt(img_x), GREEDY, **TEXT_OUT)[0]
    ids = first.prompt_token_ids
    image_id = llm.pipeline.processor.token_ids["image"]
    img_start = ids.index(image_id)
    img_end = len(ids) - ids[::-1].index(image_id)
    same = llm.generate(_image_prompt(img_x.copy()), GREEDY, **TEXT_OUT)[0]
    assert same.metrics.num_cached_tokens >= img_end // 4 * 4 > img_start
    assert same.token_ids == first.token_ids
    other = llm.generate(_image_prompt(img_y), GREEDY, **TEXT_OUT)[0]
    assert other.prompt_token_ids == ids  # equal ids, different pixels
    assert 0 < other.metrics.num_cached_tokens <= img_start


def _wav_bytes(seconds: float, sr: int = 16000) -> bytes:
    import soundfile as sf
    buf = io.BytesIO()
    sf.write(buf, np.zeros(int(seconds * sr), dtype=np.float32), sr, format="WAV")
    return buf.getvalue()


def _png_bytes() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (10, 20, 30)).save(buf, format="PNG")
    return buf.getvalue()


BAD_PARTS = [
    ({"type": "audio", "audio": b"RIFF\x00\x00garbage"}, "content[0].audio"),
    ({"type": "image", "image": _png_bytes()[:60]}, "content[0].image"),
    ({"type": "image", "image": b"this is not an image"}, "content[0].image"),
    ({"type": "audio", "audio": np.zeros(16000 * 301, dtype=np.float32)}, "content[0].audio"),
]


@pytest.mark.parametrize("part,field", BAD_PARTS)
def test_bad_media_fails_that_prompt_naming_the_part(llm, part, field):
    bad = {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "hi"}]}]}
    with pytest.raises(ValueError, match=r"prompts\[1\]\.messages\[0\]\." + field.replace(
            "[", r"\[").replace("]", r"\]")):
        llm.generate(["fine", bad], GREEDY, **TEXT_OUT)
    assert llm.engine.num_steps >= 0 and not llm.engine.has_unfinished()


def test_placeholder_count_mismatch(llm):
    prompt = {"prompt": "<|audio_bos|><|AUDIO|><|audio_eos|><|audio_bos|><|AUDIO|><|audio_eos|>hi",
              "multi_modal_data": {"audio": [np.zeros(16000, dtype=np.float32)]}}
    with pytest.raises(ValueError, match=r"prompts\[0\]"):
        llm.generate(prompt, GREEDY, **TEXT_OUT)


def test_wav_bytes_input_works(llm):
    msg = {"messages": [{"role": "user", "content": [
        {"type": "audio", "audio": _wav_bytes(1.0)}, {"type": "text", "text": "hi"}]}]}
    out = llm.generate(msg, GREEDY, **TEXT_OUT)[0]
    assert out.error is None and len(out.token_ids) > 0
