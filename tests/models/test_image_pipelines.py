"""Qwen-Image and Z-Image pipelines end to end against diffusers (the oracle): tiny random
checkpoints in diffusers' released layout, fp32, CPU. Images equal diffusers' within uint8
max abs diff 2 and mean 0.5, for several prompts, sizes (non-square), seeds, with and without
CFG, n = 2; requests that join at different steps share steps and equal each alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnistage import DiffusionParams, OmniLLM

pytest.importorskip("diffusers")

MAX_DIFF, MEAN_DIFF = 2, 0.5


BUILDERS = {"qwen_image": ("omnistage.testing.tiny_qwen_image", "build_tiny_qwen_image"),
            "z_image": ("omnistage.testing.tiny_z_image", "build_tiny_z_image")}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> its tiny checkpoint folder, built on first use."""
    import importlib

    class Built(dict):
        def __missing__(self, family: str):
            module, name = BUILDERS[family]
            build = getattr(importlib.import_module(module), name)
            self[family] = build(tmp_path_factory.mktemp(family) / "ckpt")
            return self[family]
    return Built()


@pytest.fixture(scope="module")
def engines(checkpoints):
    class Engines(dict):
        def __missing__(self, family: str):
            self[family] = OmniLLM(model=str(checkpoints[family]), device="cpu")
            return self[family]
    llms = Engines()
    yield llms
    for llm in llms.values():
        llm.shutdown()


def reference(family: str, path, prompt: str, p: DiffusionParams) -> np.ndarray:
    """diffusers' images (uint8 [n, H, W, 3]) for the same request."""
    from diffusers import QwenImagePipeline, ZImagePipeline
    cls = QwenImagePipeline if family == "qwen_image" else ZImagePipeline
    pipe = _pipelines.get(family)
    if pipe is None:
        pipe = _pipelines[family] = cls.from_pretrained(str(path), dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
    kwargs = dict(prompt=prompt, height=p.height, width=p.width,
                  num_inference_steps=p.num_inference_steps, num_images_per_prompt=p.num_images,
                  generator=torch.Generator("cpu").manual_seed(p.seed), output_type="np")
    if family == "qwen_image":
        kwargs.update(true_cfg_scale=p.true_cfg_scale or 1.0,
                      negative_prompt=p.negative_prompt)
    else:
        kwargs.update(guidance_scale=p.guidance_scale or 0.0,
                      negative_prompt=p.negative_prompt)
    images = pipe(**kwargs).images
    return (images * 255).round().astype(np.uint8)


_pipelines: dict = {}


def ours(llm: OmniLLM, prompt: str, p: DiffusionParams) -> np.ndarray:
    [out] = llm.generate(prompt, p, use_tqdm=False)
    assert out.error is None, out.error
    assert len(out.images) == p.num_images
    for img in out.images:
        assert img.size == (p.width, p.height) and img.mode == "RGB"
    return np.stack([np.asarray(img) for img in out.images])


def assert_close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    # not degenerate: a flat image would make any comparison pass
    assert want.astype(np.float32).std() > 10, "the tiny model's image is flat"
    diff = np.abs(got.astype(np.int16) - want.astype(np.int16))
    assert diff.max() <= MAX_DIFF and diff.mean() <= MEAN_DIFF, (diff.max(), diff.mean())


QWEN_CASES = [
    ("a red cube on a wooden table", DiffusionParams(64, 64, 3, seed=0)),
    ("a cat in the snow", DiffusionParams(48, 80, 4, true_cfg_scale=4.0,
                                         negative_prompt="blurry", seed=7)),
    ("two boats at dawn", DiffusionParams(64, 48, 3, true_cfg_scale=2.5, negative_prompt=" ",
                                         num_images=2, seed=123)),
]
Z_CASES = [
    ("a red cube on a wooden table", DiffusionParams(64, 64, 3, seed=0)),
    ("a cat in the snow", DiffusionParams(48, 80, 4, guidance_scale=3.0, seed=7)),
    ("two boats at dawn", DiffusionParams(64, 48, 3, guidance_scale=2.0,
                                         negative_prompt="ugly", num_images=2, seed=123)),
]


@pytest.mark.parametrize("family,prompt,params",
                         [("qwen_image", *c) for c in QWEN_CASES]
                         + [("z_image", *c) for c in Z_CASES])
def test_equals_diffusers(engines, checkpoints, family, prompt, params):
    path = checkpoints[family]
    assert_close(ours(engines[family], prompt, params), reference(family, path, prompt, params))


@pytest.mark.parametrize("family", ["qwen_image", "z_image"])
def test_prompts_matter(engines, family):
    """The tiny models are prompt-sensitive (else prompt handling could be wrong unseen)."""
    p = DiffusionParams(64, 64, 3, seed=0)
    a = ours(engines[family], "a red cube on a wooden table", p).astype(np.float32)
    b = ours(engines[family], "an orange sunset over the sea", p).astype(np.float32)
    assert np.abs(a - b).mean() > 5


@pytest.mark.parametrize("family", ["qwen_image", "z_image"])
def test_requests_joining_at_different_steps(engines, family):
    """A request that arrives while another denoises joins its batch between steps: they share
    steps, and each image equals that request run alone."""
    llm = engines[family]
    cfg = {"true_cfg_scale": 3.0} if family == "qwen_image" else {"guidance_scale": 3.0}
    params = [DiffusionParams(64, 48, 6, seed=1),
              DiffusionParams(64, 48, 5, negative_prompt="dark", seed=2, **cfg),
              DiffusionParams(64, 48, 4, num_images=2, seed=3)]
    prompts = ["a lighthouse", "a forest path", "a bowl of fruit"]
    alone = [ours(llm, pr, p) for pr, p in zip(prompts, params)]
    reqs = llm._prepare(prompts, params, None)
    done: dict[str, object] = {}
    progress: dict[str, int] = {}

    def sink(out) -> None:
        if out.progress is not None:
            progress[out.request_id] = out.progress[0]
        if out.finished:
            done[out.request_id] = out

    worker = llm.pipeline.workers[llm.stage_names[1]]
    shared_before = worker.shared_steps
    llm.runtime.submit(reqs[0], sink)
    llm.runtime.run_until(lambda: progress.get(reqs[0].request_id, 0) >= 2)
    llm.runtime.submit(reqs[1], sink)
    llm.runtime.run_until(lambda: progress.get(reqs[1].request_id, 0) >= 1)
    llm.runtime.submit(reqs[2], sink)
    llm.runtime.run_until(lambda: len(done) == 3)
    assert worker.shared_steps - shared_before >= 3
    for r, want in zip(reqs, alone):
        out = done[r.request_id]
        assert out.error is None
        got = np.stack([np.asarray(img) for img in out.images])
        assert_close(got, want)


@pytest.mark.parametrize("family", ["qwen_image", "z_image"])
def test_bad_params_name_the_field(engines, family):
    llm = engines[family]
    for params, field in [(DiffusionParams(60, 64), "height"), (DiffusionParams(64, 0), "width"),
                          (DiffusionParams(64, 64, 0), "num_inference_steps"),
                          (DiffusionParams(64, 64, 10**9), "num_inference_steps"),
                          (DiffusionParams(64, 64, num_images=0), "num_images"),
                          (DiffusionParams(64, 64, num_images=99), "num_images"),
                          (DiffusionParams(64, 64, seed=2**70), "seed"),
                          (DiffusionParams(8192, 8192), "height")]:
        with pytest.raises(ValueError, match=f"sampling_params.{field}"):
            llm.generate("x", params, use_tqdm=False)
    wrong = ({"guidance_scale": 3.0} if family == "qwen_image" else {"true_cfg_scale": 3.0})
    with pytest.raises(ValueError, match=f"sampling_params.{next(iter(wrong))}"):
        llm.generate("x", DiffusionParams(64, 64, **wrong), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate({"prompt": "x", "multi_modal_data": {}}, DiffusionParams(64, 64))


def test_engine_options_are_checked(checkpoints):
    with pytest.raises(ValueError, match="dit_compile"):
        OmniLLM(model=str(checkpoints["z_image"]), device="cpu", dit_compile="yes")
    with pytest.raises(ValueError, match="max_num_seqs"):
        OmniLLM(model=str(checkpoints["z_image"]), device="cpu", max_num_seqs=4)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen_image", "z_image"])
def test_compiled_blocks_equal_eager_on_gpu(checkpoints, family):
    """CUDA: compiled (the default, warmed up at build) and eager blocks give the same image."""
    p = DiffusionParams(64, 48, 3, true_cfg_scale=3.0 if family == "qwen_image" else None,
                        guidance_scale=None if family == "qwen_image" else 2.0,
                        negative_prompt="dark", seed=0)
    images = []
    for compiled in (False, True):
        with OmniLLM(model=str(checkpoints[family]), device="cuda", dtype="float32",
                     dit_compile=compiled) as llm:
            images.append(ours(llm, "a lighthouse", p))
    diff = np.abs(images[0].astype(np.int16) - images[1].astype(np.int16))
    assert diff.max() <= MAX_DIFF and diff.mean() <= MEAN_DIFF


def test_async_reports_progress(checkpoints):
    """AsyncOmniLLM yields (steps done, steps) while it denoises, then the images."""
    import asyncio

    from omnistage import AsyncOmniLLM

    async def run() -> list:
        async with AsyncOmniLLM(model=str(checkpoints["z_image"]), device="cpu") as llm:
            return [out async for out in llm.generate(
                "a lighthouse", DiffusionParams(64, 48, 4, num_images=2, seed=5))]

    outs = asyncio.run(run())
    steps = [o.progress for o in outs if not o.finished]
    assert steps == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert outs[-1].finished and outs[-1].error is None and len(outs[-1].images) == 2
    assert all(not o.images for o in outs[:-1])


@pytest.mark.parametrize("family", ["qwen_image", "z_image"])
def test_first_block_split_equals_predict(engines, family):
    """The step cache's split (first -> rest on some rows -> finish) equals predict, padded
    texts and a row subset in another order included."""
    network = engines[family].pipeline.workers["dit"].model.network
    latents, t, text, mask, grid = network.example(3, 9, 64, True)
    t = torch.tensor([900.0, 500.0, 100.0])
    want = network.predict(latents, t, text, mask, grid)
    state, probe = network.first(latents, t, text, mask, grid)
    assert probe.abs().mean() > 0
    torch.testing.assert_close(network.finish(state, network.rest(state, None)), want)
    rows = torch.tensor([2, 0])
    full = network.rest(state, None)
    torch.testing.assert_close(network.rest(state, rows), full[rows])


def test_step_cache_option(checkpoints):
    with pytest.raises(ValueError, match="step_cache"):
        OmniLLM(model=str(checkpoints["qwen_image"]), device="cpu", step_cache=2.0)
    llm = OmniLLM(model=str(checkpoints["qwen_image"]), device="cpu", step_cache=1e-9)
    p = DiffusionParams(64, 48, 3, seed=4)
    assert_close(ours(llm, "a lighthouse", p), reference("qwen_image", checkpoints["qwen_image"],
                                                         "a lighthouse", p))
    llm.shutdown()


def test_megapixels_per_request_are_bounded(engines):
    """n x size is bounded (8 megapixels): 8 images of 2048x2048 would not fit a step."""
    with pytest.raises(ValueError, match="sampling_params.num_images"):
        engines["z_image"].generate("x", DiffusionParams(2048, 2048, num_images=3))
