"""Shared fixtures: tiny random Qwen2.5-Omni checkpoints, built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from omnistage.testing.tiny_omni import build_tiny_omni


@pytest.fixture(scope="session")
def tiny_omni_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny checkpoint with the legacy root preprocessor_config.json (the released layout)."""
    return build_tiny_omni(tmp_path_factory.mktemp("tiny_omni") / "ckpt", seed=0)


@pytest.fixture(scope="session")
def tiny_omni_v5_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same weights, processor config in transformers 5's nested processor_config.json."""
    out = tmp_path_factory.mktemp("tiny_omni_v5") / "ckpt"
    return build_tiny_omni(out, seed=0, processor_layout="v5")
