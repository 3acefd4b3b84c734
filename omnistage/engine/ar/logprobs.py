"""Per-token logprobs (SamplingParams.logprobs) of the rows that ask, on the device.

They are vLLM's "processed_logprobs": the log-softmax of sampler.processed_logits (the
distribution the token is drawn from; greedy rows: the penalised logits). Each asking row
gives its emitted token's logprob and its top K; the host keeps each row's own k of them.

NOTE: row_logprobs runs before the step's draw, as it must read the output counts the draw
then updates (penalties); pack() runs after it, on the drawn (or forced) ids. Only the asking
rows are gathered ([L, V], L = rows that ask): a step without them runs none of this. On the
Triton path the processing is the torch reference's, on the same rows and params: equal
values, and a draw the kernels make at a near tie of a top-p cut (ulp-level sums) could in
rare cases fall on a token the reference cut (its logprob then reads -inf). The results cross
to the host as one packed fp32 tensor per step, read after the step's existing sync."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from omnistage.engine.ar.sampler import SamplerState, SamplingFlags, processed_logits


@dataclass
class RowLogprobs:
    """Device results for the L asking rows of one step, before the draw."""

    rows: torch.Tensor  # [L] long: their rows in the step's logits
    logprobs: torch.Tensor  # [L, V] fp32: processed logprobs
    top: torch.Tensor  # [L, K] fp32, descending
    top_ids: torch.Tensor  # [L, K] long


def row_logprobs(state: SamplerState, logits: torch.Tensor, slots: torch.Tensor,
                 steps: torch.Tensor, flags: SamplingFlags, rows: torch.Tensor,
                 k: int) -> RowLogprobs:
    """Processed logprobs and top-k of `rows` [L] long of a step's logits [N, V] fp32 (slots,
    steps [N] long, as sample_rows takes them). Call before sample_rows of the same step.
    Capturable: no host sync. k: how many top tokens (clamped to V)."""
    if logits.shape[-1] > 1 << 24:  # (a static shape: no sync)
        raise ValueError(f"logprobs: a vocabulary of {logits.shape[-1]} ids is not exact in the "
                         "fp32 buffer that carries them (at most 2^24)")
    t = state.tensors(slots[rows], steps[rows], flags)
    masked = state.apply_grammar(logits[rows].float(), slots[rows], flags)
    # (+inf, e.g. a tiny repetition penalty dividing a positive logit, would make NaNs)
    lp = processed_logits(masked, t).clamp(max=torch.finfo(torch.float32).max)
    lp = lp.log_softmax(dim=-1)
    k = min(k, lp.shape[-1])
    if k:
        top, top_ids = lp.topk(k, dim=-1)
    else:  # only the emitted tokens' logprobs
        top, top_ids = lp[:, :0], torch.zeros_like(lp[:, :0], dtype=torch.long)
    return RowLogprobs(rows, lp, top, top_ids)


def pack(lp: RowLogprobs, tokens: torch.Tensor) -> torch.Tensor:
    """[L, 1 + 2K] fp32: the emitted token's logprob, the top K logprobs, the top K ids (exact
    in fp32: V <= 2^24). tokens: the step's ids [N] long (after the draw)."""
    sampled = lp.logprobs.gather(1, tokens[lp.rows][:, None])
    return torch.cat([sampled, lp.top, lp.top_ids.float()], dim=1)


def sample_with_logprobs(state: SamplerState, logits: torch.Tensor, slots: torch.Tensor,
                         steps: torch.Tensor, force: torch.Tensor | None, flags: SamplingFlags,
                         rows: torch.Tensor | None, k: int, update: bool = True,
                         fast: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """state.sample_rows, and with `rows` the packed logprobs of those rows (see pack)."""
    lp = row_logprobs(state, logits, slots, steps, flags, rows, k) if rows is not None else None
    ids = state.sample_rows(logits, slots, steps, force, flags, update=update, fast=fast)
    return ids, (pack(lp, ids) if lp is not None else None)


def unpack(packed: np.ndarray, tokens: list[int], ks: list[int]) -> list[dict[int, float]]:
    """Host side of pack(): per asking row, {token id: logprob} of its emitted token (first)
    then its top ks[i] by descending logprob, without the tokens the processing cut (-inf).
    packed: [L, 1 + 2K] float32; tokens: the L emitted ids."""
    K = (packed.shape[1] - 1) // 2
    ids = packed[:, 1 + K:].astype(np.int64)
    out = []
    for row, row_ids, tok, k in zip(packed.tolist(), ids.tolist(), tokens, ks):
        d = {tok: row[0]}
        for v, i in zip(row[1:1 + min(k, K)], row_ids):
            if v == float("-inf"):
                break
            d.setdefault(i, v)
        out.append(d)
    return out


def device_rows(rows: list[int], device: torch.device) -> torch.Tensor | None:
    """The asking rows [L] long on the device (None when no row asks)."""
    if not rows:
        return None
    return torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)
