"""The tiny Z-Image checkpoint: diffusers' ZImagePipeline loads it and makes textured,
prompt-dependent images; the build is deterministic; the tokenizer renders Qwen3's template;
our modules load its transformer / vae files by name and equal the pipeline's modules."""

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from omnistage.checkpoint import iter_tensors
from omnistage.models.autoencoder_kl import AutoencoderKLDecoder
from omnistage.models.z_image.transformer import ZImageTransformer
from omnistage.testing.tiny_z_image import build_tiny_z_image

diffusers = pytest.importorskip("diffusers")

PROMPTS = ["a red cat sitting on a mat", "Beautiful is better than ugly. A lighthouse at night"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    start = time.perf_counter()
    path = build_tiny_z_image(tmp_path_factory.mktemp("tiny_z_image") / "ckpt", seed=0)
    print(f"build: {time.perf_counter() - start:.2f} s")
    return path


@pytest.fixture(scope="module")
def pipe(checkpoint):
    pipe = diffusers.ZImagePipeline.from_pretrained(str(checkpoint))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _generate(pipe, prompt: str) -> np.ndarray:
    image = pipe(prompt, height=64, width=48, num_inference_steps=3, guidance_scale=0.0,
                 generator=torch.Generator().manual_seed(0), output_type="np").images[0]
    return (image * 255).round().astype(np.uint8)


def test_pipeline_generates_textured_prompt_dependent_images(pipe):
    assert type(pipe.text_encoder).__name__ == "Qwen3Model"
    start = time.perf_counter()
    first = _generate(pipe, PROMPTS[0])
    print(f"pipeline run (3 steps, 64x48): {time.perf_counter() - start:.3f} s")
    second = _generate(pipe, PROMPTS[1])
    assert first.shape == (64, 48, 3)
    assert first.std() > 10 and second.std() > 10
    diff = np.abs(first.astype(float) - second.astype(float)).mean()
    assert diff > 5, diff
    assert np.array_equal(first, _generate(pipe, PROMPTS[0]))


def test_building_twice_gives_identical_files(checkpoint, tmp_path):
    again = build_tiny_z_image(tmp_path / "again", seed=0)
    files = sorted(p.relative_to(checkpoint) for p in checkpoint.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again) for p in again.rglob("*") if p.is_file())
    assert {"model_index.json", "scheduler/scheduler_config.json", "text_encoder/config.json",
            "text_encoder/model.safetensors", "tokenizer/tokenizer.json",
            "transformer/diffusion_pytorch_model.safetensors",
            "vae/diffusion_pytorch_model.safetensors"} <= {str(f) for f in files}
    for f in files:
        assert (checkpoint / f).read_bytes() == (again / f).read_bytes(), f
    # another seed replaces the build in place; a complete build is reused as it is
    build_tiny_z_image(again, seed=1)
    assert ((again / "transformer/diffusion_pytorch_model.safetensors").read_bytes()
            != (checkpoint / "transformer/diffusion_pytorch_model.safetensors").read_bytes())
    stamp = (again / "vae/config.json").stat().st_mtime_ns
    build_tiny_z_image(again, seed=1)
    assert (again / "vae/config.json").stat().st_mtime_ns == stamp


def test_tokenizer_renders_qwen3_chat_template(pipe):
    tok = pipe.tokenizer
    messages = [{"role": "user", "content": "a cat"}]
    base = "<|im_start|>user\na cat<|im_end|>\n<|im_start|>assistant\n"
    render = tok.apply_chat_template
    assert render(messages, tokenize=False, add_generation_prompt=True,
                  enable_thinking=True) == base
    assert render(messages, tokenize=False, add_generation_prompt=True) == base
    assert render(messages, tokenize=False, add_generation_prompt=True,
                  enable_thinking=False) == base + "<think>\n\n</think>\n\n"
    assert render(messages, tokenize=False) == "<|im_start|>user\na cat<|im_end|>\n"
    for token in ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>"]:
        assert tok(token).input_ids == [tok.convert_tokens_to_ids(token)], token
    assert tok.pad_token == "<|endoftext|>" and tok.eos_token == "<|im_end|>"
    padded = tok([base], padding="max_length", max_length=32)
    assert padded.input_ids[0][-1] == tok.pad_token_id and padded.attention_mask[0][0] == 1


def test_our_modules_load_the_checkpoint_and_equal_the_pipelines(checkpoint, pipe):
    import json
    config = json.loads((checkpoint / "transformer/config.json").read_text())
    dit = ZImageTransformer(config).eval()
    dit.load_weights(iter_tensors(checkpoint / "transformer"))
    torch.manual_seed(0)
    latents, timestep = torch.randn(1, 16, 8, 6), torch.tensor([0.4])
    text = torch.randn(1, 11, config["cap_feat_dim"])
    with torch.no_grad():
        ours = dit(latents, timestep, text, None)
        ref = pipe.transformer([latents[0, :, None]], timestep, [text[0]],
                               return_dict=False)[0][0][:, 0]
    assert ref.std() > 0.3 and (ours[0] - ref).abs().max() < 1e-4

    vae_config = json.loads((checkpoint / "vae/config.json").read_text())
    vae = AutoencoderKLDecoder(vae_config).eval()
    vae.load_weights(iter_tensors(checkpoint / "vae"))
    with torch.no_grad():
        image = vae.decode(latents)
        cfg = pipe.vae.config
        expected = pipe.vae.decode(latents / cfg.scaling_factor + cfg.shift_factor).sample
    assert image.std() > 0.1 and (image - expected.clamp(-1, 1)).abs().max() < 1e-5
