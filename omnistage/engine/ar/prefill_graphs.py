"""Prefill steps of one sequence replayed from CUDA graphs (GPU fast path of the ModelRunner).

NOTE: a batch-1 prefill of a short prompt is host-bound (several times more host time than GPU
work; measured: benchmarks/results/profile_decode_h100_prefill_eager_2026-11-23.json), and the
thinker's and talker's prefills lie on the way to a request's first audio. So a step whose
only sequence computes 2..max_tokens positions runs the model as
the forward graph of the smallest bucket >= its token count T:
  - rows past T are padding: token 0 at position 0, K/V written into the runner's dummy block
    (beyond the block manager's range), and query_start_loc ends at T, so attention computes
    the real rows only. Layers act on rows independently, so padding never reaches them;
  - the model's output rows are copied into a static buffer outside the graph pool (shared with
    the decode graphs, which never replay at the same time);
  - the logits of the last row and the sampler then run eagerly, as after an eager forward.
Graphs are keyed (bucket, has replacement rows, has additive rows). warmup() captures the
token-only ones of every bucket; the first prefill with replacement or additive rows (a talker's:
the server's warm-up request brings one) captures that variant's every bucket, on padding rows.
A bucket first used later would stall its step for the capture: a prefix-cache hit or another
prompt length moves a prefill to another bucket, and a first request after warm-up waited for
one such capture on the way to its first audio. The stall is paid once per variant instead: the
warm-up request pays the talker's; the thinker's first prompt with media rows (replacement rows)
pays for its variant's buckets (about 5 captures) if the warm-up brought none.
EngineConfig.prefill_graphs=False turns them off.
"""

from __future__ import annotations

import torch

from omnistage.engine.ar.attention import AttentionMetadata
from omnistage.engine.ar.cuda_graphs import DecodeGraphs, _EagerGraph, smallest_bucket
from omnistage.engine.ar.interface import ForwardBatch

BUCKETS = (16, 32, 64, 128, 256)  # padded token counts; larger prefills stay eager
# int32 offsets of the step's seq_len and block table in `ints` (query_start_loc at 0): each
# 16-byte aligned, as a fresh tensor is, because Triton specializes its kernels on pointer
# alignment: unaligned, the graphs' prefill attention was a variant of its own, and the eager
# path's first batched prefill compiled its own variant (1.2 s in the first burst after a cold
# start on the H200)
_SEQ_LEN, _TABLE = 4, 8


class PrefillGraphs:
    def __init__(self, decode: DecodeGraphs, max_tokens: int = BUCKETS[-1]) -> None:
        self.decode = decode  # its capture streams, memory pool, dummy block, mrope flag
        self.buckets = [b for b in BUCKETS if b <= max_tokens]
        if not self.buckets:
            raise ValueError(f"max_tokens: {max_tokens} is below the smallest bucket {BUCKETS[0]}")
        T, MB = self.buckets[-1], decode.max_blocks
        self.max_tokens = T
        cuda = decode.device.type == "cuda"
        # [ids T | positions 3T | slots T] long and [query_start_loc 2 | seq_len 1 | table MB]
        # int32 (at 0, _SEQ_LEN and _TABLE), each filled from a pinned host buffer by one copy
        # per step
        self.longs_host = torch.zeros(5 * T, dtype=torch.long, pin_memory=cuda)
        self.ints_host = torch.zeros(_TABLE + MB, dtype=torch.int32, pin_memory=cuda)
        self.longs = torch.zeros(5 * T, dtype=torch.long, device=decode.device)
        self.ints = torch.zeros(_TABLE + MB, dtype=torch.int32, device=decode.device)
        self.copied = torch.cuda.Event() if cuda else None  # the last copy read the host buffers
        self.embeds: torch.Tensor | None = None  # [T, width] once a model sends such rows
        self.embeds_mask = torch.zeros(T, dtype=torch.bool, device=decode.device)
        self.additive: torch.Tensor | None = None
        self.hidden: torch.Tensor | None = None  # [T, D] forward output, outside the pool
        self.graphs: dict[tuple[int, bool, bool], object] = {}
        self.kv_len_host = 0  # host copy of the step's seq_len (eager mode's torch attention)
        self.num_runs = 0

    def bucket(self, n: int) -> int | None:
        return smallest_bucket(n, self.buckets)

    def can_run(self, seqs, num_tokens: list[int]) -> bool:
        return (len(seqs) == 1 and 1 < num_tokens[0] <= self.max_tokens
                and len(seqs[0].block_table) <= self.decode.max_blocks)

    # ---------------------------------------------------------------- host side
    def _fill(self, seq, start: int, n: int, T: int, positions: torch.Tensor) -> None:
        Tm, MB, bs = self.max_tokens, self.decode.max_blocks, self.decode.block_size
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copy has read the host buffers
        longs, ints = self.longs_host, self.ints_host
        longs[:T].zero_()
        longs[:n] = torch.tensor([seq.token_id(i) for i in range(start, start + n)])
        pos = longs[Tm:Tm + 3 * T].view(3, T)  # contiguous, as the eager path's [3, T]
        pos.zero_()
        pos[:, :n] = positions  # [3, n] (mrope) or [n], broadcast over the three rows
        table = seq.block_table
        slots = torch.arange(start, start + n)
        blocks = torch.tensor(table, dtype=torch.long)[slots // bs]
        longs[4 * Tm:4 * Tm + T] = self.decode.dummy_block * bs  # padding: the dummy block
        longs[4 * Tm:4 * Tm + n] = blocks * bs + slots % bs
        ints[0], ints[1], ints[_SEQ_LEN] = 0, n, start + n
        ints[_TABLE:_TABLE + MB] = self.decode.dummy_block
        ints[_TABLE:_TABLE + len(table)] = torch.tensor(table, dtype=torch.int32)
        self.kv_len_host = start + T
        self.longs.copy_(longs, non_blocking=True)
        self.ints.copy_(ints, non_blocking=True)
        if self.copied is not None:
            self.copied.record()

    def _stage_rows(self, embeds_row, add_row, n: int, T: int) -> None:
        if embeds_row is not None:
            e, m = embeds_row
            self.embeds[:n].copy_(e)
            self.embeds_mask[:n].copy_(m)
            self.embeds_mask[n:T].zero_()
        if add_row is not None:
            self.additive[:n].copy_(add_row)
            self.additive[n:T].zero_()

    def _ensure_row_buffers(self, embeds_row, add_row) -> None:
        T, dev, dtype = self.max_tokens, self.decode.device, self.decode.dtype
        if embeds_row is not None and self.embeds is None:
            self.embeds = torch.zeros(T, embeds_row[0].shape[-1], dtype=dtype, device=dev)
        if add_row is not None and self.additive is None:
            self.additive = torch.zeros(T, add_row.shape[-1], dtype=dtype, device=dev)

    # ---------------------------------------------------------------- device side
    def _forward(self, T: int, has_e: bool, has_a: bool, warm: bool) -> torch.Tensor:
        Tm, MB = self.max_tokens, self.decode.max_blocks
        longs, ints = self.longs, self.ints
        # host lists: read by the eager mode's torch attention only (all T rows, causal, so
        # the padding rows after the real ones do not change them)
        meta = AttentionMetadata(
            slot_mapping=longs[4 * Tm:4 * Tm + T], query_start_loc=ints[0:2],
            seq_lens=ints[_SEQ_LEN:_SEQ_LEN + 1],
            block_tables=ints[_TABLE:_TABLE + MB].view(1, MB),
            query_lens_cpu=[T], seq_lens_cpu=[self.kv_len_host], max_query_len=T,
            decode_only=False)
        # NOTE: every input is a contiguous tensor, as on the eager path: a strided view here
        # would give the compiled layer kernels a second specialization (and slower guards)
        pos = longs[Tm:Tm + 3 * T].view(3, T)
        fb = ForwardBatch(input_ids=longs[:T], positions=pos if self.decode.uses_mrope
                          else pos[0], attn=meta)
        if has_e:
            fb.inputs_embeds, fb.embeds_mask = self.embeds[:T], self.embeds_mask[:T]
        if has_a:
            fb.additive_embeds = self.additive[:T]
        hidden = self.decode.model(fb)
        if self.hidden is None:  # before the capture: outside the pool
            self.hidden = torch.zeros(Tm, hidden.shape[-1], dtype=hidden.dtype,
                                      device=hidden.device)
        if not warm:
            self.hidden[:T].copy_(hidden)
        return hidden

    def run(self, seq, start: int, n: int, positions: torch.Tensor, embeds_row, add_row
            ) -> torch.Tensor:
        """Positions [start, start + n) of `seq` through the model -> hidden [n, D], a view of
        a static buffer (valid until the next run). positions: [n] or [3, n] (mrope), host."""
        T = self.bucket(n)
        if T is None or n < 2:
            raise ValueError(f"num_tokens: {n}; prefill graphs take 2..{self.max_tokens}")
        self._ensure_row_buffers(embeds_row, add_row)
        has_e, has_a = embeds_row is not None, add_row is not None
        key = (T, has_e, has_a)
        if key not in self.graphs:  # (before _fill: the captures' runs use padding inputs)
            self._capture_variant(has_e, has_a)
        self._fill(seq, start, n, T, positions)
        self._stage_rows(embeds_row, add_row, n, T)
        self.graphs[key].replay()
        self.num_runs += 1
        return self.hidden[:n]

    def warmup(self) -> None:
        """Capture the token-only graph of every bucket now (a first use would stall a step)."""
        if self.decode.capture:
            self._capture_variant(False, False)

    def _capture_variant(self, has_e: bool, has_a: bool) -> None:
        """Every bucket's graph of this variant not captured yet, captured now on padding rows
        (eager mode: registered stand-ins, nothing runs). The row buffers a variant reads
        exist (_ensure_row_buffers) before it is captured."""
        todo = [T for T in self.buckets if (T, has_e, has_a) not in self.graphs]
        if not self.decode.capture:
            for T in todo:
                self.graphs[(T, has_e, has_a)] = _EagerGraph(
                    lambda warm, T=T: self._forward(T, has_e, has_a, warm), None)
            return
        longs, ints = self.longs_host, self.ints_host
        if self.copied is not None:
            self.copied.synchronize()
        longs.zero_()  # every row padding: token 0 at position 0 into the dummy block
        longs[4 * self.max_tokens:] = self.decode.dummy_block * self.decode.block_size
        ints.fill_(self.decode.dummy_block)
        ints[0], ints[1], ints[_SEQ_LEN] = 0, 1, 1
        self.longs.copy_(longs)
        self.ints.copy_(ints)
        if has_e:  # no row replaced, nothing added: the padding rows' plain embeddings
            self.embeds_mask.zero_()
        if has_a:
            self.additive.zero_()
        for T in todo:
            self.graphs[(T, has_e, has_a)] = self.decode.capture_graph(
                lambda warm, T=T: self._forward(T, has_e, has_a, warm))
