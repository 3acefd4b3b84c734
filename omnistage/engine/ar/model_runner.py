"""Owns the model and its paged KV cache; turns a ScheduledBatch into one forward + sampling.

Sampling runs on the SamplerState's device rows (one slot per sampling sequence): eagerly after
an eager forward, inside the head CUDA graph after a graphed decode. The engine/kernel switches
are EngineConfig's, read here once: the decoder layers get theirs at bind time."""

from __future__ import annotations

import gc
import itertools
from dataclasses import dataclass, field

import torch

from omnistage.engine.ar.attention import AttentionMetadata
from omnistage.engine.ar.cuda_graphs import DecodeGraphs, graphs_enabled
from omnistage.engine.ar.kernels import KernelOptions, configure_kernels
from omnistage.engine.ar.logprobs import device_rows, sample_with_logprobs, unpack
from omnistage.engine.ar.prefill_graphs import PrefillGraphs
from omnistage.engine.ar.sampler import SamplerState, SamplingFlags, StepSampling
from omnistage.engine.ar.scheduler import EngineConfig, ScheduledBatch
from omnistage.engine.ar.sequence import Sequence
from omnistage.engine.ar.interface import ForwardBatch
from omnistage.engine.ar.tp import StepChannel, TPGraphModel
from omnistage.layers.parallel import SINGLE
from omnistage.sampling_params import SamplingParams

CPU_KV_BUDGET_BYTES = 2 << 30  # default KV cache size on CPU when num_kv_blocks is unset


@dataclass
class StepResult:
    sampled: dict[str, int]  # request_id -> new token (seqs that reached the end of their tokens)
    hidden: dict[str, tuple[int, torch.Tensor]]  # request_id -> (first position, rows [n, D])
    codes: dict[str, list[int]] = field(default_factory=dict)  # request_id -> codebooks 1..K-1
    # request_id -> {token id: logprob} of its new token (SamplingParams.logprobs)
    logprobs: dict[str, dict[int, float]] = field(default_factory=dict)


@dataclass
class LaunchedBatch:
    """A step whose GPU work is queued (ModelRunner.launch -> finish). `result` is set when the
    step already ran to completion; else `partial` holds its exported rows and finish() adds
    the tokens."""

    batch: ScheduledBatch
    result: StepResult | None = None
    partial: StepResult | None = None
    sampling: StepSampling | None = None
    sample_rows: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None  # logits graph output (no sampler state on the graphs)
    inputs: list = field(default_factory=list)
    graph_run: int = -1  # DecodeGraphs run index (where its sampled ids land)
    sample_hidden: torch.Tensor | None = None  # multi-codebook: the sampled rows' hidden
    residual_rows: torch.Tensor | None = None  # multi-codebook, drawn in the head graph


def kv_bytes_per_block(model, block_size: int, dtype: torch.dtype) -> int:
    layers, n_kv, hd = model.kv_shape
    return 2 * layers * block_size * n_kv * hd * torch.tensor([], dtype=dtype).element_size()


class ModelRunner:
    def __init__(self, model, config: EngineConfig, device: torch.device, dtype: torch.dtype):
        self.model, self.config, self.device, self.dtype = model, config, device, dtype
        self.sampler: SamplerState | None = None
        # tensor parallel (engine/ar/tp.py): the model is this rank's shard; rank 0 sends each
        # step to the other ranks before its forward
        self.tp = getattr(model, "tp", SINGLE)
        self.channel = StepChannel(self.tp, device) if self.tp.enabled else None
        self.tp_workers = None  # rank 0: tp_workers.TPWorkers (set by the stage's builder)
        _check_tensor_parallel(model, config, self.tp)
        vocab = getattr(model, "vocab_size", None)
        if isinstance(vocab, int):  # before the KV cache takes the free memory
            self._sampler_state(vocab)
        self.num_blocks = self._num_blocks()
        use_graphs = graphs_enabled(config.cuda_graphs, device)
        layers, n_kv, hd = model.kv_shape
        # with graphs, one extra block past the block manager's range takes padding rows' K/V
        shape = (layers, self.num_blocks + int(use_graphs), config.block_size, n_kv, hd)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.kv_cache_bytes = 2 * self.k_cache.nbytes
        for i, attn in enumerate(model.attention_layers()):
            attn.k_cache, attn.v_cache = self.k_cache[i], self.v_cache[i]
        self.uses_mrope = getattr(model.config, "mrope_section", None) is not None
        # multi-codebook models (Qwen3-Omni's talker): after the first codebook is sampled,
        # model.predict_residuals draws the others within the same step
        self.code_groups = getattr(model, "num_code_groups", 1)
        self.num_forwards = 0
        configure_kernels(model, KernelOptions(
            compile=device.type == "cuda" and config.compile,
            fused_rope_kv=None if config.fused_rope_kv else False,  # None: where Triton runs
            triton_gemv=None if config.triton_gemv else False,
            gemv_fused_reduce=config.gemv_fused_reduce, pdl=config.pdl))
        self.graphs = DecodeGraphs(
            TPGraphModel(model, config.max_num_seqs) if self.tp.enabled else model,
            max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
            block_size=config.block_size, dummy_block=self.num_blocks,
            uses_mrope=self.uses_mrope, device=device, dtype=dtype, sampler=self.sampler,
            eager=config.cuda_graphs == "eager") if use_graphs else None
        self.prefill_graphs = PrefillGraphs(self.graphs) \
            if use_graphs and config.prefill_graphs and not self.tp.enabled else None
        if self.graphs is not None and self.tp.enabled and self.tp.rank == 0:
            self.graphs.before_forward = self.channel.send_graph

    def close(self) -> None:
        """Tensor parallel rank 0: the other ranks stop, the group is shut, the ranks go back
        to their pool idle (tp_workers.TPWorkers.close). Idempotent."""
        if self.tp_workers is not None:
            self.release_graphs()
            self.tp_workers.close()

    def release_graphs(self) -> None:
        """Destroy this rank's captured graphs, before its tensor-parallel group shuts: NCCL's
        communicator teardown (shutdown and abort alike) waits until every CUDA graph holding
        its collectives is gone, and rank 0's close blocked on 2 H200s while they lived."""
        if self.graphs is None and self.prefill_graphs is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # (no replay may still read them)
        self.graphs = self.prefill_graphs = None
        gc.collect()  # (a graph in a reference cycle would otherwise outlive the group)

    def pending_captures(self) -> int:
        """Decode batch sizes a lazy warm-up left for idle_capture (0: all captured)."""
        return 0 if self.graphs is None else self.graphs.pending_captures()

    def idle_capture(self) -> bool:
        """One decode batch size a lazy warm-up queued, captured now (True) if any is left.
        The caller makes sure nothing runs (no step in flight anywhere: runtime idle pass)."""
        if not self.pending_captures():
            return False
        return self.graphs.capture_next() is not None

    def warmup_graphs(self, params: list[SamplingParams], additive_width: int | None = None
                      ) -> None:
        """Capture the decode graphs of every batch size now (CUDA; EngineConfig.graph_warmup
        False leaves them to first use), with head graphs for these params and their greedy
        variant, min_tokens on and off."""
        if self.graphs is None or not self.config.graph_warmup:
            return
        flag_sets = warmup_flag_sets(params) if self.graphs.sampler is not None else [None]
        with torch.inference_mode():
            self.graphs.warmup(additive_width, flag_sets,
                               lazy=self.config.graph_warmup_plan == "lazy")
            if self.prefill_graphs is not None:
                self.prefill_graphs.warmup()

    def _sampler_state(self, vocab: int) -> SamplerState:
        if self.sampler is None:
            self.sampler = SamplerState(self.config.max_num_seqs, vocab, self.device,
                                        fast=self.config.fast_sampler)
        elif self.sampler.vocab_size != vocab:
            raise RuntimeError(f"sampler: logits have {vocab} columns, the model's vocab_size "
                               f"is {self.sampler.vocab_size}")
        return self.sampler

    def _num_blocks(self) -> int:
        c = self.config
        if c.num_kv_blocks is not None:
            return c.num_kv_blocks
        per_block = kv_bytes_per_block(self.model, c.block_size, self.dtype)
        want = c.max_num_seqs * -(-c.max_model_len // c.block_size) + 1
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * (c.kv_cache_memory_fraction or 0.9))
        else:
            budget = CPU_KV_BUDGET_BYTES
        n = min(want, budget // per_block)
        if self.tp.enabled:  # every rank's cache holds the blocks rank 0 schedules
            n = int(self.tp.all_reduce(torch.tensor([n], device=self.device), "min").item())
        if n < -(-c.max_model_len // c.block_size):
            raise ValueError(f"num_kv_blocks: memory for {n} blocks cannot hold one sequence of "
                             f"max_model_len={c.max_model_len}; lower max_model_len")
        return n

    # ---------------------------------------------------------------- inputs
    def prepare(self, batch: ScheduledBatch) -> tuple[ForwardBatch, list[int]]:
        bs = self.config.block_size
        ids, pos, slots, q_lens, kv_lens, sample_rows = [], [], [], [], [], []
        mrope_parts: list[torch.Tensor] = []
        embeds_rows, add_rows, any_embeds, any_add = [], [], False, False
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            ids.extend(seq.token_id(i) for i in range(start, end))
            pos.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[i // bs] * bs + i % bs for i in range(start, end))
            q_lens.append(n)
            kv_lens.append(end)
            if end == seq.num_tokens:
                sample_rows.append(len(ids) - 1)
            if self.uses_mrope:
                mrope_parts.append(_mrope_slice(seq, start, end))
            embeds, add = _input_rows(seq, start, end)
            embeds_rows.append(embeds)
            add_rows.append(add)
            any_embeds |= embeds is not None
            any_add |= add is not None
        dev = self.device
        T = len(ids)
        max_blocks = max(len(s.block_table) for s in batch.seqs)
        tables = torch.zeros(len(batch.seqs), max_blocks, dtype=torch.int32)
        for r, s in enumerate(batch.seqs):
            tables[r, :len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int32)
        qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
        qsl[1:] = torch.tensor(q_lens, dtype=torch.int32).cumsum(0)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long).to(dev, non_blocking=True),
            query_start_loc=qsl.to(dev, non_blocking=True),
            seq_lens=torch.tensor(kv_lens, dtype=torch.int32).to(dev, non_blocking=True),
            block_tables=tables.to(dev, non_blocking=True), query_lens_cpu=q_lens,
            seq_lens_cpu=kv_lens, max_query_len=max(q_lens), decode_only=max(q_lens) == 1)
        positions = (torch.cat(mrope_parts, dim=1).to(dev) if self.uses_mrope
                     else torch.tensor(pos, dtype=torch.long).to(dev, non_blocking=True))
        fb = ForwardBatch(input_ids=torch.tensor(ids, dtype=torch.long).to(dev, non_blocking=True),
                          positions=positions, attn=meta)
        if any_embeds:
            fb.inputs_embeds, fb.embeds_mask = self._stack_embeds(embeds_rows, q_lens, T)
        if any_add:
            fb.additive_embeds = self._stack_additive(add_rows, q_lens)
        return fb, sample_rows

    def _stack_embeds(self, rows, q_lens, T):
        width = next(r[0].shape[-1] for r in rows if r is not None)
        embeds = torch.zeros(T, width, dtype=self.dtype, device=self.device)
        mask = torch.zeros(T, dtype=torch.bool, device=self.device)
        off = 0
        for r, n in zip(rows, q_lens):
            if r is not None:
                e, m = r
                embeds[off:off + e.shape[0]] = e.to(self.dtype)
                mask[off:off + m.shape[0]] = m
            off += n
        return embeds, mask

    def _stack_additive(self, rows, q_lens):
        width = next(r.shape[-1] for r in rows if r is not None)
        parts = [r.to(self.device, self.dtype) if r is not None
                 else torch.zeros(n, width, dtype=self.dtype, device=self.device)
                 for r, n in zip(rows, q_lens)]
        return torch.cat(parts)

    # ---------------------------------------------------------------- step
    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch) -> LaunchedBatch:
        """Queue the step's GPU work. A graphed decode returns before the GPU is done (its
        tokens come back with finish()); other steps run to completion here."""
        pending = [s for s in batch.seqs if s.pending_media is not None]
        if pending:  # encoders run once per step over every prompt that needs them
            self.model.encode_media(pending)
        if (self.graphs is not None and not pending
                and self.graphs.can_run(batch.seqs, batch.num_tokens)):
            return self._launch_graph(batch)
        if (self.prefill_graphs is not None and not pending
                and self.prefill_graphs.can_run(batch.seqs, batch.num_tokens)):
            return LaunchedBatch(batch, result=self._execute_prefill_graph(batch))
        return LaunchedBatch(batch, result=self._execute_eager(batch))

    @torch.inference_mode()
    def finish(self, launched: LaunchedBatch) -> StepResult:
        """The launched step's tokens and exported rows (waits for its GPU work)."""
        if launched.result is not None:
            return launched.result
        batch, result, srows = launched.batch, launched.partial, launched.sample_rows
        seqs = batch.seqs
        step = launched.sampling
        if step is not None:
            drawn = self.graphs.sampled_tokens(len(seqs), launched.graph_run)
            tokens = [drawn[r] for r in srows]
            self.sampler.commit(step, tokens)
            if step.logprob_rows:
                packed = self.graphs.sampled_logprobs(len(step.logprob_rows), launched.graph_run)
                lps = unpack(packed, [drawn[r] for r in step.logprob_rows], step.logprob_k)
                result.logprobs = {seqs[r].request_id: d
                                   for r, d in zip(step.logprob_rows, lps)}
        elif srows:
            logits = launched.logits
            tokens, lps = self._sample_eager([seqs[r] for r in srows],
                                             logits[srows] if len(srows) < len(seqs) else logits)
            result.logprobs = {seqs[srows[i]].request_id: d for i, d in lps.items()}
        else:
            tokens = []
        result.sampled = {seqs[r].request_id: t for r, t in zip(srows, tokens)}
        if self.code_groups > 1 and srows:
            if launched.residual_rows is not None:  # drawn inside the head graph
                codes = self.graphs.sampled_codes(len(seqs), launched.graph_run)
                for r in srows:
                    seqs[r].residual_embeds.append(launched.residual_rows[r])
                result.codes = {seqs[r].request_id: codes[r] for r in srows}
            else:
                result.codes = self._residuals([seqs[r] for r in srows],
                                               launched.sample_hidden, tokens)
        return result

    def _execute_eager(self, batch: ScheduledBatch) -> StepResult:
        fb, sample_rows = self.prepare(batch)
        if self.channel is not None:
            self.channel.send_eager(fb, sample_rows)
        return self._after_forward(batch, self.model(fb), sample_rows, copy=False)

    def _execute_prefill_graph(self, batch: ScheduledBatch) -> StepResult:
        # one sequence, 2..max_tokens positions: the forward replayed from a padded graph
        seq, n = batch.seqs[0], batch.num_tokens[0]
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        positions = _mrope_slice(seq, start, end) if self.uses_mrope else torch.arange(start, end)
        embeds, add = _input_rows(seq, start, end)
        hidden = self.prefill_graphs.run(seq, start, n, positions, embeds, add)
        # the graph's output buffer is overwritten by the next replay: exported rows are cloned
        return self._after_forward(batch, hidden, [n - 1] if end == seq.num_tokens else [],
                                   copy=True)

    def _after_forward(self, batch: ScheduledBatch, hidden: torch.Tensor,
                       sample_rows: list[int], copy: bool) -> StepResult:
        """Exported rows and sampled tokens of a forward run to completion."""
        self.num_forwards += 1
        samplers = [s for s, n in zip(batch.seqs, batch.num_tokens)
                    if s.num_computed_tokens + n == s.num_tokens]
        result = StepResult({}, self._hidden_rows(batch, hidden, copy=copy))
        if samplers:
            logits = self.model.compute_logits(hidden[sample_rows])
            tokens, lps = self._sample_eager(samplers, logits)
            result.sampled = {s.request_id: t for s, t in zip(samplers, tokens)}
            result.logprobs = {samplers[i].request_id: d for i, d in lps.items()}
            if self.code_groups > 1:
                result.codes = self._residuals(samplers, hidden[sample_rows], tokens)
        return result

    def _residuals(self, seqs: list[Sequence], hidden: torch.Tensor, tokens: list[int]
                   ) -> dict[str, list[int]]:
        """The other codebooks of each just-sampled first code (hidden: the rows that sampled
        it); their summed embeddings are kept on the sequence for when the token is fed."""
        dev = hidden.device
        codes, embeds = self.model.predict_residuals(
            hidden, torch.tensor(tokens, device=dev),
            torch.tensor([s.seed & 0x7FFFFFFFFFFFFFFF for s in seqs], device=dev),
            torch.tensor([len(s.output_token_ids) for s in seqs], device=dev),
            torch.tensor([s.params.greedy for s in seqs], device=dev),
            all_greedy=all(s.params.greedy for s in seqs))
        for seq, row in zip(seqs, embeds):
            seq.residual_embeds.append(row)
        return {s.request_id: c for s, c in zip(seqs, codes.tolist())}

    def can_launch_ahead(self, prev: LaunchedBatch) -> bool:
        """Whether the next step of prev's sequences can be queued before prev's tokens are
        back: prev is a graphed decode whose every row samples on the device."""
        # (not for multi-codebook models: the next input needs this step's residual codes)
        return (prev.sampling is not None and prev.result is None and self.code_groups == 1
                and len(prev.sample_rows) == len(prev.batch.seqs))

    @torch.inference_mode()
    def launch_ahead(self, batch: ScheduledBatch) -> LaunchedBatch:
        """Queue a decode step of the last launched step's sequences, one position further
        (batch.ahead == 1); its input ids are that step's sampled ids, on the device."""
        return self._launch_graph(batch)

    def _launch_graph(self, batch: ScheduledBatch) -> LaunchedBatch:
        # decode-only: one row per sequence, replayed from the graphs of the padded size
        seqs, ahead = batch.seqs, batch.ahead
        rows = [_input_rows(s, s.num_computed_tokens + ahead, s.num_computed_tokens + ahead + 1)
                for s in seqs]
        # (a step launched ahead samples every row: its sequences sampled in the last step)
        srows = [r for r, s in enumerate(seqs) if s.num_computed_tokens + 1 == s.num_tokens]
        # no sampler state on the graphs (a model without vocab_size): logits, sampled eagerly
        eager = self.graphs.sampler is None
        step = self.sampler.prepare(seqs, srows, ahead) if srows and not eager else None
        hidden, logits, run = self.graphs.run(seqs, [r[0] for r in rows], [r[1] for r in rows],
                                              step, logits=bool(srows) and eager, ahead=ahead)
        self.num_forwards += 1
        # graph outputs are overwritten by the next replay: exported rows are cloned
        partial = StepResult({}, self._hidden_rows(batch, hidden, copy=True))
        # rows: the GPU may still read them; they live until finish()
        residual_rows = sample_hidden = None
        if self.code_groups > 1 and srows:
            # every row samples here (decode): the head graph's residual rows, or the hidden
            # rows for the eager code predictor
            residual_rows = self.graphs.residual_rows(len(seqs)) if step is not None else None
            if residual_rows is None:
                sample_hidden = hidden[srows]
        return LaunchedBatch(batch, partial=partial, sampling=step, sample_rows=srows,
                             logits=logits, inputs=rows, graph_run=run,
                             sample_hidden=sample_hidden, residual_rows=residual_rows)

    def _sample_eager(self, samplers: list[Sequence], logits: torch.Tensor
                      ) -> tuple[list[int], dict[int, dict[int, float]]]:
        """logits: [len(samplers), V] fp32 -> their tokens, and index -> {token id: logprob}
        for those whose params ask logprobs."""
        state = self._sampler_state(logits.shape[-1])
        step = state.prepare(samplers, list(range(len(samplers))))
        slots, steps, force = state.device_inputs(step)
        rows = device_rows(step.logprob_rows, logits.device)
        ids, packed = sample_with_logprobs(state, logits, slots, steps, force, step.flags, rows,
                                           max(step.logprob_k, default=0))
        if packed is not None:  # queued before the sync of tolist() (no wait of its own)
            packed = packed.to("cpu", non_blocking=True)
        tokens = ids.tolist()
        state.commit(step, tokens)
        if packed is None:
            return tokens, {}
        lps = unpack(packed.numpy(), [tokens[r] for r in step.logprob_rows], step.logprob_k)
        return tokens, dict(zip(step.logprob_rows, lps))

    @staticmethod
    def _hidden_rows(batch: ScheduledBatch, hidden: torch.Tensor, copy: bool) -> dict:
        # hidden: [T, D] flat rows of the batch -> request_id -> (first position, rows [n, D]);
        # copy: one clone of the batch's rows, each request getting a view of it (one kernel
        # per step, not one per request)
        exports = [_exports(seq, batch.ahead) for seq in batch.seqs]
        if copy and any(exports):
            hidden = hidden[:sum(batch.num_tokens)].clone()
        out, off = {}, 0
        for seq, n, export in zip(batch.seqs, batch.num_tokens, exports):
            if export:
                out[seq.request_id] = (seq.num_computed_tokens + batch.ahead, hidden[off:off + n])
            off += n
        return out


def warmup_flag_sets(params: list[SamplingParams]) -> list[SamplingFlags]:
    """The SamplingFlags whose head graphs ModelRunner.warmup_graphs captures for these params
    (also what their sampler kernels compile for: engine/ar/kernels_ahead_ar.py)."""
    flag_sets = set()
    for p in params:
        for greedy, banned in itertools.product((p.greedy, True), (False, True)):
            flag_sets.add(SamplingFlags(greedy, p.top_k > 0 and not greedy,
                                        p.top_p < 1 and not greedy, p.min_p > 0 and not greedy,
                                        p.needs_penalties, banned))
    return sorted(flag_sets, key=str)


def _check_tensor_parallel(model, config: EngineConfig, tp) -> None:
    if config.tensor_parallel_size != tp.size:
        raise ValueError(f"tensor_parallel_size: {config.tensor_parallel_size}, but the model "
                         f"was built for {tp.size} rank(s) (build it through the stage's "
                         "builder, runtime/build.py)")
    supported = getattr(model, "supports_tensor_parallel", None)
    if tp.enabled and (supported is None or not supported()):
        raise ValueError(f"tensor_parallel_size: {tp.size}, but {type(model).__name__} runs on "
                         "one rank (docs/distributed.md lists the models that shard)")
    if tp.enabled and getattr(model, "num_code_groups", 1) > 1:
        raise ValueError("tensor_parallel_size: multi-codebook models (Qwen3-Omni's talker) "
                         "run on one rank")


def _exports(seq: Sequence, ahead: int) -> bool:
    """Whether this step's rows of seq are exported (a step past the prompt of a
    prompt-only export is not: decode steps then copy no rows)."""
    return seq.export_hidden and not (
        seq.export_prompt_only and seq.num_computed_tokens + ahead >= seq.num_prompt_tokens)


def _mrope_slice(seq: Sequence, start: int, end: int) -> torch.Tensor:
    # [3, end-start]: prompt positions from the processor, later ones i + rope_delta on all axes
    p = seq.mrope_positions
    n_prompt = p.shape[1] if p is not None else 0
    parts = []
    if p is not None and start < n_prompt:
        parts.append(p[:, start:min(end, n_prompt)].cpu())
    lo = max(start, n_prompt)
    if lo < end:
        parts.append(torch.arange(lo, end, dtype=torch.long).add(seq.rope_delta).expand(3, -1))
    return torch.cat(parts, dim=1)


def _input_rows(seq: Sequence, start: int, end: int):
    """(replacement rows + mask, additive rows) for positions [start, end) of one sequence."""
    embeds, add = _source_rows(seq, start, end)
    P = seq.num_prompt_tokens
    if seq.residual_embeds and end > P:
        # fed output tokens of a multi-codebook model: add their other codebooks' embeddings
        lo = max(start, P)
        res = seq.residual_embeds[lo - P:end - P]
        rows = res[0].unsqueeze(0) if len(res) == 1 else torch.stack(res)
        if lo > start:
            rows = torch.cat([rows.new_zeros(lo - start, rows.shape[-1]), rows])
        add = rows if add is None else add + rows.to(add.dtype)
    return embeds, add


def _source_rows(seq: Sequence, start: int, end: int):
    if seq.input_source is not None:
        rows, replace = seq.input_source.rows(seq, start, end)
        if replace is None:
            return None, rows
        if bool(replace.all()):
            return (rows, replace), None
        return (rows, replace), rows.masked_fill(replace[:, None], 0.0)
    e = seq.prompt_embeds
    if e is None or start >= e.shape[0]:
        return None, None
    stop = min(end, e.shape[0])
    return (e[start:stop], seq.prompt_embeds_mask[start:stop]), None
