"""A plain causal LM (Qwen2, Llama, ...) as a pipeline: built-in YAML `llm` (one AR stage named
`llm`, its model resolved from config.json's `architectures`). A YAML may add stages after the
LM (any registered stage model, e.g. a non-AR stage on engine/gen), each fed by a registered
adapter that takes no constructor arguments; a stage with `output: audio` gives the audio."""

from __future__ import annotations

from typing import Any

import torch

from omnistage.checkpoint import (eos_token_ids, iter_tensors, load_generation_config,
                                  load_tokenizer)
from omnistage.config.schema import PipelineConfig
from omnistage.engine.ar.engine import AREngine
from omnistage.engine.ar.sequence import Sequence
from omnistage.models.fp8_decoder import quantize_decoder
from omnistage.models.layers import DecoderForCausalLM
from omnistage.models.registry import (ADAPTER_REGISTRY, CAUSAL_LM_PIPELINE, STAGE_BUILDERS,
                                       register_model, register_pipeline, register_stage,
                                       resolve_architecture)
from omnistage.prompts import text_prompt_ids
from omnistage.runtime.build import (StageContext, build_ar_engine, build_model, build_stage_worker,
                                     build_stages, generation_defaults, new_request_id,
                                     pop_load_options, resolve_seed, stage_engine_config)
from omnistage.runtime import startup
from omnistage.runtime.orchestrator import RuntimeRequest
from omnistage.runtime.process import pop_stage_worker
from omnistage.runtime.stage import ARStageWorker, StageLink
from omnistage.sampling_params import SamplingParams

register_model("causal_lm")(DecoderForCausalLM)  # resolved by config.architectures at load


@register_stage("causal_lm", "ar")
def build_causal_lm(ctx: StageContext) -> ARStageWorker:
    _, model_cls = resolve_architecture(ctx.config.get("architectures") or [])
    with startup.phase("weights"):
        model = build_model(model_cls, ctx.config, iter_tensors(ctx.path, ctx.prefix("")),
                            ctx.device, ctx.dtype)
        if ctx.options.get("quantization") == "fp8":
            quantize_decoder(model)
    tokenizer = load_tokenizer(ctx.path)
    cfg = stage_engine_config(ctx.config.get("max_position_embeddings", 32768),
                              ctx.options["engine"], ctx.stage.engine)
    gen_cfg = load_generation_config(ctx.path)
    engine = build_ar_engine(ctx, model, cfg, tokenizer,
                             eos_token_ids(gen_cfg, ctx.config, tokenizer),
                             ctx.stage.default_sampling.apply(generation_defaults(gen_cfg)))
    return ARStageWorker(ctx.name, engine)


@register_pipeline(CAUSAL_LM_PIPELINE)
class CausalLMPipeline:
    voices: dict = {}  # a plain LM does not speak
    warmup_plan_options = ("graph_warmup_plan",)  # (Pipeline)
    build_stage = staticmethod(build_stage_worker)  # by each stage's registered `model`

    @staticmethod
    def matches(config: dict) -> bool:
        return True  # the fallback: any causal LM whose architecture is registered

    def __init__(self, path, config: dict, pipeline: PipelineConfig, device: torch.device,
                 dtype: torch.dtype, engine_options: dict[str, Any]) -> None:
        first = pipeline.stages[0]
        if first.kind != "ar" or first.inputs or first.output != "text":
            raise ValueError("pipeline: stages[0] must be the causal LM: kind ar, no inputs, "
                             "output: text")
        for i, s in enumerate(pipeline.stages[1:], 1):
            if len(s.inputs) != 1:
                raise ValueError(f"stages[{i}].inputs: a stage after the LM has one input")
        self.config, self.name = pipeline, first.name
        engine = dict(engine_options)
        load = pop_load_options(engine)
        if load["load_format"] != "safetensors":
            raise ValueError("load_format: a causal LM loads its safetensors weights "
                             f"(got {load['load_format']!r})")
        options = {"stage_worker": pop_stage_worker(engine), "engine": engine,
                   "quantization": load["quantization"]}
        resolve_architecture(config.get("architectures") or [])
        self.tokenizer = load_tokenizer(path)
        self.vocab_size = config["vocab_size"]
        self.max_model_len = stage_engine_config(config.get("max_position_embeddings", 32768),
                                                 engine, first.engine).max_model_len
        gen_cfg = load_generation_config(path)
        self.default_params = {self.name: first.default_sampling.apply(
            generation_defaults(gen_cfg))}
        self.default_params.update({s.name: s.default_sampling.apply(SamplingParams())
                                    for s in pipeline.stages[1:]})
        self.output_modalities = pipeline.output_modalities
        self.workers, self.process_stages = build_stages(path, config, pipeline,
                                                         pipeline.stages, device, dtype, options)

    @property
    def stage_names(self) -> list[str]:
        return self.config.stage_names

    @property
    def engine(self) -> AREngine:
        return self.workers[self.name].engine

    @property
    def model(self) -> DecoderForCausalLM:
        return self.engine.runner.model

    @property
    def engines(self) -> dict[str, AREngine]:
        return {n: w.engine for n, w in self.workers.items() if isinstance(w, ARStageWorker)}

    def prepare(self, prompt: Any, params: dict[str, SamplingParams],
                modalities: list[str], where: str, index: int) -> RuntimeRequest:
        p = params[self.name]
        p.validate(where.replace("prompts", "sampling_params"), self.vocab_size)
        ids = text_prompt_ids(prompt, self.tokenizer, where, self.vocab_size)
        max_len = self.max_model_len
        if len(ids) >= max_len:
            raise ValueError(f"{where}: {len(ids)} tokens, max_model_len is {max_len}")
        seq = Sequence(new_request_id(index), ids, p, resolve_seed(p))
        req = RuntimeRequest(seq.request_id, [self.name], {self.name: seq},
                             text_stage=self.name, seed=seq.seed, prompt_token_ids=ids)
        # later stages: only those whose output was asked for, and the stages feeding them
        wanted = {s.name for s in self.config.stages[1:] if s.output in modalities}
        for s in reversed(self.config.stages[1:]):
            if s.name in wanted:
                wanted.add(s.inputs[0].upstream)
        for k, s in enumerate(self.config.stages[1:], 1):
            if s.name not in wanted:
                continue
            sp = params[s.name]
            # a request seed s seeds the LM with s, the k-th stage after it with s + k
            req.stage_requests[s.name] = sp.seed if sp.seed is not None else \
                (seq.seed + k) % 2**64
            req.path.append(s.name)
            req.links.append(StageLink(s.inputs[0].upstream, s.name,
                                       ADAPTER_REGISTRY[s.inputs[0].adapter]()))
            if s.output == "audio":
                req.audio_stage, req.sample_rate = s.name, STAGE_BUILDERS[s.model].sample_rate
        return req
