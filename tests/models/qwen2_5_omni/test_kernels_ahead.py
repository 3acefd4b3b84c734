"""Code2wav's Triton kernels compiled ahead (engine/kernels_ahead.py): the BigVGAN Snake shapes
its warm-up launches, the variants listed for them, and a variant compiled ahead in a process of
its own under the cache key that the real launch computes (Triton compiles for an sm_90 target
on the CPU: no GPU is needed to compile)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from omnistage.engine.gen import GenEngineConfig
from omnistage.engine.gen.graphs import BUCKETS
from omnistage.engine.kernels_ahead import KernelJob, KernelsAhead
from omnistage.models.qwen2_5_omni.code2wav_options import Qwen2_5OmniCode2WavOptions
from omnistage.models.qwen2_5_omni.code2wav_plan import vocoder_lengths
from omnistage.models.qwen2_5_omni.code2wav_stage import code2wav_kernels_ahead
from omnistage.models.qwen2_5_omni.token2wav_bigvgan import (BigVGANLayout,
                                                             Qwen2_5OmniAntiAliasedSnake,
                                                             Qwen2_5OmniToken2WavBigVGAN)

TINY_BIGVGAN = dict(mel_dim=20, upsample_initial_channel=32, resblock_kernel_sizes=[3, 5],
                    resblock_dilation_sizes=[[1, 3, 5], [1, 3, 5]], upsample_rates=[5, 3, 2],
                    upsample_kernel_sizes=[11, 7, 4])
SM90 = ("cuda", 90, 32)


def test_snake_shapes_are_the_vocoders() -> None:
    """BigVGANLayout.snake_shapes = the inputs every anti-aliased Snake of forward() sees."""
    voc = Qwen2_5OmniToken2WavBigVGAN(TINY_BIGVGAN).eval()
    seen: set[tuple[int, ...]] = set()
    for m in voc.modules():
        if isinstance(m, Qwen2_5OmniAntiAliasedSnake):
            m.register_forward_pre_hook(lambda _, args: seen.add(tuple(args[0].shape)))
    for batch, frames in ((1, 7), (3, 12)):
        seen.clear()
        with torch.no_grad():
            voc(torch.randn(batch, 20, frames))
        assert seen == BigVGANLayout.from_config(TINY_BIGVGAN).snake_shapes(batch, frames)
        assert len(seen) == 3  # one per upsample stage (the final activation: the last one's)


def _ctx(bigvgan_triton: str = "auto", device: str = "cuda") -> SimpleNamespace:
    return SimpleNamespace(
        device=torch.device(device), dtype=torch.bfloat16, stage=SimpleNamespace(dtype="auto"),
        config={"token2wav_config": {"bigvgan_config": {}, "dit_config": {}}},
        options={"code2wav": (GenEngineConfig(),
                              Qwen2_5OmniCode2WavOptions(bigvgan_triton=bigvgan_triton))})


def test_one_job_per_variant_of_the_warmups_launches() -> None:
    pytest.importorskip("triton")
    from omnistage.models.qwen2_5_omni import bigvgan_triton
    jobs = code2wav_kernels_ahead(_ctx())
    layout = BigVGANLayout.from_config({})
    stream = Qwen2_5OmniCode2WavOptions().stream_config(torch.device("cuda"))
    launched = {bigvgan_triton.variant_key(shape, "gather")
                for bucket in BUCKETS for frames in vocoder_lengths(stream, 24)
                for shape in layout.snake_shapes(bucket, frames)}
    listed = [bigvgan_triton.variant_key(job.args[0], "gather") for job in jobs]
    assert sorted(listed) == sorted(launched) and len(launched) >= 2
    for job in jobs:  # the vocoder runs under fp16 autocast; alpha/beta stay fp32 parameters
        assert job.compile is bigvgan_triton.compile_ahead
        assert job.args[1:] == ("gather", torch.float16, torch.float32)
    assert code2wav_kernels_ahead(_ctx("off")) == []
    assert code2wav_kernels_ahead(_ctx(device="cpu")) == []


def _launch_key(shape: tuple[int, int, int]) -> str:
    """In the child: the cache key of the kernel that `anti_aliased_snake` itself compiles, as
    the module calls it, for x of this shape (fp16, the module's fp32 alpha/beta): its launch
    then fails, as the child has no GPU, after the compile."""
    from omnistage.models.qwen2_5_omni import bigvgan_triton
    x = torch.zeros(shape, dtype=torch.float16)
    params = torch.zeros(shape[1])
    try:
        bigvgan_triton.anti_aliased_snake(x, params, params, torch.zeros(12),
                                          bigvgan_triton.DEFAULT_VARIANT)
    except AttributeError:  # the stand-in driver cannot launch
        pass
    (kernel,) = bigvgan_triton._aa_snake_kernel.device_caches[0][0].values()
    return kernel.hash


def test_compiled_ahead_under_the_launchs_cache_key(tmp_path, monkeypatch) -> None:
    pytest.importorskip("triton")
    from omnistage.models.qwen2_5_omni import bigvgan_triton
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # (set by the kernel's CPU tests)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    shape = (1, 768, 220)  # a quick variant: (ROWS, BLOCK) = (4, 256)
    ahead = KernelsAhead.start({"code2wav": (SM90, [
        KernelJob(bigvgan_triton.compile_ahead, (shape, "gather", torch.float16, torch.float32)),
        KernelJob(_launch_key, (shape,))])})
    ahead_key, launch_key = ahead.wait("code2wav")
    assert ahead_key is not None and ahead_key == launch_key
    # on disk once: the launch's child found the variant compiled ahead (sm_90 code)
    assert len(list(tmp_path.glob("*/_aa_snake_kernel.cubin"))) == 1
    assert ahead.pool is None  # every unit waited for: the processes are let go


def test_a_failed_job_is_none_not_an_error(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ahead = KernelsAhead.start({"stage": (SM90, [KernelJob(_launch_key, ((0, 0, 0),))])})
    assert ahead.wait("stage") == [None]
    assert KernelsAhead.start({}).wait("stage") == []
