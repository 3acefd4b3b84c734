"""A stand-in for the thinker -> talker adapter in engine tests and benchmarks."""

from __future__ import annotations

import torch

from omnistage.models.qwen2_5_omni.talker import ALWAYS_READY


class RandomInputRows:
    """An engine InputSource of seeded random rows [4096, width]: rows of the prompt replace the
    token embeddings, later rows are added to them (as the talker's handoff does)."""

    def __init__(self, prompt_len: int, width: int, seed: int, device,
                 dtype: torch.dtype = torch.float32, scale: float = 1.0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.table = (torch.randn(4096, width, generator=g) * scale).to(device, dtype)
        self.prompt_len = prompt_len

    def ready(self, seq) -> int:
        return ALWAYS_READY

    def rows(self, seq, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        if start >= self.prompt_len:  # decode rows are only added: no mask (the engine would
            return self.table[start:end], None  # read it on the host, a device sync)
        replace = torch.arange(start, end, device=self.table.device) < self.prompt_len
        return self.table[start:end], replace
