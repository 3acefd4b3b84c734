"""torch.compile settings shared by compiled model blocks."""

from __future__ import annotations

import torch

# graphs one compiled block function may hold: a DiT block is called from several places
# (refiners, main layers), with and without a key mask, at batch 1 and dynamic batches
RECOMPILE_LIMIT = 64


def raise_recompile_limit(limit: int = RECOMPILE_LIMIT) -> None:
    """Let a compiled function keep up to `limit` graphs (torch's default, 8, is reached by a DiT
    block's variants, after which dynamo silently runs the rest eagerly)."""
    config = torch._dynamo.config
    config.cache_size_limit = max(config.cache_size_limit, limit)
