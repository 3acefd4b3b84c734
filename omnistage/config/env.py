"""The only place omnistage reads the environment, and only these three names. Behaviour is set
by typed config (pipeline YAML, constructor options, CLI flags), never by variables."""

from __future__ import annotations

import os
from pathlib import Path

API_KEY = "OMNISTAGE_API_KEY"  # the server's bearer token when --api-key is not given
CACHE_DIR = "OMNISTAGE_CACHE_DIR"  # built tiny checkpoints, converted test weights
LOG_LEVEL = "OMNISTAGE_LOG_LEVEL"  # default log level of the CLI and stage processes
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def api_key() -> str | None:
    return os.environ.get(API_KEY) or None


def cache_dir() -> Path:
    """$OMNISTAGE_CACHE_DIR, else $XDG_CACHE_HOME/omnistage, else ~/.cache/omnistage."""
    root = os.environ.get(CACHE_DIR)
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "omnistage"


def compile_cache_dirs() -> tuple[str, str]:
    """torch.compile's (inductor: FX graphs, autotuning, its Triton kernels) and Triton's
    caches under cache_dir() unless the user set them: they outlive the process and a reboot
    (inductor's default is under /tmp). Set before the first compile; stage processes inherit
    them. Returns (inductor's, Triton's)."""
    root = cache_dir()
    inductor = os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
    triton = os.environ.setdefault("TRITON_CACHE_DIR", str(root / "triton"))
    return inductor, triton


def triton_ptxas_path() -> str | None:
    """Triton's TRITON_PTXAS_PATH (set by layers/compile.pin_triton_ptxas as inductor would):
    the ptxas whose version Triton's cache keys hash, for the kernels ledger's job ids."""
    return os.environ.get("TRITON_PTXAS_PATH")


def quiet_tokenizer_threads() -> None:
    """HF tokenizers' own thread pool off unless the user set it (it warns after a fork)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def nccl_device_rules() -> None:
    """NVLink multicast off for NCCL (a rule of the lent multi-GPU machines, not a user
    setting): set before this process initialises NCCL, and inherited by the tensor-parallel
    ranks it spawns (engine/ar/tp_workers.py)."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")


def log_level(default: str = "warning") -> str:
    level = (os.environ.get(LOG_LEVEL) or default).lower()
    if level not in LOG_LEVELS:
        raise ValueError(f"{LOG_LEVEL}: {level!r}; one of {', '.join(LOG_LEVELS)}")
    return level
