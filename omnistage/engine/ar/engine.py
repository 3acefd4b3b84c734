"""The AR stage engine: step() = schedule -> execute -> update. One instance per AR stage.

NOTE (async scheduling): with decode graphs, a step is split into launch() and collect(), and
launch_ahead(prev) queues the next decode step of prev's sequences while prev runs, its input
ids taken from prev's sampled ids on the device, so the host's collect/schedule time hides
behind the GPU. Only when nothing the host knows can change the batch: no request waiting,
none reaching max_tokens / forced ids / max_model_len, every next input row ready. A request
that stops on an EOS or stop string in prev wastes its row of the step ahead (dropped at
collect). EngineConfig.async_scheduling=False turns it off. Structured output: the step ahead
queues only its forward; launch() queues its sampler once prev's tokens were accepted by the
grammar matchers (their masks for the step need them), which fill while the forward runs."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from omnistage.engine.ar.block_manager import BlockManager
from omnistage.engine.ar.detokenizer import DetokState, detokenize_step, find_stop
from omnistage.engine.ar.model_runner import LaunchedBatch, ModelRunner
from omnistage.engine.ar.scheduler import EngineConfig, Scheduler
from omnistage.engine.ar.sequence import Sequence
from omnistage.engine.ar.structured_output import GrammarCache

# the exported hidden rows kept beside cached blocks (block_manager.py) may take at most this
# share of the KV cache's bytes on top of it
ROW_CACHE_FRACTION = 0.1


@dataclass
class SequenceUpdate:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    hidden: tuple[int, torch.Tensor] | None = None  # (first position, rows [n, D]) on device
    new_codes: list[list[int]] = field(default_factory=list)  # multi-codebook: all codebooks
    # SamplingParams.logprobs: per new token, {token id: logprob} (logprobs.unpack)
    logprobs: list[dict[int, float]] | None = None


class AREngine:
    def __init__(self, model, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                 tokenizer=None, eos_token_ids: set[int] | None = None) -> None:
        config.validate()
        self.config, self.tokenizer = config, tokenizer
        self.eos_token_ids = frozenset(eos_token_ids or ())
        self.runner = ModelRunner(model, config, device, dtype)
        self.blocks = BlockManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
            max_row_bytes=int(ROW_CACHE_FRACTION * self.runner.kv_cache_bytes))
        self.scheduler = Scheduler(config, self.blocks)
        self.seqs: dict[str, Sequence] = {}
        self.detok: dict[str, DetokState] = {}
        self.num_steps = 0
        self.num_ahead_steps = 0
        self._arrivals = 0
        self.async_scheduling = config.async_scheduling
        self._ahead: LaunchedBatch | None = None  # launched ahead; launch() returns it next
        self._grammars: GrammarCache | None = None  # structured output, at first use

    # ---------------------------------------------------------------- requests
    def add_request(self, seq: Sequence) -> None:
        if seq.request_id in self.seqs:
            raise ValueError(f"request_id: {seq.request_id!r} is already running")
        if seq.num_prompt_tokens == 0:
            raise ValueError("prompt: is empty")
        if seq.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(f"prompt: {seq.num_prompt_tokens} tokens; this stage's "
                             f"max_model_len is {self.config.max_model_len}")
        if not seq.params.ignore_eos:
            seq.stop_token_ids = seq.stop_token_ids | self.eos_token_ids
        seq.stop_token_ids = seq.stop_token_ids | frozenset(seq.params.stop_token_ids)
        if seq.params.structured_output is not None:
            seq.grammar = self._grammar_cache().matcher(seq.params.structured_output,
                                                        list(seq.stop_token_ids))
        seq.arrival = self._arrivals
        self._arrivals += 1
        self.seqs[seq.request_id] = seq
        self.detok[seq.request_id] = DetokState()
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        self.detok.pop(request_id, None)
        self.scheduler.finish(seq, "abort")
        if self._ahead is not None and not any(self.seqs.get(s.request_id) is s
                                               for s in self._ahead.batch.seqs):
            self._ahead = None  # nothing of it is left to collect
        return True

    def has_unfinished(self) -> bool:
        return bool(self.seqs) or self._ahead is not None

    def _grammar_cache(self) -> GrammarCache:
        if self._grammars is None:
            vocab = getattr(self.runner.model, "vocab_size", None)
            if self.tokenizer is None or not isinstance(vocab, int):
                raise ValueError("structured_output: this stage has no tokenizer to build a "
                                 "grammar with")
            self._grammars = GrammarCache(self.tokenizer, vocab)
        return self._grammars

    @staticmethod
    def new_seed() -> int:
        return random.SystemRandom().getrandbits(63)

    # ---------------------------------------------------------------- step
    def step(self) -> list[SequenceUpdate]:
        launched = self.launch()
        if launched is None:
            return []
        self.launch_ahead(launched)
        return self.collect(launched)

    def launch(self) -> LaunchedBatch | None:
        """Queue one step's GPU work: the step launched ahead if there is one, else a newly
        scheduled one (None: nothing to run). collect() must follow before the next launch()."""
        if self._ahead is not None:
            launched, self._ahead = self._ahead, None
            # structured output: its head (the sampler) waited for the last step's tokens,
            # accepted by the matchers in collect(); the forward is already queued
            if self.runner.graphs is not None:
                self.runner.graphs.run_deferred_head()
            return launched
        batch = self.scheduler.schedule()
        if batch is None:
            return None
        self.num_steps += 1
        return self.runner.launch(batch)

    def launch_ahead(self, prev: LaunchedBatch) -> LaunchedBatch | None:
        """Async scheduling (module note): queue the step after `prev` (launched, not yet
        collected) when the host can already tell what it is. launch() returns it next."""
        if not self.async_scheduling or self._ahead is not None \
                or not self.runner.can_launch_ahead(prev):
            return None
        # a sequence whose prev token ends it whatever the token is: no step after prev
        if any(self._known_end(s, len(s.output_token_ids) + 1, s.num_tokens + 1)
               for s in prev.batch.seqs):
            return None
        batch = self.scheduler.schedule_ahead(prev.batch.seqs)
        if batch is None:
            return None
        self.num_steps += 1
        self.num_ahead_steps += 1
        self._ahead = self.runner.launch_ahead(batch)
        return self._ahead

    def collect(self, launched: LaunchedBatch) -> list[SequenceUpdate]:
        """The launched step's tokens -> sequence updates (waits for its GPU work)."""
        batch, result = launched.batch, self.runner.finish(launched)
        updates = []
        for seq, n in zip(batch.seqs, batch.num_tokens):
            if self.seqs.get(seq.request_id) is not seq:  # aborted while the step ran
                continue
            seq.num_computed_tokens += n
            self.blocks.commit(seq)
            token = result.sampled.get(seq.request_id)
            if token is not None and seq.forced_output_ids is not None:
                token = seq.forced_output_ids[len(seq.output_token_ids)]
            hidden = result.hidden.get(seq.request_id)
            if hidden is not None:  # (rows of prefix-cache hits go first; full blocks' are kept)
                hidden = self.blocks.export_rows(seq, hidden)
            if token is None and hidden is None:
                continue
            update = SequenceUpdate(seq.request_id, [], "", False, hidden=hidden)
            if token is not None:
                codes = result.codes.get(seq.request_id)
                if codes is not None:
                    update.new_codes.append([token] + codes)
                lp = result.logprobs.get(seq.request_id)
                if lp is not None:
                    update.logprobs = [lp]
                self._append_token(seq, token, update)
            updates.append(update)
        return updates

    def _append_token(self, seq: Sequence, token: int, update: SequenceUpdate) -> None:
        if seq.grammar is not None and not seq.grammar.accept(token):
            # (the bitmask allowed only what the matcher accepts: an engine bug, not the user's)
            self._finish(seq, "error", update, f"structured_output: the sampled token {token} "
                         "does not follow the grammar")
            return
        seq.output_token_ids.append(token)
        update.new_token_ids.append(token)
        p, n_out = seq.params, len(seq.output_token_ids)
        if token in seq.stop_token_ids and n_out >= p.min_tokens:
            reason = "stop"
        elif seq.grammar is not None and seq.grammar.terminated:  # a grammar without stop ids
            reason = "stop"
        else:
            reason = self._known_end(seq, n_out, seq.num_tokens)
        if self.tokenizer is not None:
            state = self.detok[seq.request_id]
            new = detokenize_step(self.tokenizer, seq.output_token_ids, state,
                                  p.skip_special_tokens)
            seq.output_text += new
            if reason is None and p.stop and new:
                cut = find_stop(seq.output_text, len(new), p.stop)
                if cut is not None:
                    stop = next(s for s in p.stop if seq.output_text.startswith(s, cut))
                    seq.output_text = seq.output_text[:cut + (len(stop) if
                                                              p.include_stop_str_in_output else 0)]
                    reason = "stop"
            # NOTE: while a stop string could still complete, its possible start is held back
            hold = 0 if reason or not p.stop else max(len(s) for s in p.stop) - 1
            upto = max(state.emitted, len(seq.output_text) - hold)
            update.new_text = seq.output_text[state.emitted:upto]
            state.emitted = upto
        if reason is not None:
            self._finish(seq, reason, update)

    def _known_end(self, seq: Sequence, n_out: int, num_tokens: int) -> str | None:
        """The finish reason at n_out output tokens (num_tokens in all) whatever they are."""
        p = seq.params
        if seq.forced_output_ids is not None and n_out >= len(seq.forced_output_ids):
            return "stop"
        if (p.max_tokens is not None and n_out >= p.max_tokens) or \
                num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str, update: SequenceUpdate,
                error: str | None = None) -> None:
        self.scheduler.finish(seq, reason)
        self.seqs.pop(seq.request_id, None)
        self.detok.pop(seq.request_id, None)
        update.finished, update.finish_reason, update.error = True, reason, error
        seq.error = error

    def drop_ahead(self) -> None:
        """Forget the step launched ahead (after a crash: its work is not collected)."""
        self._ahead = None

    def fail(self, request_id: str, error: str) -> SequenceUpdate | None:
        """End one request with an error (the others go on)."""
        seq = self.seqs.get(request_id)
        if seq is None:
            return None
        update = SequenceUpdate(request_id, [], "", False)
        self._finish(seq, "error", update, error)
        return update

    # ---------------------------------------------------------------- metrics
    @property
    def stats(self) -> dict[str, int]:
        return {"num_steps": self.num_steps, "num_ahead_steps": self.num_ahead_steps,
                "num_forwards": self.runner.num_forwards,
                "prefix_cache_hit_tokens": self.blocks.hit_tokens,
                "num_preemptions": self.scheduler.num_preemptions,
                "num_free_blocks": self.blocks.num_free_blocks,
                "num_kv_blocks": self.blocks.num_blocks,
                "num_running": len(self.scheduler.running),
                "num_waiting": len(self.scheduler.waiting)}
