"""Turning user prompts into token ids, with validation that names the prompt index and field."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from omnistage.sampling_params import DiffusionParams, SamplingParams

PROMPT_KEYS = {"prompt", "prompt_token_ids", "multi_modal_data", "messages", "voice",
               "use_audio_in_video", "forced_reply", "tools"}
MAX_PROMPT_CHARS = 1 << 20
MAX_FORCED_REPLY_CHARS = 16384


def check_prompt_shape(prompt: Any, where: str) -> None:
    """Type-level checks common to every model."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"{where}: is empty")
        if len(prompt) > MAX_PROMPT_CHARS:
            raise ValueError(f"{where}: longer than {MAX_PROMPT_CHARS} characters")
        return
    if not isinstance(prompt, Mapping):
        raise ValueError(f"{where}: must be a str or a dict, got {type(prompt).__name__}")
    unknown = set(prompt) - PROMPT_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; "
                         f"allowed: {sorted(PROMPT_KEYS)}")
    sources = [k for k in ("prompt", "prompt_token_ids", "messages") if k in prompt]
    if len(sources) != 1:
        raise ValueError(f"{where}: needs exactly one of 'prompt', 'prompt_token_ids', 'messages'")
    if "forced_reply" in prompt:
        text = prompt["forced_reply"]
        if not isinstance(text, str) or not text or len(text) > MAX_FORCED_REPLY_CHARS:
            raise ValueError(f"{where}.forced_reply: must be a non-empty string of at most "
                             f"{MAX_FORCED_REPLY_CHARS} characters")
    if "voice" in prompt and prompt["voice"] is not None and not isinstance(prompt["voice"], str):
        raise ValueError(f"{where}.voice: must be a string")
    if "prompt" in prompt and (not isinstance(prompt["prompt"], str) or not prompt["prompt"]):
        raise ValueError(f"{where}.prompt: must be a non-empty string")
    if "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, (list, tuple)) or not ids:
            raise ValueError(f"{where}.prompt_token_ids: must be a non-empty list of ints")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"{where}.prompt_token_ids: must hold only ints")
    if "messages" in prompt:
        msgs = prompt["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise ValueError(f"{where}.messages: must be a non-empty list")
        for i, m in enumerate(msgs):
            if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
                raise ValueError(f"{where}.messages[{i}]: needs 'role' and 'content'")
            if m["role"] not in ("system", "user", "assistant", "tool"):
                raise ValueError(f"{where}.messages[{i}].role: {m['role']!r} is not "
                                 "'system', 'user', 'assistant' or 'tool'")
    if "tools" in prompt and prompt["tools"] is not None and (
            not isinstance(prompt["tools"], list)
            or not all(isinstance(t, Mapping) for t in prompt["tools"])):
        raise ValueError(f"{where}.tools: must be a list of tool dicts (OpenAI's shape)")


def text_prompt_ids(prompt: Any, tokenizer, where: str, vocab_size: int) -> list[int]:
    """Token ids of a text-only prompt for a plain LM."""
    check_prompt_shape(prompt, where)
    if isinstance(prompt, str):
        ids = tokenizer(prompt).input_ids
    elif "prompt_token_ids" in prompt:
        ids = list(prompt["prompt_token_ids"])
    elif "messages" in prompt:
        for i, m in enumerate(prompt["messages"]):
            if not isinstance(m["content"], str):
                raise ValueError(f"{where}.messages[{i}].content: this model takes text only")
        if tokenizer.chat_template is None:
            raise ValueError(f"{where}.messages: the checkpoint has no chat template")
        tools = prompt.get("tools") or None
        if tools and "tools" not in tokenizer.chat_template:  # it would drop them unseen
            raise ValueError(f"{where}.tools: this checkpoint's chat template does not render "
                             "tools")
        ids = tokenizer.apply_chat_template(list(prompt["messages"]), add_generation_prompt=True,
                                            tokenize=True, return_dict=False, tools=tools)
    else:
        ids = tokenizer(prompt["prompt"]).input_ids
    if prompt.get("multi_modal_data") if isinstance(prompt, Mapping) else False:
        raise ValueError(f"{where}.multi_modal_data: this model takes text only")
    if not ids:
        raise ValueError(f"{where}: tokenizes to no tokens")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{where}.prompt_token_ids: ids {bad[:4]} outside the vocabulary "
                         f"(size {vocab_size})")
    return ids


def per_stage_params(sampling_params: Any, n: int, stages: list[str],
                     defaults: dict[str, SamplingParams]) -> list[dict[str, SamplingParams]]:
    """Normalise `sampling_params` to one {stage: params} dict per prompt."""

    def one(sp: Any, where: str) -> dict[str, SamplingParams]:
        out = dict(defaults)
        if sp is None:
            return out
        if isinstance(sp, (SamplingParams, DiffusionParams)):  # (image pipelines: DiffusionParams)
            out[stages[0]] = sp
            return out
        if isinstance(sp, Mapping):
            for stage, p in sp.items():
                if stage not in stages:
                    raise ValueError(f"{where}: unknown stage {stage!r}; stages: {stages}")
                if not isinstance(p, SamplingParams):
                    raise ValueError(f"{where}[{stage!r}]: must be a SamplingParams")
                out[stage] = p
            return out
        raise ValueError(f"{where}: must be a SamplingParams (DiffusionParams for an image "
                         "pipeline) or a dict of them per stage")

    if isinstance(sampling_params, list):
        if len(sampling_params) != n:
            raise ValueError(f"sampling_params: {len(sampling_params)} given for {n} prompts")
        return [one(sp, f"sampling_params[{i}]") for i, sp in enumerate(sampling_params)]
    shared = one(sampling_params, "sampling_params")
    return [dict(shared) for _ in range(n)]
