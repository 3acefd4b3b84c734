"""Tensor parallelism on 2 GPUs (NCCL, fp32): TP=2 gives TP=1's greedy tokens (near-tie rule)
for the tiny Qwen2, the tiny Qwen3-Omni thinker (MoE, router-gap rule) and the tiny Qwen2.5-Omni
talker, each rank's decode step replayed from one captured CUDA graph with its all-reduces (and
the logits all-gather) inside, steps launched ahead included; the one-shot all-reduce over
symmetric memory (tp_all_reduce "symm_mem") equals NCCL's, eagerly and replayed from a captured
graph, and TP=2 decode under CUDA graphs gives the same tokens with it as with NCCL. Run on a
machine with >= 2 GPUs:
  python -m pytest -q tests/engine/test_tensor_parallel_gpu.py
(the launcher sets NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 for its ranks)."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest
import torch

try:
    import soundfile  # noqa: F401
except ImportError:  # the GPU machines lack it; these tests read no audio files
    sys.modules["soundfile"] = types.ModuleType("soundfile")
    sys.modules["soundfile"].__spec__ = importlib.machinery.ModuleSpec("soundfile", None)

from tests.engine.test_tensor_parallel import (  # noqa: E402
    assert_router_close, assert_shares, first_divergence, omni_seqs, qwen2_seqs, run_stage)
from omnistage.layers.symm_all_reduce import unavailable_reason  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]
GPUS = ("cuda:0", "cuda:1")


def _check_graphed(got: dict) -> None:
    assert got["graph_forwards"] > 0 and got["graph_runs"] > 0, "no decode step was graphed"


def test_qwen2_tp2_cuda_graphs(tiny_qwen2):
    ref = run_stage(tiny_qwen2, "llm", "llm", 1, qwen2_seqs, graphs="auto", devices=GPUS[:1])
    got = run_stage(tiny_qwen2, "llm", "llm", 2, qwen2_seqs, graphs="auto", devices=GPUS)
    _check_graphed(ref)
    _check_graphed(got)
    assert got["ahead"] > 0  # steps launched ahead: ids sampled on rank 0's GPU, broadcast
    first_divergence(ref, got)
    assert_shares(ref, got, 2)


def test_qwen3_omni_thinker_tp2_cuda_graphs(tiny_qwen3_omni_dir):
    from omnistage.models.qwen3_omni.processor import Qwen3OmniInputProcessor
    from omnistage.models.qwen3_omni.thinker import thinker_sequence
    make = omni_seqs(Qwen3OmniInputProcessor, thinker_sequence)
    make.path = tiny_qwen3_omni_dir
    ref = run_stage(tiny_qwen3_omni_dir, "qwen3_omni", "thinker", 1, make, graphs="auto",
                    record_router=True, devices=GPUS[:1])
    got = run_stage(tiny_qwen3_omni_dir, "qwen3_omni", "thinker", 2, make, graphs="auto",
                    record_router=True, devices=GPUS)
    _check_graphed(got)
    assert_router_close(ref, got, first_divergence(ref, got))
    assert_shares(ref, got, 2)


# ------------------------------------------------------------------------- symm_mem all-reduce
def _symm_rank(rank: int, port: int) -> None:
    """One rank: the same tensors all-reduced by NCCL and by the one-shot kernel, eagerly and
    from a captured graph (every rank checks its own results)."""
    from omnistage.config import env
    from omnistage.layers.parallel import new_group
    env.nccl_device_rules()
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    tp = new_group("nccl", rank, 2, "127.0.0.1", port, 120.0, "symm_mem", device)
    assert tp.all_reduce_mode == "symm_mem"
    g = torch.Generator(device=device).manual_seed(1 + rank)
    for dtype in (torch.float32, torch.bfloat16):
        for shape in ((1, 2048), (7, 2048), (32, 4096), (3, 64)):
            x = torch.randn(shape, generator=g, device=device).to(dtype)
            want = x.clone()
            tp.group.allreduce([want]).wait()
            calls = tp.symm.num_calls
            got = tp.all_reduce(x.clone())
            assert tp.symm.num_calls == calls + 1  # (the one-shot path, not NCCL's)
            if dtype == torch.float32:  # two ranks: a + b either way, rounded once
                torch.testing.assert_close(got, want, atol=0, rtol=0)
            else:  # (bf16: either rounding of the sum may be taken: one ulp, rarely)
                torch.testing.assert_close(got, want, atol=1e-6, rtol=2 ** -7)
                assert (got == want).float().mean() > 0.999
    # inside a captured graph: new inputs each replay
    static = torch.zeros(4, 2048, device=device)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = tp.all_reduce(static.clone() * 2)  # warm-up, outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tp.all_reduce(static * 2)
    for _ in range(3):
        static.copy_(torch.randn(4, 2048, generator=g, device=device))
        graph.replay()
        want = static * 2
        tp.group.allreduce([want]).wait()
        torch.testing.assert_close(out, want, atol=0, rtol=0)
    torch.cuda.synchronize()
    tp.group.abort()  # (as shutdown_group does for NCCL: see omnistage/engine/ar/tp_workers.py)


def test_symm_mem_all_reduce_equals_nccl():
    import torch.multiprocessing as tmp

    from omnistage.engine.ar.tp_workers import _free_port
    reason = unavailable_reason([torch.device(d) for d in GPUS])
    if reason is not None:
        pytest.skip(reason)
    tmp.spawn(_symm_rank, args=(_free_port("127.0.0.1"),), nprocs=2)


@pytest.mark.parametrize("mode", ["symm_mem", "auto"])
def test_qwen2_tp2_cuda_graphs_symm_mem_equals_nccl(tiny_qwen2, mode):
    reason = unavailable_reason([torch.device(d) for d in GPUS])
    if reason is not None:
        pytest.skip(reason)
    ref = run_stage(tiny_qwen2, "llm", "llm", 2, qwen2_seqs, graphs="auto", devices=GPUS,
                    all_reduce="nccl")
    got = run_stage(tiny_qwen2, "llm", "llm", 2, qwen2_seqs, graphs="auto", devices=GPUS,
                    all_reduce=mode)
    _check_graphed(got)
    assert ref["all_reduce_mode"] == "nccl" and ref["symm_calls"] == 0
    assert got["all_reduce_mode"] == "symm_mem" and got["symm_calls"] > 0
    assert got["ahead"] > 0
    first_divergence(ref, got)


def test_qwen3_omni_thinker_tp2_cuda_graphs_symm_mem(tiny_qwen3_omni_dir):
    from omnistage.models.qwen3_omni.processor import Qwen3OmniInputProcessor
    from omnistage.models.qwen3_omni.thinker import thinker_sequence
    reason = unavailable_reason([torch.device(d) for d in GPUS])
    if reason is not None:
        pytest.skip(reason)
    make = omni_seqs(Qwen3OmniInputProcessor, thinker_sequence)
    make.path = tiny_qwen3_omni_dir
    ref = run_stage(tiny_qwen3_omni_dir, "qwen3_omni", "thinker", 2, make, graphs="auto",
                    record_router=True, devices=GPUS, all_reduce="nccl")
    got = run_stage(tiny_qwen3_omni_dir, "qwen3_omni", "thinker", 2, make, graphs="auto",
                    record_router=True, devices=GPUS, all_reduce="symm_mem")
    _check_graphed(got)
    assert got["symm_calls"] > 0
    assert_router_close(ref, got, first_divergence(ref, got))


def test_qwen2_5_omni_talker_tp2_cuda_graphs(tiny_omni_dir):
    """The Qwen2.5-Omni talker at TP=2 under CUDA graphs (decode steps add the thinker's rows,
    carried in the graph step messages): TP=1's codes (near-tie rule), 1/TP shares."""
    from tests.engine.test_tensor_parallel_talker import talker_seqs
    ref = run_stage(tiny_omni_dir, "qwen2_5_omni", "talker", 1, talker_seqs(tiny_omni_dir),
                    graphs="auto", devices=GPUS[:1])
    got = run_stage(tiny_omni_dir, "qwen2_5_omni", "talker", 2, talker_seqs(tiny_omni_dir),
                    graphs="auto", devices=GPUS)
    _check_graphed(got)
    first_divergence(ref, got)
    assert_shares(ref, got, 2)
