"""The tp_all_reduce engine option (CPU): validated where it is typed (pipeline YAML, OmniLLM
keyword), resolved per group (gloo ranks always use the group's own all-reduce; a forced
symm_mem that cannot run fails naming the field, auto falls back to NCCL), and a gloo TP=2
stage given symm_mem runs the group's all-reduce with TP=1's tokens. The one-shot kernel itself
needs 2 GPUs: tests/engine/test_tensor_parallel_gpu.py."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from omnistage.config.schema import load_pipeline
from omnistage.layers.symm_all_reduce import ALL_REDUCE_MODES, check_mode, resolve_mode
from omnistage.runtime.build import stage_engine_config, tp_all_reduce
from tests.engine.test_tensor_parallel import first_divergence, qwen2_seqs, run_stage

CPUS = [torch.device("cpu")] * 2
GPUS = [torch.device("cuda", 0), torch.device("cuda", 1)]


def _llm_yaml(engine: dict) -> dict:
    data = load_pipeline("llm").model_dump(mode="json", exclude_defaults=True)
    data["stages"][0]["engine"] = engine
    return data


def test_yaml_validates_tp_all_reduce():
    for mode in ALL_REDUCE_MODES:
        cfg = load_pipeline(_llm_yaml({"tp_all_reduce": mode}))
        assert cfg.stages[0].engine.tp_all_reduce == mode
    with pytest.raises(ValueError, match=r"stages\.0\.engine\.tp_all_reduce"):
        load_pipeline(_llm_yaml({"tp_all_reduce": "mpi"}))
    with pytest.raises(ValueError, match=r"stages\.0\.engine\.tp_all_reduce"):
        load_pipeline(_llm_yaml({"tp_all_reduce": 1}))


def test_constructor_option_validated_and_kept_out_of_the_engine_config():
    stage = load_pipeline("llm").stages[0]
    # a valid value is the group's business: the engine config builds without it
    cfg = stage_engine_config(4096, {"tp_all_reduce": "symm_mem", "max_num_seqs": 3},
                              stage.engine)
    assert cfg.max_num_seqs == 3 and not hasattr(cfg, "tp_all_reduce")
    for bad in ("fast", "", 2):
        with pytest.raises(ValueError, match="tp_all_reduce"):
            stage_engine_config(4096, {"tp_all_reduce": bad}, stage.engine)
    with pytest.raises(ValueError, match="tp_all_reduce: 'x'; one of auto, nccl, symm_mem"):
        check_mode("x")


def test_stage_option_over_constructor_option():
    def ctx(stage_mode, wide_mode):
        engine = {} if stage_mode is None else {"tp_all_reduce": stage_mode}
        stage = load_pipeline(_llm_yaml(engine)).stages[0]
        options = {"engine": {} if wide_mode is None else {"tp_all_reduce": wide_mode}}
        return SimpleNamespace(stage=stage, options=options)
    assert tp_all_reduce(ctx(None, None)) == "auto"  # (the default)
    assert tp_all_reduce(ctx(None, "nccl")) == "nccl"
    assert tp_all_reduce(ctx("symm_mem", "nccl")) == "symm_mem"
    with pytest.raises(ValueError, match="tp_all_reduce"):
        tp_all_reduce(ctx(None, "ring"))


def test_resolve_mode(monkeypatch):
    for mode in ALL_REDUCE_MODES:  # gloo: the group's all-reduce whatever the mode
        assert resolve_mode(mode, CPUS) == "nccl"
    assert resolve_mode("nccl", GPUS) == "nccl"
    # GPUs without peer access: auto falls back, a forced symm_mem names the field
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: False)
    assert resolve_mode("auto", GPUS) == "nccl"
    with pytest.raises(ValueError, match="tp_all_reduce: 'symm_mem' cannot run here: cuda:0 "
                                         "cannot access cuda:1"):
        resolve_mode("symm_mem", GPUS)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: True)
    # (auto stays auto: one-shot for the small tensors only)
    assert resolve_mode("auto", GPUS) == "auto"
    assert resolve_mode("symm_mem", GPUS) == "symm_mem"
    with pytest.raises(ValueError, match="tp_all_reduce"):
        resolve_mode("fast", CPUS)


def test_gloo_stage_keeps_the_groups_all_reduce(tiny_qwen2):
    ref = run_stage(tiny_qwen2, "llm", "llm", 1, qwen2_seqs)
    got = run_stage(tiny_qwen2, "llm", "llm", 2, qwen2_seqs, all_reduce="symm_mem")
    assert got["all_reduce_mode"] == "nccl" and got["symm_calls"] == 0
    first_divergence(ref, got)


def test_group_shutdown_is_bounded():
    """Rank 0's side of a group closes within a bound: a shutdown that blocks (NCCL's did on 2
    H200s) raises RuntimeError naming it instead of hanging the stage's close; an error of the
    backend's own reaches the caller."""
    import time

    from omnistage.engine.ar.tp_workers import shutdown_group_bounded
    from omnistage.layers.parallel import TensorParallel

    class Backend:
        def __init__(self) -> None:
            self.release = threading.Event()

        def shutdown(self) -> None:
            self.release.wait(10)

        def abort(self) -> None:
            raise RuntimeError("communicator already gone")

    backend = Backend()
    tp = TensorParallel(0, 2, backend)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="shutdown did not finish"):
        shutdown_group_bounded(tp, timeout_s=0.2)
    assert time.monotonic() - t0 < 2
    backend.release.set()
    shutdown_group_bounded(tp, timeout_s=5)  # returns once the backend's shutdown does
    assert tp.group is None  # released: shut once
    with pytest.raises(RuntimeError, match="communicator already gone"):
        shutdown_group_bounded(TensorParallel(0, 2, backend), abort=True, timeout_s=5)


def test_rank0_releases_its_graphs_before_its_group_shuts(tiny_qwen2, monkeypatch):
    """ModelRunner.close on rank 0: its captured graphs are destroyed before its side of the
    group shuts (NCCL's teardown waits for graphs holding its collectives), once."""
    from omnistage.engine.ar import model_runner as runner_mod
    from omnistage.engine.ar import tp_workers as tp_mod
    calls: list[str] = []
    release = runner_mod.ModelRunner.release_graphs
    shutdown = tp_mod.shutdown_group_bounded

    def record_release(self):
        calls.append("release")
        release(self)

    def record_shutdown(tp, *args, **kwargs):
        calls.append("shutdown")
        shutdown(tp, *args, **kwargs)
    monkeypatch.setattr(runner_mod.ModelRunner, "release_graphs", record_release)
    monkeypatch.setattr(tp_mod, "shutdown_group_bounded", record_shutdown)
    got = run_stage(tiny_qwen2, "llm", "llm", 2, qwen2_seqs)  # (closes its runner)
    assert got["tokens"] and calls == ["release", "shutdown"]


def test_symm_close_unregisters_the_group():
    """close() takes the group out of c10d's registry (a C++ static that otherwise keeps the
    closed group's NCCL backend alive to the process's end) and drops the peer buffer;
    idempotent.
    A gloo-less ProcessGroup on a HashStore stands in for the NCCL one here (CPU)."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import _register_process_group, _resolve_process_group

    from omnistage.layers.symm_all_reduce import SymmAllReduce
    name = "omnistage-test-symm-close"
    group = dist.ProcessGroup(dist.HashStore(), 0, 1)
    _register_process_group(name, group)
    assert _resolve_process_group(name) is not None
    symm = object.__new__(SymmAllReduce)  # (its real build needs CUDA peers)
    symm.group_name, symm.process_group, symm.handle, symm.buffer = name, group, object(), object()
    symm.close()
    assert symm.handle is None and symm.buffer is None and symm.process_group is None
    with pytest.raises(RuntimeError, match="Could not resolve"):
        _resolve_process_group(name)
    symm.close()  # a second close is a no-op
