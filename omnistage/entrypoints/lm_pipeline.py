"""A plain causal LM as a one-stage pipeline (built-in YAML `llm`, stage `llm`), and the
helpers every pipeline uses to build its stages."""

from __future__ import annotations

import uuid
from typing import Any

import torch

from omnistage.checkpoint import (eos_token_ids, iter_tensors, load_generation_config,
                                  load_tokenizer)
from omnistage.config.schema import EngineOptions, PipelineConfig
from omnistage.engine.ar.engine import AREngine
from omnistage.engine.ar.scheduler import EngineConfig
from omnistage.engine.ar.sequence import Sequence
from omnistage.entrypoints.options import engine_config, resolve_device, resolve_dtype
from omnistage.entrypoints.prompts import text_prompt_ids
from omnistage.models.layers import DecoderForCausalLM
from omnistage.models.registry import register_model, resolve_architecture
from omnistage.runtime.orchestrator import RuntimeRequest
from omnistage.runtime.process import StageProcessSpec, pop_stage_worker, stage_process_spec
from omnistage.runtime.stage import ARStageWorker
from omnistage.sampling_params import SamplingParams

register_model("causal_lm")(DecoderForCausalLM)  # resolved by config.architectures at load


def build_model(cls: type, config: dict, tensors, device: torch.device, dtype: torch.dtype):
    """Instantiate directly on `device` in `dtype` (no fp32 copy of a 7B model), load weights."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(config)
    finally:
        torch.set_default_dtype(default)
    model.load_weights(tensors)
    return model.to(dtype).eval()


def stage_engine_config(model_max_len: int, options: dict[str, Any],
                        stage: EngineOptions) -> EngineConfig:
    """Constructor engine options, overridden by the stage's YAML `engine:` keys."""
    merged = dict(options)
    merged.update({k: v for k, v in stage.model_dump().items() if v is not None})
    try:
        return engine_config(model_max_len, **merged)
    except TypeError as e:
        raise ValueError(f"engine options: {e}") from e


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


class CausalLMPipeline:
    builtin = "llm"
    output_modalities = ["text"]

    def __init__(self, path, config: dict, pipeline: PipelineConfig, device: torch.device,
                 dtype: torch.dtype, engine_options: dict[str, Any]) -> None:
        if len(pipeline.stages) != 1 or pipeline.stages[0].kind != "ar":
            raise ValueError("pipeline: a causal LM checkpoint runs a single AR stage")
        stage = pipeline.stages[0]
        self.config, self.name = pipeline, stage.name
        options = dict(engine_options)
        worker = pop_stage_worker(options)
        if stage.device:
            device = resolve_device(stage.device)
        if stage.dtype != "auto":
            dtype = resolve_dtype(stage.dtype, device)
        resolve_architecture(config.get("architectures") or [])
        self.tokenizer = load_tokenizer(path)
        self.vocab_size = config["vocab_size"]
        self.max_model_len = stage_engine_config(config.get("max_position_embeddings", 32768),
                                                 options, stage.engine).max_model_len
        gen_cfg = load_generation_config(path)
        self.default_params = {self.name: stage.default_sampling.apply(
            generation_defaults(gen_cfg))}
        self.workers: dict[str, ARStageWorker] = {}
        self.process_stages: dict[str, StageProcessSpec] = {}
        if (worker or stage.worker) == "process":
            self.process_stages[self.name] = stage_process_spec(
                path, config, pipeline, self.name, device, dtype, options)
        else:
            self.workers[self.name] = self.build_stage(path, config, pipeline, self.name, device,
                                                       dtype, options)

    @classmethod
    def build_stage(cls, path, config: dict, pipeline: PipelineConfig, name: str,
                    device: torch.device, dtype: torch.dtype, options: dict[str, Any]
                    ) -> ARStageWorker:
        stage = pipeline.stage(name)
        _, model_cls = resolve_architecture(config.get("architectures") or [])
        model = build_model(model_cls, config, iter_tensors(path, stage.checkpoint_prefix or ""),
                            device, dtype)
        tokenizer = load_tokenizer(path)
        cfg = stage_engine_config(config.get("max_position_embeddings", 32768), options,
                                  stage.engine)
        gen_cfg = load_generation_config(path)
        engine = AREngine(model, cfg, device, dtype, tokenizer,
                          eos_token_ids(gen_cfg, config, tokenizer))
        engine.runner.warmup_graphs([stage.default_sampling.apply(generation_defaults(gen_cfg))])
        return ARStageWorker(name, engine)

    @property
    def stage_names(self) -> list[str]:
        return [self.name]

    @property
    def engine(self) -> AREngine:
        return self.workers[self.name].engine

    @property
    def model(self) -> DecoderForCausalLM:
        return self.engine.runner.model

    @property
    def engines(self) -> dict[str, AREngine]:
        return {n: w.engine for n, w in self.workers.items()}

    def prepare(self, prompt: Any, params: dict[str, SamplingParams],
                modalities: list[str], where: str, index: int) -> RuntimeRequest:
        p = params[self.name]
        p.validate(where.replace("prompts", "sampling_params"), self.vocab_size)
        ids = text_prompt_ids(prompt, self.tokenizer, where, self.vocab_size)
        max_len = self.max_model_len
        if len(ids) >= max_len:
            raise ValueError(f"{where}: {len(ids)} tokens, max_model_len is {max_len}")
        seq = Sequence(new_request_id(index), ids, p, resolve_seed(p))
        return RuntimeRequest(seq.request_id, [self.name], {self.name: seq},
                              text_stage=self.name, seed=seq.seed, prompt_token_ids=ids)
