"""Tiny Qwen3-Omni checkpoints (released layout), built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_qwen3_omni_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Instruct layout: thinker + talker + code2wav, `enable_audio_output: true`."""
    from omnistage.testing.tiny_qwen3_omni import build_tiny_qwen3_omni
    return build_tiny_qwen3_omni(tmp_path_factory.mktemp("tiny_qwen3_omni") / "ckpt", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3_omni_thinking_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Thinking / Captioner layout: thinker weights only, `enable_audio_output: false`."""
    from omnistage.testing.tiny_qwen3_omni import build_tiny_qwen3_omni
    return build_tiny_qwen3_omni(tmp_path_factory.mktemp("tiny_qwen3_omni_thinking") / "ckpt",
                                 talker=False, seed=0)
