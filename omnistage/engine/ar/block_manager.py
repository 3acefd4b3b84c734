"""Paged KV blocks: reference counts, hash-chained prefix cache of full blocks, O(1) LRU reuse.

NOTE: a block whose ref count drops to 0 keeps its KV and hash and goes to the back of the free
list; allocation takes from the front, evicting the least recently freed cached block. A cache
hit on a free block pulls it out of the list in O(1) (OrderedDict).

NOTE (hidden-row export): a sequence that exports its hidden rows (the thinker feeding the
talker) needs the rows of its cached positions too. The rows an exporting sequence computed for
a full block are kept beside the block, by its hash, for as long as the hash is cached (at most
one [block_size, D] tensor per cached block, on the rows' device); a hit serves the KV and the
rows, and an exporting sequence's hits stop at the first block without rows. `export_rows`
(called on every exported step) keeps new full blocks' rows and puts a fresh hit's rows in front
of the first step's rows, so the consumer still gets every position from 0."""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

import torch

from omnistage.engine.ar.sequence import Sequence


def block_hash(parent: bytes, token_ids: list[int], extra: list[tuple[int, bytes]]) -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    for offset, content in extra:  # media overlapping the block: where it starts + what it is
        h.update(offset.to_bytes(8, "little", signed=True))
        h.update(content)
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 max_row_bytes: int | None = None) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hit_tokens = 0  # prefix-cache hits, in tokens (metric)
        # exported hidden rows [block_size, D] of cached blocks, by block hash (module note),
        # least recently used first; they live outside the KV cache's memory, so their bytes
        # are capped (None: no cap): past the cap the oldest go (their blocks keep their KV,
        # but an exporting sequence's hits stop there)
        self.rows_of: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.max_row_bytes, self.row_bytes = max_row_bytes, 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now (truly free + evictable cached ones)."""
        return len(self.free)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    # ---------------------------------------------------------------- prefix cache
    def _full_block_hashes(self, seq: Sequence, upto_blocks: int) -> list[bytes]:
        bs = self.block_size
        hashes = seq.block_hashes[:upto_blocks]
        parent = hashes[-1] if hashes else b""
        for b in range(len(hashes), upto_blocks):
            start, end = b * bs, (b + 1) * bs
            ids = [seq.hash_token_id(i) for i in range(start, end)]
            extra = [(m.start - start, m.content_hash) for m in seq.media
                     if m.start < end and m.end > start]
            parent = block_hash(parent, ids, extra)
            hashes.append(parent)
        seq.block_hashes = hashes
        return hashes

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks for the longest full-block prefix, leaving >= 1 token to compute.
        A sequence that exports its hidden rows only hits blocks whose rows are kept."""
        if not (self.enable_prefix_caching and seq.cacheable):
            return []
        upto = (seq.num_tokens - 1) // self.block_size
        hits = []
        for h in self._full_block_hashes(seq, upto):
            block = self.hash_to_block.get(h)
            if block is None or (seq.export_hidden and h not in self.rows_of):
                break
            hits.append(block)
        return hits

    # ---------------------------------------------------------------- allocation
    def can_allocate(self, seq: Sequence, num_tokens: int, cached: list[int] = ()) -> bool:
        """Room for `num_tokens` tokens in the seq, given prefix hits `cached` (not owned yet)."""
        hits_in_free = sum(1 for b in cached if self.ref_count[b] == 0)
        need = max(0, -(-num_tokens // self.block_size) - len(seq.block_table) - len(cached))
        return need <= len(self.free) - hits_in_free

    def take_cached(self, seq: Sequence, cached: list[int]) -> None:
        for b in cached:
            if self.ref_count[b] == 0:
                del self.free[b]
            self.ref_count[b] += 1
            seq.block_table.append(b)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        seq.num_cached_tokens = seq.num_computed_tokens
        self.hit_tokens += seq.num_computed_tokens
        if seq.export_hidden and cached:
            hashes = seq.block_hashes[:len(cached)]
            for h in hashes:
                self.rows_of.move_to_end(h)  # (recently used: kept longest)
            seq.cached_rows = torch.cat([self.rows_of[h] for h in hashes])

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow seq's block table to hold `num_tokens` tokens (caller checked can_allocate)."""
        for _ in range(self.blocks_needed(seq, num_tokens)):
            b, _ = self.free.popitem(last=False)
            old = self.hash_of[b]
            if old is not None:  # evict its cached content
                if self.hash_to_block.get(old) == b:
                    del self.hash_to_block[old]
                    self._drop_rows(old)
                self.hash_of[b] = None
            self.ref_count[b] = 1
            seq.block_table.append(b)

    def commit(self, seq: Sequence) -> None:
        """Publish the hashes of blocks that became full and computed in the last step."""
        if not (self.enable_prefix_caching and seq.cacheable):
            return
        full = seq.num_computed_tokens // self.block_size
        hashes = self._full_block_hashes(seq, full)
        for b in range(full):
            block = seq.block_table[b]
            if self.hash_of[block] is None:
                self.hash_of[block] = hashes[b]
                self.hash_to_block.setdefault(hashes[b], block)

    def export_rows(self, seq: Sequence, hidden: tuple[int, torch.Tensor]
                    ) -> tuple[int, torch.Tensor]:
        """An exporting sequence's rows of one step (first position, rows [n, D]), after
        commit(seq) -> what to hand on: after a fresh prefix hit, the hit's rows in front. Rows
        of blocks that this step completed are kept for later hits (module note)."""
        start, rows = hidden
        cached, seq.cached_rows = seq.cached_rows, None
        if cached is not None and start == cached.shape[0]:
            start, rows = 0, torch.cat([cached.to(rows.dtype), rows])
        if self.enable_prefix_caching and seq.cacheable:
            self._keep_rows(seq, start, rows)
        return start, rows

    def _keep_rows(self, seq: Sequence, start: int, rows: torch.Tensor) -> None:
        bs = self.block_size
        # NOTE (tail pieces): a decode step hands one row per sequence. The rows of a block
        # not yet full wait as a list of pieces, joined once when the block completes, not by
        # a cat and a clone per sequence and step (64 small ops per thinker step at c32 on the
        # runtime thread). A one-row piece is a view of its step's output ([batch, D]); the
        # views of at most block_size steps are held. Longer pieces (a prefill's) are copied.
        tail = seq.row_tail
        if tail is not None and tail[0] + tail[2] == start:
            first_pos, pieces, count = tail[0], tail[1], tail[2] + rows.shape[0]
            pieces.append(rows)  # (the sequence's own list)
        else:
            first_pos, pieces, count = start, [rows], rows.shape[0]
        end = first_pos + count
        first, last = -(-first_pos // bs), min(end, seq.num_computed_tokens) // bs
        if last <= first:  # no block completed: the rows wait
            if rows.shape[0] > 1:
                pieces[-1] = rows.clone()
            seq.row_tail = (first_pos, pieces, count)
            return
        start, rows = first_pos, pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        hashes = self._full_block_hashes(seq, last)
        for b in range(first, last):
            h = hashes[b]
            if h in self.hash_to_block and h not in self.rows_of:
                # (a copy: a view would keep the whole step's output alive)
                kept = rows[b * bs - start:(b + 1) * bs - start].clone()
                self.rows_of[h] = kept
                self.row_bytes += kept.nbytes
                while self.max_row_bytes is not None and self.row_bytes > self.max_row_bytes:
                    self._drop_rows(next(iter(self.rows_of)))
        lo = max(last * bs, start)
        seq.row_tail = (lo, [rows[lo - start:].clone()], end - lo) if lo < end else None

    def _drop_rows(self, h: bytes) -> None:
        kept = self.rows_of.pop(h, None)
        if kept is not None:
            self.row_bytes -= kept.nbytes

    def release(self, seq: Sequence) -> None:
        """Drop the seq's references; blocks at ref 0 become free (cached ones stay reusable).
        Freed in reverse so a sequence's tail is evicted before its shared head."""
        for b in reversed(seq.block_table):
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                self.free[b] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.row_tail = seq.cached_rows = None
