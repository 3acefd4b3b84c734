"""Batched sampling on device. Logit processing follows transformers' processor order:
repetition penalty -> min-tokens / suppression -> temperature -> top-k -> top-p -> min-p,
with vLLM's presence/frequency penalties applied beside the repetition penalty.

NOTE: random draws come from a counter-based hash of (seed, step, token id), not from a
stateful generator, so a request's tokens depend only on its own seed and position: the same
in any batch, on any device, and capturable in a CUDA graph (no host state)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omnistage.engine.ar.sequence import Sequence

_MASK32 = 0xFFFFFFFF


@dataclass
class SamplingTensors:
    """Per-row parameters of one step, on the logits' device."""

    temperature: torch.Tensor  # [N] float (0 = greedy)
    top_k: torch.Tensor  # [N] long (0 = off)
    top_p: torch.Tensor  # [N] float
    min_p: torch.Tensor  # [N] float
    seed: torch.Tensor  # [N] long
    step: torch.Tensor  # [N] long: index of the token being sampled
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    repetition_penalty: torch.Tensor | None = None  # [N] float, when any row uses penalties
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    seen_mask: torch.Tensor | None = None  # [N, V] bool: prompt + output ids
    output_counts: torch.Tensor | None = None  # [N, V] float: output id counts
    banned_mask: torch.Tensor | None = None  # [N, V] bool: -inf (min_tokens stops, suppressed)

    @classmethod
    def build(cls, seqs: list[Sequence], vocab_size: int, device: torch.device) -> SamplingTensors:
        ps = [s.params for s in seqs]

        def vec(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device)

        t = cls(temperature=vec([p.temperature for p in ps], torch.float32),
                top_k=vec([p.top_k if p.top_k > 0 else 0 for p in ps], torch.long),
                top_p=vec([p.top_p for p in ps], torch.float32),
                min_p=vec([p.min_p for p in ps], torch.float32),
                seed=vec([s.seed & 0x7FFFFFFFFFFFFFFF for s in seqs], torch.long),
                step=vec([len(s.output_token_ids) for s in seqs], torch.long),
                all_greedy=all(p.greedy for p in ps),
                any_top_k=any(p.top_k > 0 for p in ps), any_top_p=any(p.top_p < 1 for p in ps),
                any_min_p=any(p.min_p > 0 for p in ps))
        if any(p.needs_penalties for p in ps):
            t.repetition_penalty = vec([p.repetition_penalty for p in ps], torch.float32)
            t.presence_penalty = vec([p.presence_penalty for p in ps], torch.float32)
            t.frequency_penalty = vec([p.frequency_penalty for p in ps], torch.float32)
            t.seen_mask, t.output_counts = _token_stats(seqs, vocab_size, device)
        banned = [(r, tid) for r, s in enumerate(seqs) for tid in _banned_ids(s)
                  if 0 <= tid < vocab_size]
        if banned:
            mask = torch.zeros(len(seqs), vocab_size, dtype=torch.bool, device=device)
            idx = torch.tensor(banned, dtype=torch.long, device=device)
            mask[idx[:, 0], idx[:, 1]] = True
            t.banned_mask = mask
        return t


def _banned_ids(seq: Sequence) -> list[int]:
    ids = list(seq.params.suppress_token_ids)
    if len(seq.output_token_ids) < seq.params.min_tokens:
        ids += sorted(seq.stop_token_ids)
    return ids


def _token_stats(seqs: list[Sequence], vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    n = len(seqs)
    seen = torch.zeros(n, vocab, dtype=torch.bool, device=device)
    counts = torch.zeros(n, vocab, dtype=torch.float32, device=device)
    for r, s in enumerate(seqs):
        prompt = torch.tensor(s.prompt_token_ids, dtype=torch.long, device=device)
        seen[r, prompt.clamp(0, vocab - 1)] = True
        if s.output_token_ids:
            out = torch.tensor(s.output_token_ids, dtype=torch.long, device=device)
            counts[r].index_add_(0, out, torch.ones_like(out, dtype=torch.float32))
    return seen | (counts > 0), counts


def apply_penalties(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Repetition (transformers), presence/frequency (OpenAI), bans. logits: [N, V] fp32."""
    if t.repetition_penalty is not None:
        rp = t.repetition_penalty[:, None]
        penalized = torch.where(logits < 0, logits * rp, logits / rp)
        logits = torch.where(t.seen_mask, penalized, logits)
        logits = logits - t.frequency_penalty[:, None] * t.output_counts
        logits = logits - t.presence_penalty[:, None] * (t.output_counts > 0).float()
    if t.banned_mask is not None:
        logits = logits.masked_fill(t.banned_mask, float("-inf"))
    return logits


def apply_warpers(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p (masked entries -> -inf). Greedy rows: temperature 1."""
    temp = torch.where(t.temperature > 0, t.temperature, torch.ones_like(t.temperature))
    logits = logits / temp[:, None]
    neg_inf = float("-inf")
    if t.any_top_k:
        k = t.top_k.clamp(max=logits.shape[-1])
        kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1).clamp(min=0)[:, None])
        logits = torch.where((k[:, None] > 0) & (logits < kth), neg_inf, logits)
    if t.any_top_p:
        sorted_logits, order = logits.sort(dim=-1)  # ascending, as transformers does
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cum <= (1 - t.top_p)[:, None]
        remove[:, -1] = False  # always keep the most likely token
        logits = logits.masked_fill(remove.scatter(1, order, remove), neg_inf)
    if t.any_min_p:
        probs = logits.softmax(dim=-1)
        threshold = t.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        remove = probs < threshold
        remove.scatter_(1, probs.argmax(dim=-1, keepdim=True), False)
        logits = logits.masked_fill(remove, neg_inf)
    return logits


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    # murmur3 finaliser on values in [0, 2^32) held in int64 (products wrap; low bits stay exact)
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def hashed_uniform(seed: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """U(0,1) [N, V], a pure function of (seed, step, token id)."""
    lo, hi = seed & _MASK32, (seed >> 32) & _MASK32
    key = _fmix32(_fmix32(lo ^ _fmix32(hi + 0x9E3779B9)) ^ (step & _MASK32))  # [N]
    ids = torch.arange(vocab, device=seed.device, dtype=torch.long)
    x = _fmix32((key[:, None] ^ (ids[None, :] * 0x27D4EB2F & _MASK32)) & _MASK32)
    x = _fmix32(x ^ key[:, None])
    return ((x >> 8).float() + 0.5) * (1.0 / (1 << 24))


def sample(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """logits: [N, V] fp32 -> next token ids [N] long."""
    logits = apply_penalties(logits, t)
    greedy = logits.argmax(dim=-1)
    if t.all_greedy:
        return greedy
    warped = apply_warpers(logits, t)
    # Gumbel-max: argmax(logits + Gumbel noise) is a draw from softmax(logits)
    u = hashed_uniform(t.seed, t.step, logits.shape[-1])
    drawn = (warped - torch.log(-torch.log(u))).argmax(dim=-1)
    return torch.where(t.temperature > 0, drawn, greedy)
