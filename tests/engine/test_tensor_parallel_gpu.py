"""Tensor parallelism on 2 GPUs (NCCL, fp32): TP=2 gives TP=1's greedy tokens (near-tie rule)
for the tiny Qwen2 and the tiny Qwen3-Omni thinker (MoE, router-gap rule), each rank's decode
step replayed from one captured CUDA graph with its all-reduces (and the logits all-gather)
inside, steps launched ahead included. Run on a machine with >= 2 GPUs:
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
