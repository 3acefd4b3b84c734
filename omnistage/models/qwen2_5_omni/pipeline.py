"""Qwen2.5-Omni's pipeline: thinker (AR) -> talker (AR) -> code2wav (generation), built from the
pipeline YAML (built-in: config/pipelines/qwen2_5_omni.yaml).

prepare() validates and processes one prompt (ids, encoder features, 3-axis positions, voice,
seeds) and wires its routes: thinker rows -> the talker's adapter, talker codes -> code2wav."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from omnistage.checkpoint import load_generation_config
from omnistage.config.schema import PipelineConfig
from omnistage.engine.ar.kernels_ahead_ar import DecoderDims, ar_kernel_jobs
from omnistage.engine.ar.sequence import Sequence
from omnistage.models.fp8_decoder import quantize_decoder
from omnistage.models.qwen2_5_omni.code2wav_options import pop_code2wav_options
from omnistage.engine.gen import GenStageWorker
from omnistage.engine.kernels_ahead import KernelJob
from omnistage.models.layers import DecoderConfig
from omnistage.models.qwen2_5_omni.code2wav_stage import (Code2WavRequest, build_code2wav_stage,
                                                          code2wav_kernels_ahead)
from omnistage.models.qwen2_5_omni.processor import Qwen2_5OmniInputProcessor
from omnistage.models.qwen2_5_omni.talker import (HANDOFFS, Qwen2_5OmniTalkerForCausalLM,
                                                  talker_default_params, talker_sequence,
                                                  talker_token_ids)
from omnistage.models.qwen2_5_omni.thinker import Qwen2_5OmniThinkerForCausalLM
from omnistage.models.qwen2_5_omni.voices import load_voices
from omnistage.models.omni_pipeline import ThinkerTalkerPipeline, talker_worker, thinker_worker
from omnistage.models.registry import ADAPTER_REGISTRY, register_pipeline, register_stage
from omnistage.runtime.build import (StageContext, build_stage_model, generation_defaults,
                                     stage_engine_config)
from omnistage.runtime.orchestrator import RuntimeRequest
from omnistage.runtime.stage import ARStageWorker
from omnistage.sampling_params import SamplingParams, stage_seed

SAMPLE_RATE = 24000
DEFAULT_VOICE = "Chelsie"


def _ar_kernels_ahead(ctx: StageContext, cfg: DecoderConfig, max_position_embeddings: int,
                      params: Callable[[], SamplingParams], dense_gemvs: bool = True
                      ) -> list[KernelJob]:
    """An AR stage's Triton kernel variants (engine/ar/kernels_ahead_ar.py) for its decoder
    config, engine options (as thinker_worker/talker_worker read them) and warm-up params."""
    if ctx.device.type != "cuda" or ctx.tensor_parallel_size > 1:
        return []
    engine = stage_engine_config(max_position_embeddings, ctx.options["engine"], ctx.stage.engine)
    return ar_kernel_jobs(DecoderDims.from_config(cfg), ctx.dtype, engine, ctx.device,
                          [ctx.stage.default_sampling.apply(params())], dense_gemvs=dense_gemvs)


def thinker_kernels_ahead(ctx: StageContext) -> list[KernelJob]:
    """The thinker LM's kernel variants (its encoders' are left to its build)."""
    text = ctx.config["thinker_config"]["text_config"]
    cfg = DecoderConfig.from_hf(
        text, attention_bias=Qwen2_5OmniThinkerForCausalLM.attention_bias(text))
    return _ar_kernels_ahead(ctx, cfg, text.get("max_position_embeddings", 32768),
                             lambda: generation_defaults(load_generation_config(ctx.path)),
                             dense_gemvs=ctx.options.get("quantization") != "fp8")


def talker_kernels_ahead(ctx: StageContext) -> list[KernelJob]:
    """The talker's kernel variants (its config parsed as Qwen2_5OmniTalkerForCausalLM's)."""
    model_cfg = ctx.config["talker_config"]
    cfg = DecoderConfig.from_hf(dict(model_cfg, tie_word_embeddings=False), attention_bias=True)
    return _ar_kernels_ahead(ctx, cfg, model_cfg.get("max_position_embeddings", 32768),
                             lambda: talker_default_params(talker_token_ids(model_cfg)[0]))


@register_stage("Qwen2_5OmniThinker", "ar", kernels_ahead=thinker_kernels_ahead)
def build_thinker(ctx: StageContext) -> ARStageWorker:
    tokenizer = Qwen2_5OmniInputProcessor.from_pretrained(ctx.path).tokenizer
    model = build_stage_model(Qwen2_5OmniThinkerForCausalLM, ctx.config["thinker_config"], ctx,
                              "thinker.")
    if ctx.options.get("quantization") == "fp8":  # the LM's projections; encoders stay 16-bit
        quantize_decoder(model)
    return thinker_worker(ctx, model, tokenizer)


@register_stage("Qwen2_5OmniTalker", "ar", kernels_ahead=talker_kernels_ahead)
def build_talker(ctx: StageContext) -> ARStageWorker:
    model_cfg = ctx.config["talker_config"]
    model = build_stage_model(Qwen2_5OmniTalkerForCausalLM, model_cfg, ctx, "talker.")
    params = talker_default_params(talker_token_ids(model_cfg)[0])
    # the thinker's rows are of the talker's embedding width
    return talker_worker(ctx, model, model_cfg.get("max_position_embeddings", 32768), params,
                         model_cfg["embedding_size"])


@register_stage("Qwen2_5OmniToken2Wav", "gen", sample_rate=SAMPLE_RATE,
                kernels_ahead=code2wav_kernels_ahead)
def build_code2wav(ctx: StageContext) -> GenStageWorker:
    return build_code2wav_stage(ctx.path, ctx.config, ctx.stage, ctx.name, ctx.device, ctx.dtype,
                                *ctx.options["code2wav"])


@register_pipeline("qwen2_5_omni")
class Qwen2_5OmniPipeline(ThinkerTalkerPipeline):
    ARCHITECTURES = ("Qwen2_5OmniForConditionalGeneration", "Qwen2_5OmniModel")
    family = "Qwen2.5-Omni"

    @classmethod
    def matches(cls, config: dict) -> bool:
        archs = config.get("architectures") or []
        return any(a in cls.ARCHITECTURES for a in archs) or (
            "thinker_config" in config and "token2wav_config" in config)

    def __init__(self, path, config: dict, pipeline: PipelineConfig, device: torch.device,
                 dtype: torch.dtype, engine_options: dict[str, Any]) -> None:
        """The front end (processor, voices, request preparation) in this process; each stage
        built here or, where its `worker` is "process", in a stage process of its own."""
        options = self._check_options(engine_options)
        self.talker_handoff = options["talker_handoff"]
        st, sk, sc = self._init_front(path, config, pipeline, options, Qwen2_5OmniInputProcessor)
        self.voices = load_voices(path) if sk and sc and config.get("talker_config") else {}
        stages = [st] + ([sk, sc] if self.voices else [])
        self.output_modalities = ["text", "audio"] if self.voices else ["text"]
        if self.voices:
            talker_cfg = config["talker_config"]
            self.talker_vocab_size = talker_cfg["vocab_size"]
            self.codec_ids, self.text_ids = talker_token_ids(talker_cfg)
            self.default_params[sk.name] = sk.default_sampling.apply(
                talker_default_params(self.codec_ids))
            self.default_params[sc.name] = SamplingParams()
        self._build_workers(stages, path, config, device, dtype, options)

    @classmethod
    def _check_options(cls, engine_options: dict[str, Any]) -> dict[str, Any]:
        opts = dict(engine_options)
        handoff = opts.pop("talker_handoff", "qwen")
        if handoff not in HANDOFFS:
            raise ValueError(f"talker_handoff: {handoff!r}; one of {HANDOFFS}")
        # code2wav_*: the code2wav stage's engine and model options (code2wav_options.py)
        options = cls.split_options(opts, pop_code2wav_options)
        if options["load_format"] != "safetensors":
            raise ValueError("load_format: Qwen2.5-Omni loads its safetensors weights (no "
                             "dummy weights)")
        return {"talker_handoff": handoff, **options}

    # ---------------------------------------------------------------- requests
    def prepare_audio(self, req: RuntimeRequest, seq: Sequence, processed: Any, prompt: Any,
                      params: dict[str, SamplingParams], where: str) -> None:
        voice = prompt.get("voice") if isinstance(prompt, dict) else None
        voice = DEFAULT_VOICE if voice is None else voice
        if voice not in self.voices:
            raise ValueError(f"{where}.voice: {voice!r} is not available; voices: "
                             f"{sorted(self.voices)}")
        tp = self._talker_params(params, where)
        code2wav = self.roles["code2wav"].name
        cp = params[code2wav]
        # its seed reaches torch.Generator: checked (int64) like the other stages' params
        cp.validate(where.replace("prompts", "sampling_params") + f"[{code2wav}]")
        tseed = tp.seed if tp.seed is not None else stage_seed(seq.seed, 1)
        cseed = cp.seed if cp.seed is not None else stage_seed(seq.seed, 2)
        seq.export_hidden = True
        v = self.voices[voice]
        adapter = ADAPTER_REGISTRY[self.roles["talker"].inputs[0].adapter](
            list(seq.prompt_token_ids), [(m.start, m.end) for m in seq.media], v["bos_token"],
            self.text_ids, self.talker_handoff)
        talker_seq = talker_sequence(seq.request_id, seq, adapter, self.codec_ids, tp, tseed)
        # the stage moves the voice to its device at submit, on the runtime's thread: the front
        # end (any thread) makes no CUDA calls, which could meet a graph capture there
        c2w = Code2WavRequest(v["cond"], v["ref_mel"], cseed)
        to_code2wav = ADAPTER_REGISTRY[self.roles["code2wav"].inputs[0].adapter](
            tp.stop_token_ids)
        self._route_audio(req, adapter, talker_seq, to_code2wav, c2w, SAMPLE_RATE)
        talker, stops = self.roles["talker"].name, set(tp.stop_token_ids)
        req.finalize = lambda out: self._finalize(out, talker, stops)
