"""torch.compile settings shared by compiled model blocks."""

from __future__ import annotations

import torch

from omnistage.config import env

# graphs one compiled block function may hold: a DiT block is called from several places
# (refiners, main layers), with and without a key mask, at batch 1 and dynamic batches
RECOMPILE_LIMIT = 64


def raise_recompile_limit(limit: int = RECOMPILE_LIMIT) -> None:
    """Let a compiled function keep up to `limit` graphs (torch's default, 8, is reached by a DiT
    block's variants, after which dynamo silently runs the rest eagerly)."""
    config = torch._dynamo.config
    config.cache_size_limit = max(config.cache_size_limit, limit)


def persist_compile_caches() -> tuple[str, str]:
    """Keep inductor's and Triton's caches under omnistage's cache dir (config/env.py), so a
    restarted process (a warm start) reuses the compiled kernels: (inductor's, Triton's)."""
    return env.compile_cache_dirs()
