"""The tiny Qwen2.5-Omni checkpoint in fp32 on CUDA (Triton attention, compiled layers, CUDA
graphs, encoders, talker, code2wav) gives the CPU path's greedy text tokens and codes, and the
same waveform, for prompts with text, audio and image inputs batched together.
(tests/engine/test_cuda_graphs.py covers the engine alone on a plain LM and a talker-like model.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from omnistage import OmniLLM, SamplingParams
from omnistage.testing.tiny_omni import TINY_TALKER_EOS, tiny_omni_test_messages

CASES = ["text_only", "audio_text", "image_text", "multi_turn"]


def _greedy() -> dict[str, SamplingParams]:
    return {"thinker": SamplingParams(temperature=0, max_tokens=12, seed=5),
            "talker": SamplingParams(temperature=0, repetition_penalty=1.05, min_tokens=24,
                                     max_tokens=40, stop_token_ids=TINY_TALKER_EOS,
                                     suppress_token_ids=[121])}


def _run(path, device: str):
    msgs = tiny_omni_test_messages()
    llm = OmniLLM(str(path), device=device, dtype="float32", block_size=8)
    return llm.generate([{"messages": msgs[c]} for c in CASES], _greedy(), use_tqdm=False)


@pytest.mark.gpu
def test_tiny_omni_fp32_cuda_matches_cpu(tiny_omni_dir):
    ref = _run(tiny_omni_dir, "cpu")
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False  # true fp32
    try:
        got = _run(tiny_omni_dir, "cuda")
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
    for case, a, b in zip(CASES, ref, got):
        assert a.error is None and b.error is None, (case, a.error, b.error)
        assert len(set(a.token_ids)) > 2 and len(a.stages["talker"].token_ids) > 4, case
        assert b.token_ids == a.token_ids, case
        assert b.stages["talker"].token_ids == a.stages["talker"].token_ids, case
        assert a.audio is not None and np.abs(a.audio).max() > 1e-3, case  # non-trivial audio
        assert b.audio.shape == a.audio.shape, case
        assert np.abs(b.audio - a.audio).max() < 1e-3 * max(1.0, np.abs(a.audio).max()), case
