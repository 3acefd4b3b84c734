"""Constructor options shared by OmniLLM and AsyncOmniLLM: device, dtype, engine settings."""

from __future__ import annotations

import torch

from omnistage.engine.ar.scheduler import EngineConfig

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def resolve_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device: {device!r} is not a device ({e})") from e
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device: {device!r}; expected 'cpu' or 'cuda[:N]'")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device: 'cuda' requested but no CUDA GPU is available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device: {device!r}; only {torch.cuda.device_count()} GPU(s)")
    return dev


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r}; expected 'auto' or one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def engine_config(model_max_len: int, *, max_model_len: int | None = None,
                  max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                  block_size: int | None = None, num_kv_blocks: int | None = None,
                  kv_cache_memory_fraction: float | None = None,
                  enable_prefix_caching: bool = True,
                  enable_chunked_prefill: bool = True) -> EngineConfig:
    def pick(value, default):
        return default if value is None else value

    max_len = pick(max_model_len, min(model_max_len, 32768))
    if isinstance(max_len, int) and max_len > model_max_len:
        raise ValueError(f"max_model_len: {max_len} exceeds the model's "
                         f"max_position_embeddings {model_max_len}")
    default_budget = max_len if not enable_chunked_prefill else 2048
    cfg = EngineConfig(
        max_model_len=max_len, max_num_seqs=pick(max_num_seqs, 64),
        max_num_batched_tokens=pick(max_num_batched_tokens, default_budget),
        block_size=pick(block_size, 16), num_kv_blocks=num_kv_blocks,
        kv_cache_memory_fraction=kv_cache_memory_fraction,
        enable_prefix_caching=bool(enable_prefix_caching),
        enable_chunked_prefill=bool(enable_chunked_prefill))
    cfg.validate()
    return cfg
