"""Incremental detokenization and stop strings.

NOTE: decoding a growing token list one token at a time can split a multi-byte character; we
decode the window [prefix, end) and emit only what extends the already-emitted window
[prefix, read), holding back text that ends in U+FFFD (an incomplete UTF-8 sequence)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DetokState:
    prefix: int = 0  # output index where the decode window starts
    read: int = 0  # output tokens already turned into text
    emitted: int = 0  # characters of the text already streamed out
    window_text: str = ""  # decoded text of output[prefix:read] (saves one decode per step)


def detokenize_step(tokenizer, ids: list[int], state: DetokState, skip_special: bool) -> str:
    """Text of the tokens since the last call (may be '' while a character is incomplete)."""
    before = state.window_text
    after = tokenizer.decode(ids[state.prefix:], skip_special_tokens=skip_special)
    if after.endswith("\ufffd") or len(after) <= len(before):
        return ""
    new = after[len(before):]
    # the next window is [read, len): its text is exactly what this step adds
    state.prefix, state.read, state.window_text = state.read, len(ids), new
    return new


def find_stop(text: str, new_len: int, stops: list[str]) -> int | None:
    """Index in `text` where the earliest stop string that touches the new text starts."""
    best = None
    for stop in stops:
        i = text.find(stop, max(0, len(text) - new_len - len(stop) + 1))
        if i >= 0 and (best is None or i < best):
            best = i
    return best
