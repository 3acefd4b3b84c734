"""What the thinker -> talker -> code2wav pipelines (Qwen2.5-Omni, Qwen3-Omni) share: the
stages' roles read off the YAML, the KV split between stages on one GPU, option parsing, and the
thinker half of request preparation (prompt processing, forced replies). A family subclasses
ThinkerTalkerPipeline and adds its talker/code2wav wiring (`prepare_audio`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from omnistage.checkpoint import eos_token_ids, load_generation_config
from omnistage.engine.ar.model_runner import kv_bytes_per_block
from omnistage.engine.ar.scheduler import EngineConfig
from omnistage.config.schema import PipelineConfig, StageConfig
from omnistage.engine.ar.engine import AREngine
from omnistage.engine.ar.sequence import Sequence
from omnistage.engine.gen import GenStageWorker
from omnistage.models.qwen2_5_omni.thinker import thinker_sequence
from omnistage.outputs import OmniRequestOutput
from omnistage.sampling_params import INT32_MAX
from omnistage.runtime.build import (StageContext, build_ar_engine, build_stage_worker,
                                     build_stages, generation_defaults, new_request_id,
                                     pop_load_options, resolve_seed, stage_engine_config)
from omnistage.runtime.memory import (CODE2WAV_MAX_BATCH, THINKER_SHARE, WEIGHT_GROWTH,
                                      MemoryBudget,
                                      checkpoint_bytes, fp8_projection, pop_memory_budget)
from omnistage.runtime.orchestrator import RuntimeRequest
from omnistage.runtime import startup
from omnistage.runtime.process import pop_stage_worker
from omnistage.runtime.stage import ARStageWorker, StageLink
from omnistage.sampling_params import SamplingParams


def stage_roles(cfg: PipelineConfig) -> dict[str, StageConfig | None]:
    """The stages by their part, read off the YAML's outputs and inputs: the thinker gives
    text, code2wav gives audio, the talker feeds code2wav."""
    thinker = next((s for s in cfg.stages if s.output == "text"), None)
    code2wav = next((s for s in cfg.stages if s.output == "audio"), None)
    talker = None
    if code2wav is not None and code2wav.inputs:
        talker = cfg.stage(code2wav.inputs[0].upstream)
    return {"thinker": thinker, "talker": talker, "code2wav": code2wav}


def kv_fraction(ctx: StageContext, fraction: float) -> dict[str, Any]:
    """The AR engine options; on CUDA, unless sized by the user, KV takes `fraction` of the
    free memory. NOTE: stages share one GPU: the thinker (built first) takes a part for KV,
    the talker a part of what is left, and the rest stays for code2wav and graphs."""
    opts = dict(ctx.options["engine"])
    sized = {"num_kv_blocks", "kv_cache_memory_fraction"}
    if ctx.device.type == "cuda" \
            and not sized & {k for k, v in opts.items() if v is not None} \
            and not sized & {k for k, v in ctx.stage.engine.model_dump().items() if v is not None}:
        opts["kv_cache_memory_fraction"] = fraction
    return opts


def budgeted(ctx: StageContext, model: torch.nn.Module, cfg: EngineConfig,
             share: float) -> EngineConfig:
    """`cfg` with its KV blocks sized by the pipeline's gpu_memory_budget (runtime/memory.py),
    unless there is none or the user sized the KV cache."""
    budget = ctx.options.get("memory_budget")
    if budget is None:
        return cfg
    user_fraction = (ctx.options["engine"].get("kv_cache_memory_fraction") is not None
                     or ctx.stage.engine.kv_cache_memory_fraction is not None)
    if cfg.num_kv_blocks is not None or user_fraction:  # sized by the user: as they said
        budget.loaded(ctx.name)
        return cfg
    per_block = kv_bytes_per_block(model, cfg.block_size, ctx.dtype)
    seq_blocks = -(-cfg.max_model_len // cfg.block_size)
    blocks = budget.kv_blocks(ctx.name, share, per_block, cfg.max_num_seqs * seq_blocks + 1,
                              seq_blocks)
    return replace(cfg, num_kv_blocks=blocks, kv_cache_memory_fraction=None)


def thinker_worker(ctx: StageContext, model: torch.nn.Module, tokenizer: Any,
                   kv_share: float = 0.45) -> ARStageWorker:
    """The thinker stage's worker: an AR engine on `model` (built and loaded), sized by the
    thinker's text config, its graphs warmed with the checkpoint's generation defaults."""
    gen_cfg = load_generation_config(ctx.path)
    text_cfg = ctx.config["thinker_config"]["text_config"]
    cfg = stage_engine_config(text_cfg.get("max_position_embeddings", 32768),
                              kv_fraction(ctx, kv_share), ctx.stage.engine)
    cfg = budgeted(ctx, model, cfg, THINKER_SHARE)
    engine = build_ar_engine(ctx, model, cfg, tokenizer, eos_token_ids(gen_cfg, ctx.config, None),
                             ctx.stage.default_sampling.apply(generation_defaults(gen_cfg)))
    # the thinker's stream ahead of the talker's: the talker's steps wait for its rows
    return ARStageWorker(ctx.name, engine, priority=-2)


def talker_worker(ctx: StageContext, model: torch.nn.Module, max_position_embeddings: int,
                  params: SamplingParams, row_width: int, kv_share: float = 0.5) -> ARStageWorker:
    """The talker stage's worker: an AR engine on `model` (built and loaded), its graphs
    warmed with `params` (the stage's YAML defaults applied over them); decode steps add the
    thinker's rows, `row_width` wide."""
    cfg = stage_engine_config(max_position_embeddings, kv_fraction(ctx, kv_share),
                              ctx.stage.engine)
    cfg = budgeted(ctx, model, cfg, 1.0)  # the room left: code2wav's is reserved
    engine = build_ar_engine(ctx, model, cfg, None, set(),
                             ctx.stage.default_sampling.apply(params), row_width)
    return ARStageWorker(ctx.name, engine, priority=-1)


class ThinkerTalkerPipeline:
    """The shared half. A subclass's __init__ calls `_init_front` (config, roles, processor,
    tokenizer, thinker_vocab_size, thinker_eos, max_model_len, the thinker's default_params),
    adds its talker's settings, then `_build_workers` (stage_order, workers, process_stages);
    it implements prepare_audio(req, seq, processed, prompt, params, where), which ends in
    `_route_audio`."""

    family = ""  # named in errors
    warmup_plan_options = ("graph_warmup_plan", "code2wav_warmup_plan")  # (Pipeline)

    build_stage = staticmethod(build_stage_worker)  # by each stage's registered `model`

    @staticmethod
    def split_options(engine_options: dict[str, Any], code2wav: Any) -> dict[str, Any]:
        """Constructor keywords -> the stage worker kind, the code2wav options (parsed by
        `code2wav`, a function popping its keys) and the AR engine options."""
        opts = dict(engine_options)
        if opts.get("gpu_memory_budget") is not None:
            opts.setdefault("code2wav_max_batch", CODE2WAV_MAX_BATCH)
        parsed = code2wav(opts)
        worker = pop_stage_worker(opts)
        load = pop_load_options(opts)
        budget = pop_memory_budget(opts)
        return {"code2wav": parsed, "stage_worker": worker, "engine": opts,
                "gpu_memory_budget": budget, **load}

    def _init_front(self, path: Any, config: dict, pipeline: PipelineConfig,
                    engine_options: dict[str, Any], processor_class: Any
                    ) -> tuple[StageConfig, StageConfig | None, StageConfig | None]:
        """The front end's thinker half (attributes: class note) from the checkpoint's
        config.json and the pipeline YAML -> the thinker, talker and code2wav stages (the
        last two None when the YAML has none). engine_options: split_options' result."""
        thinker_cfg = config.get("thinker_config")
        if not thinker_cfg:
            raise ValueError(f"model: {path}/config.json has no thinker_config")
        self.config = pipeline
        self.roles = stage_roles(pipeline)
        st, sk, sc = self.roles["thinker"], self.roles["talker"], self.roles["code2wav"]
        if st is None:
            raise ValueError(f"pipeline: a {self.family} pipeline needs a stage with output: text")
        with startup.phase("processor"):  # tokenizer, image/audio/video processors
            self.processor = processor_class.from_pretrained(path)
        self.tokenizer = self.processor.tokenizer
        gen_cfg = load_generation_config(path)
        text_cfg = thinker_cfg["text_config"]
        self.thinker_vocab_size = text_cfg["vocab_size"]
        self.thinker_eos = eos_token_ids(gen_cfg, config, None)
        self.max_model_len = stage_engine_config(
            text_cfg.get("max_position_embeddings", 32768), engine_options["engine"],
            st.engine).max_model_len
        self.default_params: dict[str, SamplingParams] = {
            st.name: st.default_sampling.apply(generation_defaults(gen_cfg))}
        return st, sk, sc

    def _build_workers(self, stages: list[StageConfig], path: Any, config: dict,
                       device: torch.device, dtype: torch.dtype,
                       options: dict[str, Any]) -> None:
        """Each stage built here or, where its `worker` is "process", in a process of its own."""
        self.stage_order = [s.name for s in stages]
        if options.get("gpu_memory_budget") is not None:
            options = {**options, "memory_budget": self._memory_budget(stages, path, device,
                                                                       options)}
        self.workers, self.process_stages = build_stages(path, config, self.config, stages,
                                                         device, dtype, options)

    def _memory_budget(self, stages: list[StageConfig], path: Any, device: torch.device,
                       options: dict[str, Any]) -> MemoryBudget:
        if options["stage_worker"] not in (None, "inprocess") \
                or any(s.worker != "inprocess" for s in stages):
            raise ValueError("gpu_memory_budget: budgets stages in this process; stage "
                             "processes (stage_worker / worker: process) are not budgeted")
        quantized = options.get("quantization") == "fp8"
        thinker = self.roles["thinker"]
        pending = {s.name: int(checkpoint_bytes(
            path, s.checkpoint_prefix or "",
            fp8_projection if quantized and s.name == thinker.name else None)
            * WEIGHT_GROWTH[s.kind]) for s in stages}
        return MemoryBudget(options["gpu_memory_budget"], device, pending)

    @property
    def stage_names(self) -> list[str]:
        return list(self.stage_order)

    @property
    def engines(self) -> dict[str, AREngine]:
        return {n: w.engine for n, w in self.workers.items() if isinstance(w, ARStageWorker)}

    # the stage models and workers of this process (tests, benchmarks)
    def stage_model(self, role: str) -> torch.nn.Module:
        """The model of a stage of this process, by role."""
        return self.workers[self.roles[role].name].engine.runner.model

    @property
    def thinker(self) -> torch.nn.Module:
        return self.stage_model("thinker")

    @property
    def talker(self) -> torch.nn.Module:
        return self.stage_model("talker")

    @property
    def code2wav(self) -> GenStageWorker:
        return self.workers[self.roles["code2wav"].name]

    # ---------------------------------------------------------------- requests
    def thinker_sequence(self, processed: Any, p: SamplingParams, index: int) -> Sequence:
        """The thinker's Sequence for a processed prompt (both families build it alike)."""
        return thinker_sequence(new_request_id(index), processed, p, resolve_seed(p))

    def prepare(self, prompt: Any, params: dict[str, SamplingParams], modalities: list[str],
                where: str, index: int) -> RuntimeRequest:
        name = self.roles["thinker"].name
        p = params[name]
        p.validate(where.replace("prompts", "sampling_params") + f"[{name}]",
                   self.thinker_vocab_size)
        seq, processed = self._thinker_seq(prompt, p, modalities, where, index)
        if isinstance(prompt, dict) and prompt.get("forced_reply"):
            self._force_reply(seq, prompt["forced_reply"])
        req = RuntimeRequest(seq.request_id, [name], {name: seq}, text_stage=name,
                             seed=seq.seed, prompt_token_ids=list(seq.prompt_token_ids))
        if "audio" in modalities:
            self.prepare_audio(req, seq, processed, prompt, params, where)
        return req

    def _talker_params(self, params: dict[str, SamplingParams], where: str) -> SamplingParams:
        """The request's talker sampling params, validated against the talker's vocab.
        The talker's end codes are its stop ids (not a tokenizer's eos), and one sampled
        mid-stream is no audio: `ignore_eos` therefore bans them (min_tokens = max_tokens), so
        the talker runs to max_tokens, as a user asking for fixed-length audio means."""
        name = self.roles["talker"].name
        tp = params[name]
        tp.validate(where.replace("prompts", "sampling_params") + f"[{name}]",
                    self.talker_vocab_size)
        if tp.ignore_eos:
            tp = replace(tp, min_tokens=INT32_MAX if tp.max_tokens is None else tp.max_tokens)
        return tp

    def _route_audio(self, req: RuntimeRequest, adapter: Any, talker_request: Any,
                     code2wav_adapter: Any, code2wav_request: Any, sample_rate: int) -> None:
        """Extend `req` past the thinker: thinker rows -> talker (through `adapter`), talker
        codes -> code2wav (through `code2wav_adapter`), the audio from code2wav."""
        thinker, talker = self.roles["thinker"].name, self.roles["talker"].name
        code2wav = self.roles["code2wav"].name
        req.path += [talker, code2wav]
        req.stage_requests.update({talker: talker_request, code2wav: code2wav_request})
        req.links = [StageLink(thinker, talker, adapter),
                     StageLink(talker, code2wav, code2wav_adapter)]
        req.audio_stage, req.sample_rate = code2wav, sample_rate

    @staticmethod
    def _finalize(out: OmniRequestOutput, talker: str, stops: set[int]) -> None:
        stage = out.stages.get(talker)
        if stage is not None and stage.finish_reason == "stop" and stage.token_ids \
                and stage.token_ids[-1] in stops:  # codes without the stop code that ended them
            stage.token_ids = stage.token_ids[:-1]
            if stage.codes is not None and len(stage.codes) > len(stage.token_ids):
                stage.codes = stage.codes[:len(stage.token_ids)]
            if stage.logprobs is not None:
                stage.logprobs = stage.logprobs[:len(stage.token_ids)]
            out.metrics.tokens_per_stage[talker] = len(stage.token_ids)

    def _force_reply(self, seq: Sequence, text: str) -> None:
        """The thinker's reply is exactly `text` (then its end token): no sampling."""
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        eos = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        if eos is None or eos < 0 or eos == self.tokenizer.unk_token_id:
            eos = min(self.thinker_eos)
        seq.forced_output_ids = ids + [eos]
        seq.params = SamplingParams(**{**seq.params.__dict__, "temperature": 0.0,
                                       "max_tokens": len(ids) + 1, "min_tokens": 0,
                                       "stop": [], "ignore_eos": False})

    def _thinker_seq(self, prompt, p: SamplingParams, modalities, where, index
                     ) -> tuple[Sequence, Any]:
        """The thinker's Sequence and the processed prompt it came from (None: raw ids)."""
        max_prompt = self.max_model_len - 1
        with_av = prompt.get("use_audio_in_video", False) if isinstance(prompt, dict) else False
        if isinstance(prompt, dict) and prompt.get("tools"):  # (Qwen-Omni templates: no tools)
            raise ValueError(f"{where}.tools: this model's prompts do not take tools")
        if not isinstance(with_av, bool):
            raise ValueError(f"{where}.use_audio_in_video: must be true or false, got {with_av!r}")
        try:
            if isinstance(prompt, str):
                processed = self.processor.process_prompt(prompt, max_prompt_tokens=max_prompt)
            elif "messages" in prompt:
                processed = self.processor.process(prompt["messages"],
                                                   add_audio_system_prompt="audio" in modalities,
                                                   max_prompt_tokens=max_prompt,
                                                   use_audio_in_video=with_av)
            elif "prompt" in prompt:
                processed = self.processor.process_prompt(
                    prompt["prompt"], prompt.get("multi_modal_data"), max_prompt_tokens=max_prompt,
                    use_audio_in_video=with_av)
            else:
                processed = None
        except ValueError as e:
            raise ValueError(f"{where}.{e}") from e
        if processed is not None:
            return self.thinker_sequence(processed, p, index), processed
        ids = list(prompt["prompt_token_ids"])  # raw token ids: text only
        bad = [t for t in ids if not 0 <= t < self.thinker_vocab_size]
        if bad:
            raise ValueError(f"{where}.prompt_token_ids: ids {bad[:4]} outside the vocabulary")
        if len(ids) > max_prompt:
            raise ValueError(f"{where}: {len(ids)} tokens; max_model_len is {max_prompt + 1}")
        return Sequence(new_request_id(index), ids, p, resolve_seed(p),
                        mrope_positions=torch.arange(len(ids)).expand(3, -1).clone()), None
