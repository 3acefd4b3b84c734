"""The kernels-ahead ledger (engine/kernels_ledger.py): a job whose kernels the Triton cache
holds is not run again (a warm start spawns no process), and runs again once they are gone;
a damaged ledger is ignored and rewritten. Compiles for sm_90 on the CPU (no GPU needed)."""

from __future__ import annotations

import shutil

import pytest
import torch

from omnistage.engine import kernels_ledger
from omnistage.engine.kernels_ahead import KernelJob, KernelsAhead

SM90 = ("cuda", 90, 32)
SHAPE = (1, 768, 220)  # a quick variant of the BigVGAN Snake kernel


def test_cache_folder_is_tritons(tmp_path) -> None:
    cache = pytest.importorskip("triton.runtime.cache")
    key = "0f" * 32
    folder = tmp_path / cache._base32(key)  # Triton's own name for the key's folder
    folder.mkdir()
    assert not kernels_ledger.on_disk(tmp_path, key)  # (a folder Triton made, no kernel)
    (folder / "__grp___kernel.json").write_text("{}")
    assert kernels_ledger.on_disk(tmp_path, key)
    assert not kernels_ledger.on_disk(tmp_path, "not hex")
    assert kernels_ledger.result_keys(key) == [key]
    assert kernels_ledger.result_keys([key, key]) == [key, key]
    assert kernels_ledger.result_keys(None) is None and kernels_ledger.result_keys([]) is None


def test_compiled_jobs_are_not_run_again(tmp_path, monkeypatch) -> None:
    pytest.importorskip("triton")
    from omnistage.models.qwen2_5_omni import bigvgan_triton
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    job = KernelJob(bigvgan_triton.compile_ahead, (SHAPE, "gather", torch.float16,
                                                     torch.float32))

    def start() -> KernelsAhead:
        return KernelsAhead.start({"code2wav": (SM90, [job])})

    first = start()
    assert first.listed("code2wav") and first.pool is not None
    (key,) = first.wait("code2wav")
    assert key is not None and (tmp_path / kernels_ledger.LEDGER).is_file()
    again = start()  # a warm start: found compiled, no process
    assert again.pool is None and not again.listed("code2wav")
    assert again.wait("code2wav") == [key]
    from triton.runtime.cache import _base32
    shutil.rmtree(tmp_path / _base32(key))  # the kernel gone from the cache: run again
    third = start()
    assert third.listed("code2wav")
    assert third.wait("code2wav") == [key]
    (tmp_path / kernels_ledger.LEDGER).write_text("{not json")  # damaged: ignored, rewritten
    fourth = start()
    assert fourth.listed("code2wav") and fourth.wait("code2wav") == [key]
    assert start().pool is None
