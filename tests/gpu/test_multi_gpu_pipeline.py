"""Stages on separate GPUs of one host (fp32, tiny Qwen2.5-Omni): the thinker on cuda:0 and the
talker and code2wav on cuda:1, or code2wav replicated on both GPUs, give the one-GPU pipeline's
greedy tokens and codes and its waveform; rows and codes cross between the GPUs device to device
(a peer copy, no host copy). Run on a machine with >= 2 GPUs:
  python -m pytest -q tests/gpu/test_multi_gpu_pipeline.py"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml

from omnistage import OmniLLM
from omnistage.config.schema import load_pipeline
from omnistage.runtime.stage import move_tensors
from tests.gpu.test_tiny_omni_cuda import CASES, _greedy
from omnistage.testing.tiny_omni import tiny_omni_test_messages

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


def _yaml(tmp_path, name: str, per_stage: dict[str, dict]) -> str:
    data = load_pipeline("qwen2_5_omni").model_dump(mode="json", exclude_defaults=True)
    for st in data["stages"]:
        st.update(per_stage.get(st["name"], {}))
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _run(path, pipeline: str | None):
    msgs = tiny_omni_test_messages()
    # (compile off in every stage: a cold inductor compile of each stage outlasts a test; the
    # stages still run from captured CUDA graphs)
    with OmniLLM(str(path), device="cuda:0", dtype="float32", block_size=8,
                 pipeline=pipeline, compile=False, code2wav_compile=False) as llm:
        outs = llm.generate([{"messages": msgs[c]} for c in CASES], _greedy(), use_tqdm=False)
        devices = {n: str(w.device) for n, w in llm.pipeline.workers.items()}
        replicas = llm.runtime.replica_stats()
    return outs, devices, replicas


@pytest.fixture(scope="module")
def fp32():
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture(scope="module")
def one_gpu(tiny_omni_dir, fp32):
    return _run(tiny_omni_dir, None)[0]


def _same(ref, got) -> None:
    for case, a, b in zip(CASES, ref, got, strict=True):
        assert a.error is None and b.error is None, (case, a.error, b.error)
        assert len(set(a.token_ids)) > 2 and len(a.stages["talker"].token_ids) > 4, case
        assert b.token_ids == a.token_ids, case
        assert b.stages["talker"].token_ids == a.stages["talker"].token_ids, case
        assert a.audio is not None and np.abs(a.audio).max() > 1e-3, case  # not silence
        assert b.audio.shape == a.audio.shape, case
        assert np.abs(b.audio - a.audio).max() < 1e-4 * max(1.0, np.abs(a.audio).max()), case


def test_thinker_gpu0_talker_code2wav_gpu1(tiny_omni_dir, tmp_path, one_gpu):
    pipeline = _yaml(tmp_path, "split", {"thinker": {"device": "cuda:0"},
                                         "talker": {"device": "cuda:1"},
                                         "code2wav": {"device": "cuda:1"}})
    got, devices, _ = _run(tiny_omni_dir, pipeline)
    assert devices == {"thinker": "cuda:0", "talker": "cuda:1", "code2wav": "cuda:1"}
    _same(one_gpu, got)


def test_code2wav_replica_per_gpu(tiny_omni_dir, tmp_path, one_gpu):
    pipeline = _yaml(tmp_path, "replicas",
                     {"code2wav": {"replicas": 2, "devices": ["cuda:0", "cuda:1"]}})
    got, devices, replicas = _run(tiny_omni_dir, pipeline)
    assert devices["code2wav/0"] == "cuda:0" and devices["code2wav/1"] == "cuda:1"
    assert all(s["steps"] > 0 for s in replicas["code2wav"]), replicas  # both served
    _same(one_gpu, got)


def test_rows_move_device_to_device():
    """move_tensors (the link between stages) copies GPU to GPU: the profiler sees a
    peer/device copy and no copy through the host."""
    from torch.profiler import ProfilerActivity, profile
    rows = {"hidden": torch.randn(64, 3584, device="cuda:0", dtype=torch.bfloat16),
            "codes": torch.arange(24, device="cuda:0")}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        moved = move_tensors(rows, torch.device("cuda:1"))
        torch.cuda.synchronize("cuda:0")
        torch.cuda.synchronize("cuda:1")
    assert moved["hidden"].device == torch.device("cuda:1")
    assert torch.equal(moved["hidden"].cpu(), rows["hidden"].cpu())
    names = [e.name for e in prof.events()]
    copies = [n for n in names if "Memcpy" in n]
    assert copies and not any("DtoH" in n or "HtoD" in n for n in copies), copies
