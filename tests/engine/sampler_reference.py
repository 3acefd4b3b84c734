"""Test oracle: a step's SamplingTensors built straight from the sequences' host lists (what
the engine's SamplerState keeps on the device, rebuilt from scratch every step)."""

from __future__ import annotations

import torch

from omnistage.engine.ar.sampler import SamplingTensors
from omnistage.engine.ar.sequence import Sequence


def host_tensors(seqs: list[Sequence], vocab_size: int, device: torch.device) -> SamplingTensors:
    ps = [s.params for s in seqs]

    def vec(values, dtype):
        return torch.tensor(values, dtype=dtype, device=device)

    t = SamplingTensors(temperature=vec([p.temperature for p in ps], torch.float32),
                        top_k=vec([p.top_k if p.top_k > 0 else 0 for p in ps], torch.long),
                        top_p=vec([p.top_p for p in ps], torch.float32),
                        min_p=vec([p.min_p for p in ps], torch.float32),
                        seed=vec([s.seed & 0x7FFFFFFFFFFFFFFF for s in seqs], torch.long),
                        step=vec([len(s.output_token_ids) for s in seqs], torch.long),
                        all_greedy=all(p.greedy for p in ps),
                        any_top_k=any(p.top_k > 0 for p in ps),
                        any_top_p=any(p.top_p < 1 for p in ps),
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
