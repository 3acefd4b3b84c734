"""The tiny Qwen-Image checkpoint (omnistage/testing/tiny_qwen_image.py): diffusers'
QwenImagePipeline loads it with every tensor and generates prompt-dependent, non-flat images;
our modules load it and match diffusers' on its weights; building is deterministic."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from diffusers import QwenImagePipeline
from diffusers.utils import logging as diffusers_logging
from safetensors.torch import load_file

from omnistage.checkpoint import iter_tensors
from omnistage.models.qwen_image.transformer import QwenImageTransformer
from omnistage.models.qwen_image.vae import QwenImageVAEDecoder
from omnistage.testing.tiny_qwen_image import (PROMPT_TEMPLATE_DROP, PROMPT_TEMPLATE_PREFIX,
                                               build_tiny_qwen_image)

PROMPTS = ("a red cube on a wooden table", "a quiet lake at dawn with mountains")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_qwen_image(tmp_path_factory.mktemp("qwen_image") / "ckpt", seed=0)


@pytest.fixture(scope="module")
def pipe(tiny_dir) -> QwenImagePipeline:
    level = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()  # "true_cfg_scale ... no negative_prompt" per call
    pipe = QwenImagePipeline.from_pretrained(tiny_dir)
    pipe.set_progress_bar_config(disable=True)
    yield pipe
    diffusers_logging.set_verbosity(level)


def _generate(pipe: QwenImagePipeline, prompt: str, seed: int = 0) -> np.ndarray:
    image = pipe(prompt, height=48, width=64, num_inference_steps=3, output_type="np",
                 generator=torch.Generator("cpu").manual_seed(seed)).images[0]
    return np.round(image * 255).astype(np.int32)  # as uint8 pixels


def test_layout_and_scheduler_config(tiny_dir):
    index = json.loads((tiny_dir / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImagePipeline"
    for folder in ("text_encoder", "transformer", "vae"):
        assert (tiny_dir / folder / "config.json").is_file()
    sched = json.loads((tiny_dir / "scheduler" / "scheduler_config.json").read_text())
    assert {k: sched[k] for k in ("use_dynamic_shifting", "base_shift", "max_shift",
                                  "base_image_seq_len", "max_image_seq_len", "shift_terminal",
                                  "time_shift_type")} == {
        "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 0.9,
        "base_image_seq_len": 256, "max_image_seq_len": 8192, "shift_terminal": 0.02,
        "time_shift_type": "exponential"}


def test_tokenizer_template_prefix_is_34_tokens(pipe):
    tok = pipe.tokenizer
    ids = tok(PROMPT_TEMPLATE_PREFIX + "a red cube").input_ids
    assert len(tok(PROMPT_TEMPLATE_PREFIX).input_ids) == PROMPT_TEMPLATE_DROP
    assert tok.decode(ids[PROMPT_TEMPLATE_DROP:]) == "a red cube"
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert len(tok(special).input_ids) == 1
    assert tok.pad_token == "<|endoftext|>"


def test_diffusers_models_hold_every_file_tensor(pipe, tiny_dir):
    for folder, model in (("transformer", pipe.transformer), ("vae", pipe.vae)):
        stored = load_file(tiny_dir / folder / "diffusion_pytorch_model.safetensors")
        state = model.state_dict()
        assert set(stored) == set(state), folder
        for name, tensor in stored.items():
            assert torch.equal(state[name], tensor), name
    assert pipe.transformer.norm_out.linear.weight.abs().mean() > 0.01  # not zero-initialised
    assert pipe.transformer.proj_out.weight.abs().mean() > 0.01


def test_pipeline_images_are_live_and_prompt_dependent(pipe):
    first, other = (_generate(pipe, p) for p in PROMPTS)
    assert first.shape == (48, 64, 3)
    assert first.std() > 10 and other.std() > 10  # not flat
    assert np.abs(first - other).mean() > 5  # the prompt matters
    assert np.array_equal(first, _generate(pipe, PROMPTS[0]))  # and the seed fixes the image


def test_our_modules_load_it_and_match_diffusers(pipe, tiny_dir):
    cfg = json.loads((tiny_dir / "transformer" / "config.json").read_text())
    dit = QwenImageTransformer(cfg).eval()
    dit.load_weights(iter_tensors(tiny_dir / "transformer"))
    gen = torch.Generator().manual_seed(0)
    latents, text = torch.randn(1, 12, 64, generator=gen), torch.randn(1, 9, 64, generator=gen)
    timestep = torch.tensor([0.6])
    with torch.no_grad():
        ours = dit(latents, timestep, text, None, (3, 4))
        ref = pipe.transformer(hidden_states=latents, encoder_hidden_states=text,
                               timestep=timestep, img_shapes=[[(1, 3, 4)]],
                               return_dict=False)[0]
    assert ours.std() > 0.3 and (ours - ref).abs().max() <= 1e-5 * ref.abs().max()

    vae = QwenImageVAEDecoder(json.loads((tiny_dir / "vae" / "config.json").read_text())).eval()
    vae.load_weights(iter_tensors(tiny_dir / "vae"))
    z = torch.randn(1, 16, 6, 8, generator=gen)
    mean = torch.tensor(pipe.vae.config.latents_mean).view(1, 16, 1, 1, 1)
    std = torch.tensor(pipe.vae.config.latents_std).view(1, 16, 1, 1, 1)
    with torch.no_grad():
        image = vae.decode(z)
        expected = pipe.vae.decode(z[:, :, None] * std + mean).sample[:, :, 0].clamp(-1, 1)
    assert image.std() > 0.2 and (image - expected).abs().max() <= 1e-5


def test_build_is_deterministic_and_reused(tiny_dir, tmp_path):
    again = build_tiny_qwen_image(tmp_path / "again", seed=0)
    files = sorted(p.relative_to(tiny_dir) for p in tiny_dir.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    for rel in files:
        assert (tiny_dir / rel).read_bytes() == (again / rel).read_bytes(), rel
    stamp = (again / "vae" / "config.json").stat().st_mtime_ns
    assert build_tiny_qwen_image(again, seed=0) == again  # a complete build is reused
    assert (again / "vae" / "config.json").stat().st_mtime_ns == stamp
    other = build_tiny_qwen_image(again, seed=1)  # another seed rebuilds in place
    assert (other / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes() != (
        tiny_dir / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes()
