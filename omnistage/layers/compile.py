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
    restarted process (a warm start) reuses the compiled kernels: (inductor's, Triton's). Also
    pins Triton's ptxas (pin_triton_ptxas)."""
    dirs = env.compile_cache_dirs()
    pin_triton_ptxas()
    return dirs


# NOTE (why): Triton keys a compiled kernel with its ptxas's `--version`, read once per process
# at its first compile, and inductor points Triton at torch's own ptxas (TRITON_PTXAS_PATH,
# inherited by processes spawned later) at inductor's first compile. So a kernel got one key in
# a process spawned before that (Triton's bundled ptxas) and another in one spawned after it:
# on the H200, BigVGAN's Snake variants compiled ahead (engine/kernels_ahead.py) by processes
# spawned after the thinker's first compile all missed the cache, and the vocoder compiled
# them again (5 variants, ~30 s of a cold start). Pinned before the first compile, every
# process of the pipeline hashes with the same ptxas, the one inductor would have chosen.
def pin_triton_ptxas() -> None:
    """Point Triton at the ptxas torch.compile would (its own, where the wheel ships one),
    now rather than at inductor's first compile. A no-op where the user set
    TRITON_PTXAS_PATH, or where torch has no such rule."""
    from torch._inductor.runtime import compile_tasks
    pin = getattr(compile_tasks, "_set_triton_ptxas_path", None)
    if pin is not None:
        pin()
