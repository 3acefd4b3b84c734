"""OmniLLM: the offline Python API. A plain causal LM is a one-stage pipeline named `llm`."""

from __future__ import annotations

import time
import uuid
from typing import Any

import torch
from tqdm import tqdm

from omnistage.checkpoint import (eos_token_ids, iter_tensors, load_config,
                                  load_generation_config, load_tokenizer, resolve_model_path)
from omnistage.engine.ar.engine import AREngine
from omnistage.engine.ar.sequence import Sequence
from omnistage.entrypoints.options import engine_config, resolve_device, resolve_dtype
from omnistage.entrypoints.prompts import per_stage_params, text_prompt_ids
from omnistage.models.registry import resolve_architecture
from omnistage.outputs import OmniRequestOutput, StageOutput
from omnistage.sampling_params import SamplingParams


def load_causal_lm(path, device: torch.device, dtype: torch.dtype) -> tuple[Any, dict]:
    config = load_config(path)
    _, cls = resolve_architecture(config.get("architectures") or [])
    with torch.device("meta"):
        model = cls(config)
    model = model.to_empty(device=device)
    model.tie_weights()  # to_empty() unties shared parameters
    model.load_weights(iter_tensors(path))
    for module in model.modules():  # buffers built at init (rope) are lost on meta: rebuild
        if hasattr(module, "inv_freq"):
            fresh = type(module)(model.config)
            for name, buf in fresh.named_buffers():
                setattr(module, name, buf.to(device))
    return model.to(dtype).eval(), config


def generation_defaults(gen_cfg: dict) -> SamplingParams:
    """The checkpoint's generation_config.json as default sampling (greedy when do_sample off)."""
    if not gen_cfg.get("do_sample", False):
        return SamplingParams(temperature=0.0, max_tokens=None,
                              repetition_penalty=gen_cfg.get("repetition_penalty", 1.0))
    return SamplingParams(temperature=gen_cfg.get("temperature", 1.0),
                          top_p=gen_cfg.get("top_p", 1.0), top_k=gen_cfg.get("top_k", 0) or 0,
                          repetition_penalty=gen_cfg.get("repetition_penalty", 1.0),
                          max_tokens=None)


class OmniLLM:
    """Offline generation. `generate` validates everything before any work starts."""

    def __init__(self, model: str, pipeline: str | None = None, device: str | None = None,
                 dtype: str | torch.dtype = "auto", **engine_options: Any) -> None:
        self.path = resolve_model_path(model)
        if pipeline is not None:
            raise ValueError("pipeline: custom pipelines need a multi-stage checkpoint")
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.model, config = load_causal_lm(self.path, self.device, self.dtype)
        self.tokenizer = load_tokenizer(self.path)
        gen_cfg = load_generation_config(self.path)
        self.engine = AREngine(self.model, engine_config(config.get("max_position_embeddings",
                                                                    32768), **engine_options),
                               self.device, self.dtype, self.tokenizer,
                               eos_token_ids(gen_cfg, config, self.tokenizer))
        self.stage_names = ["llm"]
        self.default_params = {"llm": generation_defaults(gen_cfg)}

    def generate(self, prompts: Any, sampling_params: Any = None,
                 output_modalities: list[str] | None = None,
                 use_tqdm: bool = True) -> list[OmniRequestOutput]:
        if output_modalities not in (None, ["text"]):
            raise ValueError(f"output_modalities: {output_modalities}; a text LM gives ['text']")
        prompts = prompts if isinstance(prompts, list) else [prompts]
        if not prompts:
            raise ValueError("prompts: empty list")
        params = per_stage_params(sampling_params, len(prompts), self.stage_names,
                                  self.default_params)
        seqs = []
        max_len = self.engine.config.max_model_len
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            p = sp["llm"]
            p.validate(f"sampling_params[{i}]" if len(prompts) > 1 else "sampling_params",
                       self.model.vocab_size)
            ids = text_prompt_ids(prompt, self.tokenizer, f"prompts[{i}]", self.model.vocab_size)
            if len(ids) >= max_len:
                raise ValueError(f"prompts[{i}]: {len(ids)} tokens, max_model_len is {max_len}")
            seed = p.seed if p.seed is not None else AREngine.new_seed()
            seqs.append(Sequence(f"{uuid.uuid4().hex[:12]}-{i}", ids, p, seed))
        return self._run(seqs, use_tqdm)

    def _run(self, seqs: list[Sequence], use_tqdm: bool) -> list[OmniRequestOutput]:
        start = time.perf_counter()
        outs = {s.request_id: OmniRequestOutput(s.request_id, prompt_token_ids=s.prompt_token_ids)
                for s in seqs}
        for s in seqs:
            outs[s.request_id].metrics.arrival_time = start
            outs[s.request_id].metrics.seed = s.seed
            self.engine.add_request(s)
        bar = tqdm(total=len(seqs), desc="generate", disable=not use_tqdm)
        while self.engine.has_unfinished():
            for u in self.engine.step():
                out = outs[u.request_id]
                now = time.perf_counter() - start
                if u.new_token_ids and out.metrics.ttft is None:
                    out.metrics.ttft = now
                if u.finished:
                    out.finished, out.error, out.metrics.e2e = True, u.error, now
                    bar.update(1)
        bar.close()
        results = []
        for s in seqs:
            out = outs[s.request_id]
            out.token_ids, out.text = list(s.output_token_ids), s.output_text
            out.metrics.num_cached_tokens = s.num_cached_tokens
            out.metrics.tokens_per_stage = {"llm": len(s.output_token_ids)}
            out.stages["llm"] = StageOutput("llm", out.token_ids, out.text, s.finish_reason)
            results.append(out)
        return results
