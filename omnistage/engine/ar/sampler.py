"""Batched sampling on device. Logit processing follows transformers' processor order:
repetition penalty -> min-tokens / suppression -> temperature -> top-k -> top-p -> min-p,
with vLLM's presence/frequency penalties applied beside the repetition penalty.

NOTE: random draws come from a counter-based hash of (seed, step, token id), not from a
stateful generator, so a request's tokens depend only on its own seed and position: the same
in any batch, on any device, and capturable in a CUDA graph (no host state).

SamplerState keeps each running sequence's sampling state on the device, in a slot: its params,
output-id counts (updated on the device after each draw) and a bit mask of prompt ids, suppressed
ids and stop ids. A step then sends only slot indices, step counters and forced ids; the
SamplingTensors it gathers hold the values the lists give (tests build them from the lists)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from omnistage.engine.ar.sequence import Sequence, SequenceStatus
from omnistage.engine.ar.structured_output import BitmaskFiller, apply_token_bitmask

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
        # ascending, as transformers does; stable: ties leave in id order on every device
        sorted_logits, order = logits.sort(dim=-1, stable=True)
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


def processed_logits(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """The logits each row draws from in sample(): penalties and bans, then for sampled rows
    temperature and top-k/top-p/min-p (cut entries -inf); greedy rows: the penalised logits.
    Their log-softmax is vLLM's "processed_logprobs". logits: [N, V] fp32 -> [N, V] fp32."""
    logits = apply_penalties(logits, t)
    if t.all_greedy:
        return logits
    return torch.where((t.temperature > 0)[:, None], apply_warpers(logits, t), logits)


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    # murmur3 finaliser on values in [0, 2^32) held in int64 (products wrap; low bits stay exact)
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


# the largest float32 below 1. NOTE: (2^24 - 1) + 0.5 rounds up to 2^24 in float32, so the top
# hash value (1 id in 2^24 per draw) gave u == 1.0 exactly: Gumbel noise +inf, which made a
# banned (-inf) id NaN, and argmax picks NaN (a suppressed id or a stop id under min_tokens
# was drawn; a top-k/top-p-cut id too), and forced a kept id. u is clamped below 1 instead.
U_MAX = 1.0 - 2.0 ** -24


def hashed_uniform(seed: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """U(0,1) [N, V], a pure function of (seed, step, token id); 0 < u <= U_MAX < 1."""
    lo, hi = seed & _MASK32, (seed >> 32) & _MASK32
    key = _fmix32(_fmix32(lo ^ _fmix32(hi + 0x9E3779B9)) ^ (step & _MASK32))  # [N]
    ids = torch.arange(vocab, device=seed.device, dtype=torch.long)
    x = _fmix32((key[:, None] ^ (ids[None, :] * 0x27D4EB2F & _MASK32)) & _MASK32)
    x = _fmix32(x ^ key[:, None])
    return (((x >> 8).float() + 0.5) * (1.0 / (1 << 24))).clamp_(max=U_MAX)


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


# ---------------------------------------------------------------- device-resident state
SEEN, SUPPRESS, STOP = 1, 2, 4  # bits of SamplerState.bits
_MASK63 = 0x7FFFFFFFFFFFFFFF
# fparams columns: temperature, top_p, min_p, repetition, presence, frequency
_GREEDY_F = (0.0, 1.0, 0.0, 1.0, 0.0, 0.0)


class SamplingFlags(NamedTuple):
    """Which branches of sample() a batch needs (host-known; a CUDA graph is captured per value).
    Skipped branches are exact no-ops for the rows that do not use them."""

    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    penalties: bool
    banned: bool
    grammar: bool = False  # some row follows a structured-output grammar (its slot's bitmask)


@dataclass
class StepSampling:
    """One step's per-row sampling inputs (host lists); rows that do not sample use the
    scratch slot, step 0, force -1."""

    slots: list[int]
    steps: list[int]  # len(output_token_ids): index of the token being drawn
    force: list[int]  # forced id, -1 = sample
    rows: list[int]  # the rows that sample, in order
    flags: SamplingFlags
    logprob_rows: list[int] = field(default_factory=list)  # rows whose params ask logprobs
    logprob_k: list[int] = field(default_factory=list)  # their SamplingParams.logprobs


def _in_range(ids, vocab: int) -> np.ndarray:
    a = np.asarray(list(ids), dtype=np.int64)
    return a[(a >= 0) & (a < vocab)]


class SamplerState:
    """Sampling state of up to num_slots sequences on the device (row num_slots is a scratch
    slot for rows that do not sample). Host side: which sequence owns each slot and what the
    device rows reflect, so a slot is rebuilt from the lists only when it is new or stale."""

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device,
                 fast: bool = True) -> None:
        S, V = num_slots, vocab_size
        self.num_slots, self.vocab_size, self.device = S, V, device
        self.fast = fast  # the Triton kernels on CUDA (EngineConfig.fast_sampler)
        self.scratch = S
        self.counts = torch.zeros(S + 1, V, dtype=torch.float32, device=device)  # output ids
        self.bits = torch.zeros(S + 1, V, dtype=torch.uint8, device=device)  # SEEN|SUPPRESS|STOP
        self.fparams = torch.tensor([_GREEDY_F] * (S + 1), dtype=torch.float32, device=device)
        self.iparams = torch.zeros(S + 1, 3, dtype=torch.long, device=device)  # top_k seed min_t
        # weak: a finished sequence (and its device tensors) must not live on in a slot
        self.owner: list[weakref.ref | None] = [None] * S
        self.owner_id: list[str] = [""] * S
        self.free = list(range(S - 1, -1, -1))  # pop() -> lowest free slot
        self.slot_of: dict[str, int] = {}
        self.synced = [-1] * S  # output length the device rows reflect (-1: stale)
        self.last = [-1] * S  # last output id they reflect
        self.made_from: list[tuple] = [()] * S  # (params, stop ids) the rows were built from
        self.ban_always = [False] * S  # in-range suppressed ids
        self.ban_early = [False] * S  # in-range stop ids and min_tokens > 0
        self.min_tokens = [0] * S
        # structured output: per slot, the ids its grammar allows next (32 per int32 word; -1 =
        # all allowed), written on the host by the matchers and copied up before each step
        words = -(-V // 32)
        self.bitmask = torch.full((S + 1, words), -1, dtype=torch.int32, device=device)
        self.bitmask_host = torch.full((S + 1, words), -1, dtype=torch.int32,
                                       pin_memory=device.type == "cuda")
        self.grammar_dirty = [False] * S  # the slot's rows may hold a grammar's mask
        self.filler = BitmaskFiller()
        self._pending_grammar: tuple[list, list[int]] | None = None  # (matchers, slots)

    # ---------------------------------------------------------------- host side
    def prepare(self, seqs: list[Sequence], rows: list[int], ahead: int = 0) -> StepSampling:
        """Slots (assigned or rebuilt as needed), steps, forced ids and flags for the rows of
        `seqs` that sample this step. ahead=1: the step is launched before the previous step's
        ids are committed; the slots (which the device updates in order) are used as they are."""
        n, V = len(seqs), self.vocab_size
        step = StepSampling([self.scratch] * n, [0] * n, [-1] * n, list(rows),
                            SamplingFlags(True, False, False, False, False, False))
        greedy, top_k, top_p, min_p, pen, ban = True, False, False, False, False, False
        grammar_slots, grammar_matchers = [], []
        for r in rows:
            seq = seqs[r]
            slot = self._slot(seq, seqs) if not ahead else self._slot_ahead(seq)
            if seq.grammar is not None:  # (launched ahead: its head waits, see DecodeGraphs)
                grammar_slots.append(slot)
                grammar_matchers.append(seq.grammar)
            k = len(seq.output_token_ids) + ahead
            self.synced[slot] = -1  # stale until commit() (the device adds the drawn id)
            step.slots[r], step.steps[r] = slot, k
            forced = seq.forced_output_ids
            if forced is not None and k < len(forced) and 0 <= forced[k] < V:
                step.force[r] = forced[k]
            p = seq.params
            if p.logprobs is not None:
                step.logprob_rows.append(r)
                step.logprob_k.append(p.logprobs)
            greedy &= p.greedy
            top_k |= p.top_k > 0
            top_p |= p.top_p < 1
            min_p |= p.min_p > 0
            pen |= p.needs_penalties
            ban |= self.ban_always[slot] or (self.ban_early[slot] and k < self.min_tokens[slot])
        if greedy:  # sample() returns before the warpers
            top_k = top_p = min_p = False
        # the masks are filled when the sampler first needs them (flush_grammar): on the graph
        # path after the step's forward is queued, so the host fills while the GPU runs it
        self._pending_grammar = (grammar_matchers, grammar_slots) if grammar_slots else None
        step.flags = SamplingFlags(greedy, top_k, top_p, min_p, pen, ban, bool(grammar_slots))
        return step

    def flush_grammar(self) -> None:
        """Fill the bitmask rows of the last prepare()'s grammar rows and queue their copy to
        the device (no-op when none is pending). Runs before the step's sampler reads them."""
        if self._pending_grammar is None:
            return
        matchers, slots = self._pending_grammar
        self._pending_grammar = None
        # (a row that ended while its step waited keeps its old mask: its id is dropped)
        live = [i for i, m in enumerate(matchers) if not m.terminated]
        if not live:
            return
        matchers, slots = [matchers[i] for i in live], [slots[i] for i in live]
        self.filler.fill(matchers, self.bitmask_host, slots)
        # one copy of the host rows lo..hi (slots are handed out lowest first, so the grammar
        # rows of a batch sit close together); rows in the range without a grammar are all
        # ones on both sides. NOTE: the host rows are rewritten only by the next flush, after
        # this step's ids were read back (a step launched ahead flushes after that read)
        lo, hi = min(slots), max(slots) + 1
        self.bitmask[lo:hi].copy_(self.bitmask_host[lo:hi], non_blocking=True)
        for slot in slots:
            self.grammar_dirty[slot] = True

    def apply_grammar(self, logits: torch.Tensor, slots: torch.Tensor,
                      flags: SamplingFlags) -> torch.Tensor:
        """logits [N, V] with the ids the rows' grammars forbid at -inf (rows without one:
        unchanged); unchanged when no row has a grammar. Capturable (a graph path flushes the
        pending masks before it captures or replays a head)."""
        if not flags.grammar:
            return logits
        self.flush_grammar()
        return apply_token_bitmask(logits, self.bitmask[slots])

    def commit(self, step: StepSampling, tokens: list[int]) -> None:
        """tokens: the ids drawn for step.rows (what the engine appends)."""
        for r, tok in zip(step.rows, tokens):
            slot = step.slots[r]
            self.synced[slot], self.last[slot] = step.steps[r] + 1, tok

    def release(self, seq: Sequence) -> None:
        slot = self.slot_of.get(seq.request_id)
        if slot is not None and self._owner(slot) is seq:
            self._free(slot)

    def device_inputs(self, step: StepSampling
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """[N] long slots, steps, forced ids (None when nothing is forced), on the device.

        NOTE: rows padded to an even length keep each one 16-byte aligned: Triton specializes
        its kernels on pointer alignment, and an odd N (steps at 8 bytes past 16) compiled the
        sampler kernels again mid-serving (H100, requests arriving over 6 s: ~1 s stall)."""
        pad = [0] * (len(step.slots) % 2)
        t = torch.tensor([step.slots + pad, step.steps + pad, step.force + pad], dtype=torch.long)
        t = t.to(self.device, non_blocking=True)
        n = len(step.slots)
        return t[0, :n], t[1, :n], (t[2, :n] if any(f >= 0 for f in step.force) else None)

    def _slot(self, seq: Sequence, batch: list[Sequence]) -> int:
        slot = self.slot_of.get(seq.request_id)
        if slot is None or self._owner(slot) is not seq:
            slot = self._take(batch)
            self.owner[slot], self.owner_id[slot] = weakref.ref(seq), seq.request_id
            self.slot_of[seq.request_id] = slot
            self._build(slot, seq)
            return slot
        out = seq.output_token_ids
        fresh = (self.synced[slot] == len(out) and (not out or self.last[slot] == out[-1])
                 and self.made_from[slot][0] is seq.params
                 and self.made_from[slot][1] is seq.stop_token_ids)
        if not fresh:  # e.g. outputs changed behind our back: rebuild from the lists
            self._build(slot, seq)
        return slot

    def _slot_ahead(self, seq: Sequence) -> int:
        slot = self.slot_of.get(seq.request_id)
        if slot is None or self._owner(slot) is not seq:
            raise RuntimeError(f"sampler: {seq.request_id!r} launched ahead without a slot")
        return slot

    def _take(self, batch: list[Sequence]) -> int:
        if not self.free:  # reclaim slots of sequences no longer running (finished, preempted)
            busy = {id(s) for s in batch}
            for slot in range(self.num_slots):
                o = self._owner(slot)
                if self.owner[slot] is not None and (
                        o is None or (o.status != SequenceStatus.RUNNING and id(o) not in busy)):
                    self._free(slot)
        if not self.free:
            raise RuntimeError(f"sampler: more than {self.num_slots} sequences sampling at once")
        return self.free.pop()

    def _owner(self, slot: int) -> Sequence | None:
        ref = self.owner[slot]
        return ref() if ref is not None else None

    def _free(self, slot: int) -> None:
        rid = self.owner_id[slot]
        if self.slot_of.get(rid) == slot:
            del self.slot_of[rid]
        self.owner[slot], self.synced[slot], self.made_from[slot] = None, -1, ()
        self.free.append(slot)

    def _build(self, slot: int, seq: Sequence) -> None:
        # the slot's device rows from the sequence's lists (once per admission or when stale)
        V, p = self.vocab_size, seq.params
        row = np.zeros(V, dtype=np.uint8)
        if seq.penalize_prompt:
            row[np.clip(np.asarray(seq.prompt_token_ids, dtype=np.int64), 0, V - 1)] |= SEEN
        supp, stop = _in_range(p.suppress_token_ids, V), _in_range(seq.stop_token_ids, V)
        row[supp] |= SUPPRESS
        row[stop] |= STOP
        self.bits[slot].copy_(torch.from_numpy(row))
        out = _in_range(seq.output_token_ids, V)
        if len(out):
            self.counts[slot].copy_(torch.from_numpy(
                np.bincount(out, minlength=V).astype(np.float32)))
        else:
            self.counts[slot].zero_()
        self.fparams[slot].copy_(torch.tensor([p.temperature, p.top_p, p.min_p,
                                               p.repetition_penalty, p.presence_penalty,
                                               p.frequency_penalty], dtype=torch.float32))
        self.iparams[slot].copy_(torch.tensor([max(p.top_k, 0), seq.seed & _MASK63,
                                               p.min_tokens], dtype=torch.long))
        ids = seq.output_token_ids
        self.synced[slot], self.last[slot] = len(ids), (ids[-1] if ids else -1)
        self.made_from[slot] = (p, seq.stop_token_ids)
        if self.grammar_dirty[slot]:  # a former owner's grammar: all allowed again
            self.bitmask_host[slot].fill_(-1)
            self.bitmask[slot].fill_(-1)
            self.grammar_dirty[slot] = False
        self.ban_always[slot] = len(supp) > 0
        self.ban_early[slot] = len(stop) > 0 and p.min_tokens > 0
        self.min_tokens[slot] = p.min_tokens

    # ---------------------------------------------------------------- device side
    def tensors(self, slots: torch.Tensor, steps: torch.Tensor,
                flags: SamplingFlags) -> SamplingTensors:
        """SamplingTensors of rows `slots` [N] long at `steps` [N] long (no host sync)."""
        fp, ip = self.fparams[slots], self.iparams[slots]
        t = SamplingTensors(temperature=fp[:, 0], top_k=ip[:, 0], top_p=fp[:, 1],
                            min_p=fp[:, 2], seed=ip[:, 1], step=steps,
                            all_greedy=flags.all_greedy, any_top_k=flags.any_top_k,
                            any_top_p=flags.any_top_p, any_min_p=flags.any_min_p)
        bits = self.bits[slots] if flags.penalties or flags.banned else None
        if flags.penalties:
            counts = self.counts[slots]
            t.repetition_penalty, t.presence_penalty = fp[:, 3], fp[:, 4]
            t.frequency_penalty, t.output_counts = fp[:, 5], counts
            t.seen_mask = ((bits & SEEN) != 0) | (counts > 0)
        if flags.banned:
            early = (steps < ip[:, 2])[:, None]
            t.banned_mask = ((bits & SUPPRESS) != 0) | (((bits & STOP) != 0) & early)
        return t

    def sample_params(self, logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        """Rows sampled outside the slot bookkeeping, by t's per-row temperature, top-k, top-p,
        seed and step (no penalties, bans or min-p; e.g. Qwen3-Omni's code predictor): the
        first slots take those params on the device (capturable, no host sync), then
        sample_rows draws them (the Triton kernels on CUDA). logits [N, V] fp32 -> ids [N]."""
        flags = SamplingFlags(t.all_greedy, t.any_top_k, t.any_top_p, False, False, False)
        out = []
        for lo in range(0, logits.shape[0], self.num_slots):
            hi = min(lo + self.num_slots, logits.shape[0])
            n = hi - lo
            self.fparams[:n, 0].copy_(t.temperature[lo:hi])
            self.fparams[:n, 1].copy_(t.top_p[lo:hi])
            self.fparams[:n, 2].zero_()
            self.iparams[:n, 0].copy_(t.top_k[lo:hi])
            self.iparams[:n, 1].copy_(t.seed[lo:hi])
            slots = torch.arange(n, device=logits.device)
            out.append(self.sample_rows(logits[lo:hi], slots, t.step[lo:hi], None, flags,
                                        update=False))
        return out[0] if len(out) == 1 else torch.cat(out)

    def sample_rows(self, logits: torch.Tensor, slots: torch.Tensor, steps: torch.Tensor,
                    force: torch.Tensor | None, flags: SamplingFlags,
                    update: bool = True, fast: bool | None = None) -> torch.Tensor:
        """logits [N, V] fp32 -> ids [N] long (forced ids where force >= 0); then the slots'
        output counts += the ids. Capturable: no host sync, no host-built tensors.
        fast: the Triton kernels (sampler_triton, same tokens up to ulp-level near ties); None =
        on CUDA when this state's `fast` is set; False = the torch reference below."""
        if logits.shape[-1] != self.vocab_size:
            raise RuntimeError(f"sampler: logits have {logits.shape[-1]} columns, state has "
                               f"{self.vocab_size}")
        if fast is None:
            fast = logits.is_cuda and self.fast
        logits = self.apply_grammar(logits, slots, flags)
        if fast and logits.shape[0] > 0:
            from omnistage.engine.ar import sampler_triton  # triton: imported on first use
            return sampler_triton.sample_rows(self, logits, slots, steps, force, flags, update)
        tokens = sample(logits, self.tensors(slots, steps, flags))
        if force is not None:
            tokens = torch.where(force >= 0, force, tokens)
        if update:
            flat = slots * self.vocab_size + tokens
            self.counts.view(-1).index_add_(0, flat, torch.ones_like(flat, dtype=torch.float32))
        return tokens
