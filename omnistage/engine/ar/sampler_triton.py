"""Triton kernels for SamplerState.sample_rows on CUDA: the same tokens as the torch reference
(sampler.sample on SamplerState.tensors), in 2 kernels (no warpers) or 2 kernels + one sort.

prep (grid rows x vocab chunks): gathers the slot's bits/counts/params, applies penalties and
bans, divides by the temperature, and either reduces each chunk to (max, lowest id) of the
score (no warpers: score = logits, or + Gumbel noise for sampled rows) or writes the warped
logits with each chunk's (max, sum exp) for the softmax normaliser.
finish (grid rows): reduces the chunks, applies forced ids, adds the drawn id to the counts.
warp_draw (grid rows): on an ascending stable sort of the warped logits (read back to front,
so ties leave in the order of the reference's top-p sort): the top-k / top-p / min-p cuts
each keep a prefix of that descending view, so one scan finds each cut and the Gumbel-max draw
runs over the kept prefix only.

NOTE: the hash is bit-exact with sampler.hashed_uniform (uint32 wraps as the int64 & mask
does); log/exp/sums may differ from torch's by ulps, so draws can differ only at near ties."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
import triton
import triton.language as tl

from omnistage.engine.ar.sampler import U_MAX, SamplingFlags
from omnistage.engine.kernels_ahead import CompileOnly, TensorSpec, empty_on, launch

_NEG_INF = tl.constexpr(float("-inf"))
_U_MAX = tl.constexpr(U_MAX)  # u below 1 (sampler.hashed_uniform's clamp, the same value)
# NOTE: the kernels' branch flags are bits of one runtime int (FLAGS), not constexprs, so a
# batch with a new mix of sampling states (penalties, bans, forced ids, top-k/p, min-p) does
# not compile a new kernel mid-serving. H100, requests arriving over 6 s after all-at-once
# warm-ups: _prep_kernel compiled once and _warp_draw_kernel twice, holding the orchestrator
# ~1 s per launch that compiled; with FLAGS, each once (on the steps pointer's alignment: see
# SamplerState.device_inputs). do_not_specialize: Triton would also specialize FLAGS == 1.
_PEN, _BAN, _FORCE, _UPDATE = tl.constexpr(1), tl.constexpr(2), tl.constexpr(4), tl.constexpr(8)
_TOP_K, _TOP_P, _MIN_P = tl.constexpr(16), tl.constexpr(32), tl.constexpr(64)


@triton.jit
def _fmix32(x):
    # murmur3 finaliser; uint32 (products wrap) or uint64 (low 32 bits as in sampler._fmix32)
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _row_key(seed, step):
    # seed, step: int64 scalars >= 0 -> uint32 key of sampler.hashed_uniform
    s = seed.to(tl.uint64)
    lo, hi = s & 0xFFFFFFFF, s >> 32
    key = _fmix32(_fmix32(lo ^ _fmix32(hi + 0x9E3779B9)) ^ (step.to(tl.uint64) & 0xFFFFFFFF))
    return key.to(tl.uint32)


@triton.jit
def _neg_log_gumbel(key, ids):
    # log(-log(u)) of U(0,1) u = hashed_uniform(seed, step)[ids]; ids int32 in [0, V)
    h = ids.to(tl.uint32) * 0x27D4EB2F
    x = _fmix32(_fmix32(key ^ h) ^ key)
    u = ((x >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    u = tl.minimum(u, _U_MAX)
    return tl.log(-tl.log(u))


@triton.jit(do_not_specialize=["FLAGS"])
def _prep_kernel(logits_ptr, stride_l, slots_ptr, steps_ptr, bits_ptr, counts_ptr, fparams_ptr,
                 iparams_ptr, w_ptr, pa_ptr, pb_ptr, V, C, FLAGS,
                 MODE: tl.constexpr, BLOCK: tl.constexpr):
    # MODE 0: greedy scores, 1: + Gumbel noise on sampled rows, 2: write warped logits
    r, c = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slots_ptr + r)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    inr = offs < V
    x = tl.load(logits_ptr + r * stride_l + offs, mask=inr, other=_NEG_INF).to(tl.float32)
    pen, ban = (FLAGS & _PEN) != 0, (FLAGS & _BAN) != 0
    b = tl.zeros([BLOCK], dtype=bits_ptr.dtype.element_ty)
    if (FLAGS & (_PEN | _BAN)) != 0:
        b = tl.load(bits_ptr + slot * V + offs, mask=inr, other=0)
    if pen:
        rp = tl.load(fparams_ptr + slot * 6 + 3)
        pres = tl.load(fparams_ptr + slot * 6 + 4)
        freq = tl.load(fparams_ptr + slot * 6 + 5)
        cnt = tl.load(counts_ptr + slot * V + offs, mask=inr, other=0.0)
        seen = ((b & 1) != 0) | (cnt > 0)
        x = tl.where(seen, tl.where(x < 0, x * rp, tl.math.div_rn(x, rp)), x)
        x = x - freq * cnt
        x = x - pres * (cnt > 0).to(tl.float32)
    if ban:
        early = tl.load(steps_ptr + r) < tl.load(iparams_ptr + slot * 3 + 2)
        x = tl.where(((b & 2) != 0) | (((b & 4) != 0) & early), _NEG_INF, x)
    x = tl.where(inr, x, _NEG_INF)
    if MODE == 0:
        s = x
    else:
        temp = tl.load(fparams_ptr + slot * 6)
        w = tl.math.div_rn(x, tl.where(temp > 0, temp, 1.0))
        if MODE == 1:
            key = _row_key(tl.load(iparams_ptr + slot * 3 + 1), tl.load(steps_ptr + r))
            s = tl.where(temp > 0, w - _neg_log_gumbel(key, offs), x)
        else:
            tl.store(w_ptr + r * V + offs, w, mask=inr)
            cm = tl.max(w, axis=0)
            cs = tl.sum(tl.where(inr, tl.exp(w - cm), 0.0), axis=0)
            tl.store(pa_ptr + r * C + c, cm)
            tl.store(pb_ptr + r * C + c, tl.where(cm == _NEG_INF, 0.0, cs))
    if MODE != 2:
        bm = tl.max(s, axis=0)
        tl.store(pa_ptr + r * C + c, bm)
        tl.store(pb_ptr + r * C + c, tl.min(tl.where(inr & (s == bm), offs, V), axis=0))


@triton.jit
def _emit(r, tok, slot, force_ptr, counts_ptr, out_ptr, V, FLAGS):
    tok = tok.to(tl.int64)
    if (FLAGS & _FORCE) != 0:
        f = tl.load(force_ptr + r)
        tok = tl.where(f >= 0, f, tok)
    tl.store(out_ptr + r, tok)
    if (FLAGS & _UPDATE) != 0:
        tl.atomic_add(counts_ptr + slot * V + tok, 1.0)


@triton.jit(do_not_specialize=["FLAGS"])
def _finish_kernel(pa_ptr, pb_ptr, slots_ptr, force_ptr, counts_ptr, out_ptr, V, C, FLAGS,
                   CBLOCK: tl.constexpr):
    r = tl.program_id(0)
    c = tl.arange(0, CBLOCK)
    v = tl.load(pa_ptr + r * C + c, mask=c < C, other=_NEG_INF)
    t = tl.load(pb_ptr + r * C + c, mask=c < C, other=V)
    bm = tl.max(v, axis=0)
    tok = tl.min(tl.where((c < C) & (v == bm), t, V), axis=0)
    _emit(r, tok, tl.load(slots_ptr + r), force_ptr, counts_ptr, out_ptr, V, FLAGS)


# The helpers below read a row sorted descending through `top`: position i is top - i.


@triton.jit
def _run_end(top, start, val, n, BLOCK: tl.constexpr):
    # first position >= start whose value is < val (values at start.. are <= val); n if none
    offs = tl.arange(0, BLOCK)
    pos0 = start + 0 * n
    cnt = BLOCK + 0 * n
    while cnt == BLOCK:
        pos = pos0 + offs
        v = tl.load(top - pos, mask=pos < n, other=_NEG_INF)
        cnt = tl.sum(((v >= val) & (pos < n)).to(tl.int32), axis=0)
        pos0 = pos0 + cnt
    return pos0


@triton.jit
def _sum_exp(top, n, d0, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    z = 0.0
    for pos0 in range(0, n, BLOCK):
        pos = pos0 + offs
        v = tl.load(top - pos, mask=pos < n, other=_NEG_INF)
        z += tl.sum(tl.where(pos < n, tl.exp(v - d0), 0.0), axis=0)
    return z


@triton.jit
def _top_p_end(top, n, d0, z, thr, BLOCK: tl.constexpr):
    # first position i >= 1 whose ascending cumulative mass (1 - mass above i) is <= thr
    offs = tl.arange(0, BLOCK)
    end = n
    carry = 0.0
    pos0 = 0
    while pos0 < end:
        pos = pos0 + offs
        v = tl.load(top - pos, mask=pos < n, other=_NEG_INF)
        q = tl.where(pos < n, tl.math.div_rn(tl.exp(v - d0), z), 0.0)
        above = tl.cumsum(q, axis=0) - q + carry
        cut = (pos < n) & (pos > 0) & (1.0 - above <= thr)
        end = tl.minimum(end, tl.min(tl.where(cut, pos, n), axis=0))
        carry += tl.sum(q, axis=0)
        pos0 += BLOCK
    return end


@triton.jit
def _top_p_end_up(top, n, d0, z, thr, BLOCK: tl.constexpr):
    # _top_p_end summing from the bottom up, as the reference's ascending cumsum does (the
    # top-k prefix: short); equal near-tie decisions where the cut falls among tied values
    offs = tl.arange(0, BLOCK)
    end = n
    carry = 0.0
    for b in range(0, n, BLOCK):
        pos = n - 1 - b - offs
        v = tl.load(top - pos, mask=pos >= 0, other=_NEG_INF)
        q = tl.where(pos >= 0, tl.math.div_rn(tl.exp(v - d0), z), 0.0)
        cum = tl.cumsum(q, axis=0) + carry
        end = tl.minimum(end, tl.min(tl.where((pos > 0) & (cum <= thr), pos, n), axis=0))
        carry += tl.sum(q, axis=0)
    return end


@triton.jit
def _min_p_end(top, n, d0, z, thr, BLOCK: tl.constexpr):
    # first position i >= 1 with probability < thr (probabilities fall along the row)
    offs = tl.arange(0, BLOCK)
    end = n
    pos0 = 0
    while pos0 < end:
        pos = pos0 + offs
        v = tl.load(top - pos, mask=pos < n, other=_NEG_INF)
        cut = (pos < n) & (pos > 0) & (tl.math.div_rn(tl.exp(v - d0), z) < thr)
        end = tl.minimum(end, tl.min(tl.where(cut, pos, n), axis=0))
        pos0 += BLOCK
    return end


@triton.jit(do_not_specialize=["FLAGS"])
def _warp_draw_kernel(vals_ptr, ids_ptr, pa_ptr, pb_ptr, slots_ptr, steps_ptr, force_ptr,
                      fparams_ptr, iparams_ptr, counts_ptr, out_ptr, V, C, FLAGS,
                      BLOCK: tl.constexpr, CBLOCK: tl.constexpr):
    # vals/ids: [N, V] ascending stable sort of the warped logits and its indices
    r = tl.program_id(0)
    slot = tl.load(slots_ptr + r)
    top, itop = vals_ptr + r * V + V - 1, ids_ptr + r * V + V - 1
    d0 = tl.load(top)
    m = V  # top-k: all values >= the k-th largest
    if (FLAGS & _TOP_K) != 0:
        k = tl.minimum(tl.load(iparams_ptr + slot * 3).to(tl.int32), V)
        if k > 0:
            m = _run_end(top, k, tl.load(top - (k - 1)), V, BLOCK)
    keep = m
    if (FLAGS & _TOP_P) != 0:
        top_p = tl.load(fparams_ptr + slot * 6 + 1)
        if top_p < 1.0:
            if m == V:  # the softmax normaliser from prep's chunks (their max is d0)
                c = tl.arange(0, CBLOCK)
                cm = tl.load(pa_ptr + r * C + c, mask=c < C, other=_NEG_INF)
                cs = tl.load(pb_ptr + r * C + c, mask=c < C, other=0.0)
                z = tl.sum(tl.where(cm > _NEG_INF, cs * tl.exp(cm - d0), 0.0), axis=0)
                keep = _top_p_end(top, m, d0, z, 1.0 - top_p, BLOCK)
            else:
                z = _sum_exp(top, m, d0, BLOCK)
                keep = _top_p_end_up(top, m, d0, z, 1.0 - top_p, BLOCK)
    if (FLAGS & _MIN_P) != 0:
        min_p = tl.load(fparams_ptr + slot * 6 + 2)
        if min_p > 0.0:
            z2 = _sum_exp(top, keep, d0, BLOCK)
            keep = _min_p_end(top, keep, d0, z2, min_p * tl.math.div_rn(1.0, z2), BLOCK)
    temp = tl.load(fparams_ptr + slot * 6)
    if temp <= 0.0:  # greedy: the lowest id among the maxima
        keep = _run_end(top, 1, d0, V, BLOCK)
    key = _row_key(tl.load(iparams_ptr + slot * 3 + 1), tl.load(steps_ptr + r))
    offs = tl.arange(0, BLOCK)
    best = _NEG_INF
    tok = V
    for pos0 in range(0, keep, BLOCK):
        pos = pos0 + offs
        inr = pos < keep
        ids = tl.load(itop - pos, mask=inr, other=0).to(tl.int32)
        s = tl.load(top - pos, mask=inr, other=_NEG_INF)
        s = tl.where(inr, tl.where(temp > 0, s - _neg_log_gumbel(key, ids), s), _NEG_INF)
        bm = tl.max(s, axis=0)
        bt = tl.min(tl.where(inr & (s == bm), ids, V), axis=0)
        take = (bm > best) | ((bm == best) & (bt < tok))
        best = tl.where(take, bm, best)
        tok = tl.where(take, bt, tok)
    _emit(r, tok, slot, force_ptr, counts_ptr, out_ptr, V, FLAGS)


# NOTE: Triton (3.6) hashes a kernel with the constexpr globals of the helpers it calls only
# where a helper was hashed before (JITFunction.cache_key merges the helper's used globals
# before computing them), so a kernel's cache key depended on which kernel of the process
# compiled first: _finish_kernel after _warp_draw_kernel (both call _emit) got another key
# than in a process that compiled it first, and its variant compiled ahead missed (H200, the
# talker's warm-up). Hashing the helpers here, leaves first, gives every process the same keys.
def _hash_helpers() -> None:
    for helper in (_fmix32, _row_key, _neg_log_gumbel, _emit, _run_end, _sum_exp, _top_p_end,
                   _top_p_end_up, _min_p_end):
        _ = helper.cache_key  # computed once and kept by the JITFunction


if not triton.knobs.runtime.interpret:
    _hash_helpers()


def sample_rows(state, logits: torch.Tensor, slots: torch.Tensor, steps: torch.Tensor,
                force: torch.Tensor | None, flags, update: bool) -> torch.Tensor:
    """SamplerState.sample_rows through the kernels. logits [N, V] fp32; slots, steps, force
    [N] long -> ids [N] long. Capturable: fixed launch shapes, no host sync."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    dev = logits.device
    out = torch.empty(logits.shape[0], dtype=torch.long, device=dev)
    bits = sum(bit.value for bit, on in (
        (_PEN, flags.penalties), (_BAN, flags.banned), (_FORCE, force is not None),
        (_UPDATE, update), (_TOP_K, flags.any_top_k), (_TOP_P, flags.any_top_p),
        (_MIN_P, flags.any_min_p)) if on)
    _launch(launch, empty_on(dev), lambda w: torch.sort(w, dim=-1, stable=True), state, logits,
            slots, steps, force, sampler_mode(flags), bits, out)
    return out


def sampler_mode(flags: SamplingFlags) -> int:
    """_prep_kernel's MODE for a step's SamplingFlags: 0 all greedy, 1 Gumbel draws without
    warpers, 2 warped logits (top-k, top-p or min-p: then sorted and drawn by warp_draw)."""
    if flags.all_greedy:
        return 0
    return 1 if not (flags.any_top_k or flags.any_top_p or flags.any_min_p) else 2


def _launch(run: Callable[..., Any], empty: Callable[..., Any], sort: Callable[..., Any],
            state: Any, logits: Any, slots: Any, steps: Any, force: Any, mode: int, bits: int,
            out: Any, tail: bool = True) -> None:
    """The launches of sample_rows (logits contiguous rows, out [N] allocated), by
    run(kernel, grid, *args, **kwargs): kernels_ahead.launch, or CompileOnly on TensorSpecs
    (compile_ahead); empty(shape, dtype) allocates, sort(w) -> (values, ids) of each row in
    ascending stable order. tail: False stops after the prep kernel (compile_ahead)."""
    N, V = logits.shape
    block = 1024 if V <= 16384 else 2048
    C = triton.cdiv(V, block)
    pa = empty((N, C), torch.float32)
    pb = empty((N, C), torch.int32 if mode < 2 else torch.float32)
    w = empty((N, V), torch.float32) if mode == 2 else pa
    force_arg = force if force is not None else slots
    run(_prep_kernel, (N, C), logits, logits.stride(0), slots, steps, state.bits, state.counts,
        state.fparams, state.iparams, w, pa, pb, V, C, bits, MODE=mode, BLOCK=block,
        num_warps=4, enable_fp_fusion=False)  # mul, sub rounded as torch does
    if not tail:
        return
    cblock = triton.next_power_of_2(C)
    if mode < 2:
        run(_finish_kernel, (N,), pa, pb, slots, force_arg, state.counts, out, V, C, bits,
            CBLOCK=cblock, num_warps=1)
        return
    vals, ids = sort(w)
    run(_warp_draw_kernel, (N,), vals, ids, pa, pb, slots, steps, force_arg, state.fparams,
        state.iparams, state.counts, out, V, C, bits, BLOCK=256 if V <= 16384 else 1024,
        CBLOCK=cblock, num_warps=4 if V <= 16384 else 8)


def compile_ahead(vocab_size: int, mode: int, tail: bool) -> list[str]:
    """Compile, without launching, what sample_rows launches for logits [N, vocab_size] in
    `mode` (sampler_mode): the prep kernel, and with `tail` the kernel after it (finish, or
    warp_draw in mode 2), on a SamplerState's tensors and the step's fresh slots/steps
    (engine/kernels_ahead.py runs it in a process of its own). Returns the cache keys."""
    new, V = TensorSpec.empty, vocab_size
    state = SimpleNamespace(bits=new((2, V), torch.uint8), counts=new((2, V), torch.float32),
                            fparams=new((2, 6), torch.float32), iparams=new((2, 3), torch.long))
    run = CompileOnly()
    rows = new((1,), torch.long)
    _launch(run, new, lambda w: (new(w.shape, torch.float32), new(w.shape, torch.long)), state,
            new((1, V), torch.float32), rows, rows, None, mode, 0, new((1,), torch.long), tail)
    return run.keys
