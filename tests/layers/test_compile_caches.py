"""Compile caches that outlive the process (layers/compile.persist_compile_caches): where they
live, and the ptxas that every process of a pipeline compiles Triton kernels with."""

import os


def test_compile_caches_live_under_omnistage_cache_dir(tmp_path, monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import cache_dir, triton_cache_dir

    from omnistage.layers.compile import persist_compile_caches
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMNISTAGE_CACHE_DIR", str(tmp_path))
    inductor, triton = persist_compile_caches()
    assert (inductor, triton) == (str(tmp_path / "inductor"), str(tmp_path / "triton"))
    assert cache_dir() == inductor and triton_cache_dir(0) == triton  # what torch will use
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))  # the user's wins
    assert persist_compile_caches()[0] == str(tmp_path / "mine")


def test_triton_ptxas_is_pinned_before_the_first_compile(tmp_path, monkeypatch):
    # inductor's rule (torch's own ptxas) applied when the caches are set, not at inductor's
    # first compile: processes spawned after that (kernels compiled ahead) inherit the same
    # ptxas, whose version Triton's cache keys hash (layers/compile.py's note)
    from torch._inductor.runtime import compile_tasks

    from omnistage.engine.kernels_ledger import job_id
    from omnistage.layers.compile import persist_compile_caches
    monkeypatch.delenv("TRITON_PTXAS_PATH", raising=False)
    monkeypatch.setenv("OMNISTAGE_CACHE_DIR", str(tmp_path))
    unpinned = job_id(job_id, (), ("cuda", 90, 32))
    torch_ptxas = str(tmp_path / "torch_bin_ptxas")
    monkeypatch.setattr(compile_tasks, "_set_triton_ptxas_path",
                        lambda: os.environ.setdefault("TRITON_PTXAS_PATH", torch_ptxas))
    persist_compile_caches()
    assert os.environ["TRITON_PTXAS_PATH"] == torch_ptxas
    assert job_id(job_id, (), ("cuda", 90, 32)) != unpinned  # the ledger tells them apart
