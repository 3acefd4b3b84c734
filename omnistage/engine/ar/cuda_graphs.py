"""Decode steps replayed from CUDA graphs (GPU fast path of the ModelRunner).

A decode-only step of B sequences runs through a graph captured for the smallest captured size
>= B; rows past B are padding that writes its K/V into a dummy block the runner keeps beyond
the block manager's range. The graph holds the model forward and the logits; sampling stays
eager on the graph's static logits (exact, and penalties/bans need host-built masks).

Static inputs live in one int32 device buffer filled from one pinned host buffer by one
non_blocking copy per step: [ids M | positions 3M | slots M | seq_lens M | tables M x MB]
(M = largest size, MB = blocks per sequence at max_model_len). Graphs are captured lazily per
(size, has replacement rows, has additive rows) and share one memory pool."""

from __future__ import annotations

import os

import torch

from omnistage.engine.ar.attention import AttentionMetadata
from omnistage.models.interface import ForwardBatch


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, 48, 64, 80, ... up to (and including) max_num_seqs."""
    sizes = [s for s in (1, 2, 4, 8, 16, 32) if s < max_num_seqs]
    s = 48
    while s < max_num_seqs:
        sizes.append(s)
        s += 16
    return sizes + [max_num_seqs]


def graphs_enabled(device: torch.device) -> bool:
    """CUDA device, Triton attention importable, and not turned off by OMNISTAGE_CUDA_GRAPHS=0."""
    if device.type != "cuda" or os.environ.get("OMNISTAGE_CUDA_GRAPHS", "1") == "0":
        return False
    from omnistage.engine.ar.attention import _triton_ok
    return _triton_ok(device)


class _Graph:
    def __init__(self, graph: torch.cuda.CUDAGraph, hidden: torch.Tensor,
                 logits: torch.Tensor) -> None:
        self.graph, self.hidden, self.logits = graph, hidden, logits


class DecodeGraphs:
    def __init__(self, model, *, max_num_seqs: int, max_model_len: int, block_size: int,
                 dummy_block: int, uses_mrope: bool, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.model, self.device, self.dtype = model, device, dtype
        self.sizes = graph_batch_sizes(max_num_seqs)
        M = self.max_size = self.sizes[-1]
        self.block_size, self.dummy_block, self.uses_mrope = block_size, dummy_block, uses_mrope
        MB = self.max_blocks = -(-max_model_len // block_size)
        self._off = {"ids": 0, "pos": M, "slots": 4 * M, "lens": 5 * M, "tables": 6 * M}
        total = 6 * M + M * MB
        self.host = torch.zeros(total, dtype=torch.int32, pin_memory=True)
        self.host_np = self.host.numpy()
        self.dev = torch.zeros(total, dtype=torch.int32, device=device)
        self._fill_padding(0)
        self.dev.copy_(self.host)
        self.qsl = torch.arange(M + 1, dtype=torch.int32, device=device)
        # row buffers [M, width], allocated when a model first sends rows (width = its input's)
        self.embeds: torch.Tensor | None = None
        self.embeds_mask = torch.zeros(M, dtype=torch.bool, device=device)
        self.additive: torch.Tensor | None = None
        self.graphs: dict[tuple[int, bool, bool], _Graph] = {}
        self.pool = None
        self.copied = torch.cuda.Event()

    # ---------------------------------------------------------------- host side
    def padded_size(self, n: int) -> int | None:
        return next((s for s in self.sizes if s >= n), None)

    def can_run(self, seqs, num_tokens: list[int]) -> bool:
        return (len(seqs) <= self.max_size and all(n == 1 for n in num_tokens)
                and all(len(s.block_table) <= self.max_blocks for s in seqs))

    def _view(self, name: str, n: int):
        o = self._off[name]
        return self.host_np[o:o + n]

    def _fill_padding(self, start: int) -> None:
        # rows >= start: token 0 at position 0, one key in the dummy block's slot 0
        M, MB, o = self.max_size, self.max_blocks, self._off
        h = self.host_np
        h[o["ids"] + start:o["ids"] + M] = 0
        for a in range(3):
            h[o["pos"] + a * M + start:o["pos"] + (a + 1) * M] = 0
        h[o["slots"] + start:o["slots"] + M] = self.dummy_block * self.block_size
        h[o["lens"] + start:o["lens"] + M] = 1
        h[o["tables"] + start * MB:o["tables"] + M * MB:MB] = self.dummy_block

    def _fill(self, seqs, B: int) -> int:
        """Writes the step's ints into the pinned buffer; returns how many ints to copy."""
        self.copied.synchronize()  # the previous step's copy has read the buffer
        M, MB, bs, o = self.max_size, self.max_blocks, self.block_size, self._off
        h = self.host_np
        for r, seq in enumerate(seqs):
            i = seq.num_computed_tokens
            h[o["ids"] + r] = seq.token_id(i)
            table = seq.block_table
            h[o["slots"] + r] = table[i // bs] * bs + i % bs
            h[o["lens"] + r] = i + 1
            h[o["tables"] + r * MB:o["tables"] + r * MB + len(table)] = table
            p = seq.mrope_positions
            if self.uses_mrope and p is not None and i < p.shape[1]:
                for a in range(3):
                    h[o["pos"] + a * M + r] = int(p[a, i])
            else:
                pos = i + (seq.rope_delta if self.uses_mrope else 0)
                for a in range(3):
                    h[o["pos"] + a * M + r] = pos
        self._fill_padding(len(seqs))
        return o["tables"] + B * MB

    def _stage_rows(self, embeds_rows, add_rows, B: int, has_e: bool, has_a: bool) -> None:
        # device rows of the step into the static buffers; padding rows zero / unmasked
        n = len(embeds_rows)
        if has_e:
            self.embeds_mask[:B].zero_()
            for r, e in enumerate(embeds_rows):
                if e is not None:
                    self.embeds[r:r + 1].copy_(e[0])
                    self.embeds_mask[r:r + 1].copy_(e[1])
        if has_a:
            if all(a is not None for a in add_rows):
                self.additive[:n].copy_(torch.cat(add_rows))
            else:
                for r, a in enumerate(add_rows):
                    if a is None:
                        self.additive[r].zero_()
                    else:
                        self.additive[r:r + 1].copy_(a)
            self.additive[n:B].zero_()

    def _ensure_row_buffers(self, embeds_rows, add_rows) -> None:
        M = self.max_size
        for e in embeds_rows:
            if e is not None and self.embeds is None:
                self.embeds = torch.zeros(M, e[0].shape[-1], dtype=self.dtype, device=self.device)
        for a in add_rows:
            if a is not None and self.additive is None:
                self.additive = torch.zeros(M, a.shape[-1], dtype=self.dtype, device=self.device)

    # ---------------------------------------------------------------- device side
    def _forward(self, B: int, has_e: bool, has_a: bool) -> tuple[torch.Tensor, torch.Tensor]:
        M, MB, o = self.max_size, self.max_blocks, self._off
        d = self.dev
        tables = d[o["tables"]:o["tables"] + M * MB].view(M, MB)[:B]
        meta = AttentionMetadata(
            slot_mapping=d[o["slots"]:o["slots"] + B].long(), query_start_loc=self.qsl[:B + 1],
            seq_lens=d[o["lens"]:o["lens"] + B], block_tables=tables,
            query_lens_cpu=[1] * B, seq_lens_cpu=[1] * B, max_query_len=1, decode_only=True)
        pos = d[o["pos"]:o["pos"] + 3 * M].view(3, M)[:, :B].long()
        fb = ForwardBatch(input_ids=d[o["ids"]:o["ids"] + B].long(),
                          positions=pos if self.uses_mrope else pos[0], attn=meta)
        if has_e:
            fb.inputs_embeds, fb.embeds_mask = self.embeds[:B], self.embeds_mask[:B]
        if has_a:
            fb.additive_embeds = self.additive[:B]
        hidden = self.model(fb)
        return hidden, self.model.compute_logits(hidden)

    def _capture(self, key: tuple[int, bool, bool]) -> _Graph:
        B, has_e, has_a = key
        if has_e:
            self.embeds_mask[:B].zero_()
        if has_a:
            self.additive[:B].zero_()
        s = torch.cuda.Stream(self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):  # warm-up: Triton compiles, lazy buffers settle
            for _ in range(2):
                self._forward(B, has_e, has_a)
        torch.cuda.current_stream(self.device).wait_stream(s)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            hidden, logits = self._forward(B, has_e, has_a)
        return _Graph(g, hidden, logits)

    def run(self, seqs, embeds_rows, add_rows) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step of len(seqs) sequences -> (hidden [n, D], logits [n, V]) views of the
        graph's static outputs (valid until the next run)."""
        n = len(seqs)
        B = self.padded_size(n)
        has_e = any(e is not None for e in embeds_rows)
        has_a = any(a is not None for a in add_rows)
        key = (B, has_e, has_a)
        self._ensure_row_buffers(embeds_rows, add_rows)
        count = self._fill(seqs, B)
        self.dev[:count].copy_(self.host[:count], non_blocking=True)
        self.copied.record()
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = self._capture(key)
        self._stage_rows(embeds_rows, add_rows, B, has_e, has_a)
        graph.graph.replay()
        return graph.hidden[:n], graph.logits[:n]
