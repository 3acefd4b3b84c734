"""Structured output (SamplingParams.structured_output) through xgrammar.

Grammars are compiled against the stage's tokenizer once per (schema, prefix, suffix) and
cached; each request gets a GrammarMatcher that advances with every token it accepts. Before a
step samples, the matcher writes the row of allowed ids (a bitmask, 32 ids per int32 word) that
SamplerState keeps per slot on the device; apply_token_bitmask sets every other logit to -inf
before penalties, warpers, the draw and logprobs (greedy and sampled rows alike).

NOTE: the matcher's stop ids are the sequence's (the checkpoint's EOS ids plus the request's
stop_token_ids): the grammar allows them only where the JSON is complete."""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

import torch

from omnistage.sampling_params import StructuredOutput

MAX_CACHED_GRAMMARS = 256


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row of a vocabulary's bitmask."""
    return -(-vocab_size // 32)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [N, V] fp32, bitmask [N, ceil(V/32)] int32 (bit i%32 of word i//32 set: id i is
    allowed) -> logits with the disallowed ids -inf. Capturable (no host sync); an all-ones
    row (-1 words) leaves its logits unchanged."""
    V = logits.shape[-1]
    ids = torch.arange(V, device=logits.device)
    words = bitmask.index_select(1, ids >> 5)  # [N, V] int32
    allowed = ((words >> (ids & 31).to(torch.int32)) & 1) != 0  # (arithmetic shift: bit 31 ok)
    return logits.masked_fill(~allowed, float("-inf"))


class GrammarMatcher:
    """One request's position in its grammar (wraps xgrammar.GrammarMatcher)."""

    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the ids allowed next into `row` of a CPU int32 bitmask [R, words]."""
        self._m.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        """Advance by one emitted token; False if the grammar does not allow it."""
        return bool(self._m.accept_token(token))

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop id was accepted (or it has no stop ids)."""
        return bool(self._m.is_terminated())


class BitmaskFiller:
    """Fills the bitmask rows of a step's matchers: one at a time, or for several at once
    with xgrammar's batch matcher (its threads fill rows in parallel)."""

    def __init__(self, threads: int = 4) -> None:
        self.threads = max(1, min(threads, os.cpu_count() or 1))
        self._batch: Any = None

    def fill(self, matchers: list[GrammarMatcher], bitmask: torch.Tensor,
             rows: list[int]) -> None:
        """Write each matcher's allowed ids into its row of `bitmask` (CPU int32 [R, words])."""
        if len(matchers) == 1:
            matchers[0].fill_bitmask(bitmask, rows[0])
            return
        if self._batch is None:
            import xgrammar
            self._batch = xgrammar.BatchGrammarMatcher(self.threads)
        self._batch.batch_fill_next_token_bitmask([m._m for m in matchers], bitmask, rows)


class GrammarCache:
    """Compiles StructuredOutput grammars for one tokenizer (xgrammar), LRU-cached by spec."""

    def __init__(self, tokenizer: Any, vocab_size: int, tokenizer_info: Any = None) -> None:
        """tokenizer: a transformers tokenizer (or None with `tokenizer_info`, an
        xgrammar.TokenizerInfo built elsewhere, e.g. a benchmark's synthetic vocabulary)."""
        import xgrammar  # imported where a stage first needs a grammar
        self._xgr = xgrammar
        self.vocab_size = vocab_size
        info = tokenizer_info or xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size)
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._compiled: OrderedDict[tuple[str, str, str], Any] = OrderedDict()

    def compile(self, spec: StructuredOutput) -> Any:
        key = spec.key()
        hit = self._compiled.get(key)
        if hit is not None:
            self._compiled.move_to_end(key)
            return hit
        xgr = self._xgr
        try:
            grammar = xgr.Grammar.from_json_schema(key[0], any_whitespace=True,
                                                   max_whitespace_cnt=_MAX_WHITESPACE)
            parts = [xgr.Grammar.from_ebnf(f"root ::= {_ebnf_literal(s)}") if s else None
                     for s in (spec.prefix, spec.suffix)]
            if parts[0] is not None or parts[1] is not None:
                grammar = xgr.Grammar.concat(*[g for g in (parts[0], grammar, parts[1])
                                               if g is not None])
            compiled = self._compiler.compile_grammar(grammar)
        except RuntimeError as e:  # validate() checked the schema; this is the tokenizer side
            raise ValueError(f"structured_output: cannot compile the grammar: {e}") from e
        self._compiled[key] = compiled
        if len(self._compiled) > MAX_CACHED_GRAMMARS:
            self._compiled.popitem(last=False)
        return compiled

    def matcher(self, spec: StructuredOutput, stop_token_ids: list[int]) -> GrammarMatcher:
        """A fresh matcher of `spec`'s grammar; `stop_token_ids` end it once it is complete
        (none: it terminates by itself at the end of the grammar)."""
        stops = sorted(t for t in stop_token_ids if 0 <= t < self.vocab_size)
        m = self._xgr.GrammarMatcher(self.compile(spec), override_stop_tokens=stops or None,
                                     terminate_without_stop_token=not stops)
        return GrammarMatcher(m)


# whitespace runs inside the JSON: random or looping models cannot fill max_tokens with them
_MAX_WHITESPACE = 4


def _ebnf_literal(text: str) -> str:
    """`text` as an EBNF string literal (xgrammar's escapes)."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'
