"""A plain causal LM as a one-stage pipeline (stage `llm`), and the loop that drives an AR
engine over a set of requests (shared by every pipeline's AR stages)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import torch
from tqdm import tqdm

from omnistage.checkpoint import (eos_token_ids, iter_tensors, load_generation_config,
                                  load_tokenizer)
from omnistage.engine.ar.engine import AREngine, SequenceUpdate
from omnistage.engine.ar.sequence import Sequence
from omnistage.entrypoints.options import engine_config
from omnistage.entrypoints.prompts import text_prompt_ids
from omnistage.models.registry import resolve_architecture
from omnistage.outputs import OmniRequestOutput, StageOutput
from omnistage.sampling_params import SamplingParams


def build_model(cls: type, config: dict, tensors, device: torch.device, dtype: torch.dtype):
    """Instantiate directly on `device` (fp32), load weights, cast to `dtype`."""
    with torch.device(device):
        model = cls(config)
    model.load_weights(tensors)
    return model.to(dtype).eval()


def generation_defaults(gen_cfg: dict) -> SamplingParams:
    """The checkpoint's generation_config.json as default sampling (greedy when do_sample off)."""
    if not gen_cfg.get("do_sample", False):
        return SamplingParams(temperature=0.0, max_tokens=None,
                              repetition_penalty=gen_cfg.get("repetition_penalty", 1.0))
    return SamplingParams(temperature=gen_cfg.get("temperature", 1.0),
                          top_p=gen_cfg.get("top_p", 1.0), top_k=gen_cfg.get("top_k", 0) or 0,
                          repetition_penalty=gen_cfg.get("repetition_penalty", 1.0),
                          max_tokens=None)


def new_request_id(i: int) -> str:
    return f"{uuid.uuid4().hex[:12]}-{i}"


def resolve_seed(p: SamplingParams) -> int:
    return p.seed if p.seed is not None else AREngine.new_seed()


def drive(engine: AREngine, seqs: list[Sequence], use_tqdm: bool,
          on_update: Callable[[SequenceUpdate], None] | None = None) -> dict[str, float]:
    """Run `seqs` to completion on `engine`; returns request_id -> seconds to first token."""
    start = time.perf_counter()
    first: dict[str, float] = {}
    for s in seqs:
        engine.add_request(s)
    bar = tqdm(total=len(seqs), desc="generate", disable=not use_tqdm)
    while engine.has_unfinished():
        for u in engine.step():
            if u.new_token_ids and u.request_id not in first:
                first[u.request_id] = time.perf_counter() - start
            if on_update is not None:
                on_update(u)
            if u.finished:
                bar.update(1)
    bar.close()
    return first


def stage_result(seq: Sequence, stage: str) -> StageOutput:
    return StageOutput(stage, list(seq.output_token_ids), seq.output_text, seq.finish_reason)


class CausalLMPipeline:
    stage_names = ["llm"]
    output_modalities = ["text"]

    def __init__(self, path, config: dict, device: torch.device, dtype: torch.dtype,
                 engine_options: dict[str, Any]) -> None:
        _, cls = resolve_architecture(config.get("architectures") or [])
        self.model = build_model(cls, config, iter_tensors(path), device, dtype)
        self.tokenizer = load_tokenizer(path)
        gen_cfg = load_generation_config(path)
        self.engine = AREngine(self.model, engine_config(config.get("max_position_embeddings",
                                                                    32768), **engine_options),
                               device, dtype, self.tokenizer,
                               eos_token_ids(gen_cfg, config, self.tokenizer))
        self.engines = {"llm": self.engine}
        self.default_params = {"llm": generation_defaults(gen_cfg)}

    def prepare(self, prompt: Any, params: dict[str, SamplingParams],
                modalities: list[str], where: str, index: int) -> Sequence:
        p = params["llm"]
        p.validate(where.replace("prompts", "sampling_params"), self.model.vocab_size)
        ids = text_prompt_ids(prompt, self.tokenizer, where, self.model.vocab_size)
        max_len = self.engine.config.max_model_len
        if len(ids) >= max_len:
            raise ValueError(f"{where}: {len(ids)} tokens, max_model_len is {max_len}")
        return Sequence(new_request_id(index), ids, p, resolve_seed(p))

    def run(self, seqs: list[Sequence], use_tqdm: bool) -> list[OmniRequestOutput]:
        start = time.perf_counter()
        first = drive(self.engine, seqs, use_tqdm)
        e2e = time.perf_counter() - start
        outs = []
        for s in seqs:
            out = OmniRequestOutput(s.request_id, text=s.output_text,
                                    token_ids=list(s.output_token_ids), finished=True,
                                    error=s.error, prompt_token_ids=s.prompt_token_ids)
            out.stages["llm"] = stage_result(s, "llm")
            m = out.metrics
            m.ttft, m.e2e, m.seed = first.get(s.request_id), e2e, s.seed
            m.num_cached_tokens = s.num_cached_tokens
            m.tokens_per_stage = {"llm": len(s.output_token_ids)}
            outs.append(out)
        return outs
