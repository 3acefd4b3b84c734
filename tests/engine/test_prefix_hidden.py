"""Prefix caching for sequences that export hidden rows (the thinker feeding the talker): the
rows of cached blocks are kept beside them (BlockManager.export_rows), so a second spoken turn
reuses the first turn's KV and rows, and its text, talker codes and audio equal those of the
same conversation run without the cache."""

from __future__ import annotations

import dataclasses
import io
import shutil
import subprocess

import numpy as np
import pytest
import soundfile
import torch

from omnistage import OmniLLM, SamplingParams
from omnistage.engine.ar.block_manager import BlockManager
from omnistage.engine.ar.sequence import Sequence
from omnistage.models.qwen2_5_omni.media import resample


def _seq(rid: str, ids: list[int], export: bool = True) -> Sequence:
    return Sequence(rid, ids, SamplingParams(), seed=0, export_hidden=export)


def _run_prefill(bm: BlockManager, seq: Sequence, rows: torch.Tensor, chunks: list[int]
                 ) -> list[tuple[int, torch.Tensor]]:
    """Schedule seq as the scheduler does and 'compute' it in chunks; the exported rows of
    position i are rows[i]."""
    cached = bm.match_prefix(seq)
    bm.take_cached(seq, cached)
    out = []
    for n in chunks:
        start = seq.num_computed_tokens
        bm.allocate(seq, start + n)
        seq.num_computed_tokens += n
        bm.commit(seq)
        if seq.export_hidden:  # (the engine exports rows of flagged sequences only)
            out.append(bm.export_rows(seq, (start, rows[start:start + n])))
    return out


def test_block_manager_keeps_and_serves_rows():
    bs = 4
    bm = BlockManager(num_blocks=8, block_size=bs, enable_prefix_caching=True)
    ids = list(range(100, 114))  # 14 tokens: 3 full blocks and a tail
    rows = torch.randn(14, 6)
    first = _seq("a", ids)
    sent = _run_prefill(bm, first, rows, [5, 6, 3])  # chunks across block edges
    assert [s for s, _ in sent] == [0, 5, 11]
    assert len(bm.rows_of) == 3
    bm.release(first)
    # same prefix, a different tail: 3 blocks hit, their rows come first in the first step
    second = _seq("b", ids[:12] + [7, 8, 9])
    rows2 = torch.cat([rows[:12], torch.randn(3, 6)])
    sent2 = _run_prefill(bm, second, rows2, [3])
    assert second.num_cached_tokens == 12
    start, got = sent2[0]
    assert start == 0 and torch.equal(got, rows2)
    # a sequence that exports nothing computes the same prefix: its blocks hit the KV only
    bm.release(second)
    plain = _seq("c", ids[:8] + [1, 2, 3], export=False)
    assert len(bm.match_prefix(plain)) == 2
    # eviction drops the rows with the hash
    hog = _seq("d", list(range(500, 532)), export=False)
    bm.allocate(hog, 32)
    assert not bm.rows_of and not bm.hash_to_block
    assert bm.match_prefix(_seq("e", ids)) == []


def test_decode_rows_wait_as_views_until_their_block_is_full():
    """One-row steps (decode) append views to the tail, with no copy per step; the rows of a
    block are kept (copied) once it is full, equal to the rows the steps exported."""
    bs = 4
    bm = BlockManager(num_blocks=8, block_size=bs, enable_prefix_caching=True)
    ids = list(range(300, 314))
    rows = torch.randn(14, 6)
    seq = _seq("d", ids)
    _run_prefill(bm, seq, rows, [5])  # block 0 full; position 4 waits (a copy: 5-row step)
    assert len(bm.rows_of) == 1
    steps = [torch.randn(3, 6) for _ in range(9)]  # each step's output of a batch of 3
    for k, step in enumerate(steps):  # positions 5..13, this sequence's row is step[1]
        pos = 5 + k
        bm.allocate(seq, pos + 1)
        seq.num_computed_tokens += 1
        bm.commit(seq)
        rows[pos] = step[1]
        bm.export_rows(seq, (pos, step[1:2]))
        if seq.row_tail is None:  # this step filled a block: nothing waits
            assert (pos + 1) % bs == 0
            continue
        first, pieces, count = seq.row_tail
        assert first + count == pos + 1 and sum(p.shape[0] for p in pieces) == count
        if count > 1:  # a one-row piece is the step's own row, not a copy
            assert pieces[-1].data_ptr() == step[1].data_ptr()
    assert len(bm.rows_of) == 3  # blocks 0, 1 (positions 4-7) and 2 (8-11)
    for b, kept in enumerate(bm.rows_of.values()):
        assert torch.equal(kept, rows[b * bs:(b + 1) * bs])
    first, pieces, count = seq.row_tail
    assert (first, count) == (12, 2) and torch.equal(torch.cat(pieces), rows[12:14])


def test_exporting_sequence_hits_only_blocks_with_rows():
    bs = 4
    bm = BlockManager(num_blocks=8, block_size=bs, enable_prefix_caching=True)
    ids = list(range(10, 22))
    _run_prefill(bm, _seq("plain", ids, export=False), torch.zeros(12, 2), [12])
    exporting = _seq("x", ids)
    assert bm.match_prefix(exporting) == []  # KV cached, rows not: the rows must be computed
    assert len(bm.match_prefix(_seq("y", ids, export=False))) == 2


def test_kept_rows_are_capped_least_recently_used_first():
    bs, width = 4, 6
    row_block = bs * width * 4  # one block's fp32 rows, in bytes
    bm = BlockManager(num_blocks=16, block_size=bs, enable_prefix_caching=True,
                      max_row_bytes=3 * row_block)
    a, b, c = (list(range(k, k + 8)) for k in (100, 200, 300))  # 2 full blocks each
    first = _seq("a", a)
    _run_prefill(bm, first, torch.randn(8, width), [8])
    bm.release(first)
    assert len(bm.rows_of) == 2 and bm.row_bytes == 2 * row_block
    other = _seq("c", c)
    _run_prefill(bm, other, torch.randn(8, width), [4])  # c's first block: 3 kept, the cap
    bm.release(other)
    hit = _seq("a2", a + [1])
    _run_prefill(bm, hit, torch.randn(9, width), [1])  # a's rows served: now the newest
    assert hit.num_cached_tokens == 8
    bm.release(hit)
    second = _seq("b", b)
    _run_prefill(bm, second, torch.randn(8, width), [8])  # 2 more: the 2 oldest go (c's, a's 1st)
    bm.release(second)
    assert len(bm.rows_of) == 3 and bm.row_bytes == 3 * row_block
    # an exporting sequence's hits stop at the first block without rows; the KV stays cached
    assert len(bm.match_prefix(_seq("c2", c[:4] + [9]))) == 0
    assert len(bm.match_prefix(_seq("a3", a + [9]))) == 0
    assert len(bm.match_prefix(_seq("a4", a + [9], export=False))) == 2
    assert len(bm.match_prefix(_seq("b2", b + [9]))) == 2


def _speak(text: str) -> np.ndarray:
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (apt-get install -y espeak-ng)")
    wav = subprocess.run(["espeak-ng", "--stdout", text], capture_output=True,
                         check=True).stdout
    x, sr = soundfile.read(io.BytesIO(wav), dtype="float32")
    return resample(x, sr, 16000).astype(np.float32)


def test_second_audio_turn_hits_the_cache_and_matches_no_cache(tiny_omni_dir):
    """A two-turn spoken conversation, run with and without the prefix cache: the second turn
    is served from the cache for at least the first turn's prompt, and its text tokens, talker
    codes and audio equal the uncached run's."""
    q1, q2 = _speak("What is the weather like today?"), _speak("And tomorrow?")
    thinker_params = SamplingParams(temperature=0.0, max_tokens=8, seed=11)
    outs = {}
    for cache in (True, False):
        llm = OmniLLM(str(tiny_omni_dir), device="cpu", max_model_len=1024, num_kv_blocks=256,
                      enable_prefix_caching=cache)
        try:
            thinker, talker = llm.stage_names[:2]
            params = {thinker: thinker_params, talker: dataclasses.replace(
                llm.pipeline.default_params[talker], max_tokens=24)}
            turn1 = [{"role": "user", "content": [{"type": "audio", "audio": q1}]}]
            first = llm.generate([{"messages": turn1}], params, use_tqdm=False)[0]
            turn2 = turn1 + [{"role": "assistant", "content": first.text},
                             {"role": "user", "content": [{"type": "audio", "audio": q2}]}]
            second = llm.generate([{"messages": turn2}], params, use_tqdm=False)[0]
            talker_hits = llm.pipeline.engines[talker].stats["prefix_cache_hit_tokens"]
            outs[cache] = (first, second, llm.pipeline.engines[thinker].config.block_size,
                           talker_hits)
        finally:
            llm.shutdown()
    (f1, s1, bs, talker_hits), (f0, s0, _, no_hits) = outs[True], outs[False]
    assert f1.error is None and s1.error is None and s0.error is None
    p1 = len(f1.prompt_token_ids)
    assert s1.metrics.num_cached_tokens >= p1 // bs * bs > 0
    assert s0.metrics.num_cached_tokens == 0
    # the talker's prompt (the thinker's rows) is served from its cache too
    assert talker_hits >= p1 // bs * bs and no_hits == 0
    assert s1.token_ids == s0.token_ids and f1.token_ids == f0.token_ids
    assert s1.stages[talker].token_ids == s0.stages[talker].token_ids
    assert len(s1.stages[talker].token_ids) > 0
    assert s1.audio is not None and s1.audio.shape == s0.audio.shape
    np.testing.assert_allclose(s1.audio, s0.audio, atol=2e-3)
