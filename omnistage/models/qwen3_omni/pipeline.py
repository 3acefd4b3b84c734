"""Qwen3-Omni's pipeline: thinker (AR, MoE) -> talker (AR, MoE, 16 codebooks per step) ->
code2wav (generation, stateful streaming), built from the pipeline YAML (built-in:
config/pipelines/qwen3_omni.yaml). The Thinking and Captioner checkpoints (no talker) run the
thinker only.

prepare() validates and processes one prompt (ids, encoder features, 3-axis positions,
speaker, seeds) and wires its routes: thinker rows -> the talker's adapter, talker frames ->
code2wav."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from omnistage.config.schema import PipelineConfig
from omnistage.engine.ar.engine import AREngine
from omnistage.engine.ar.sequence import Sequence
from omnistage.layers.moe import SparseMoE
from omnistage.models.omni_pipeline import ThinkerTalkerPipeline, talker_worker, thinker_worker
from omnistage.models.qwen3_omni.code2wav_stage import (SAMPLE_RATE, Qwen3OmniCode2WavRequest,
                                                        pop_code2wav_options)
from omnistage.models.qwen3_omni.processor import Qwen3OmniInputProcessor
from omnistage.models.qwen3_omni.rope_index import Qwen3OmniRopeConfig, talker_positions
from omnistage.models.qwen3_omni.talker import (Qwen3OmniTalkerForCausalLM, ResidualSampling,
                                                talker_default_params, talker_sequence)
from omnistage.models.qwen3_omni.thinker import Qwen3OmniThinkerForCausalLM
from omnistage.models.registry import ADAPTER_REGISTRY, register_pipeline, register_stage
from omnistage.runtime.build import StageContext, build_stage_model
from omnistage.runtime.orchestrator import RuntimeRequest
from omnistage.runtime.stage import ARStageWorker
from omnistage.sampling_params import SamplingParams, stage_seed

DEFAULT_VOICE = "Ethan"  # transformers' generate default speaker
# KV shares of the free GPU memory (when not sized by the user): the thinker's first, then the
# talker's of what is left. Smaller than Qwen2.5's: the 30B MoE weights leave less room, and
# code2wav's activations at batch 32 and the graphs need the rest (KV at these shares
# still holds far more than 64 requests of the benchmark's length)
THINKER_KV_SHARE, TALKER_KV_SHARE = 0.25, 0.2


def has_talker(config: dict) -> bool:
    """Whether the checkpoint speaks (the Thinking / Captioner ones have no talker)."""
    return bool(config.get("enable_audio_output", True) and config.get("talker_config")
                and config.get("code2wav_config"))


def quantize_experts(model: torch.nn.Module, quantization: str | None) -> None:
    """quantization="fp8": every MoE layer's experts (and shared expert) in float8 e4m3 with
    per-channel scales (the routers and attention stay in the model dtype)."""
    if quantization == "fp8":
        for module in model.modules():
            if isinstance(module, SparseMoE):
                module.quantize_fp8()


@register_stage("Qwen3OmniMoeThinker", "ar")
def build_thinker(ctx: StageContext) -> ARStageWorker:
    tokenizer = Qwen3OmniInputProcessor.from_pretrained(ctx.path).tokenizer
    model = build_stage_model(Qwen3OmniThinkerForCausalLM, ctx.config["thinker_config"], ctx,
                              "thinker.")
    quantize_experts(model, ctx.options.get("quantization"))
    if has_talker(ctx.config):  # the talker reads this layer's rows at media placeholders
        model.export_layer = ctx.config["talker_config"]["accept_hidden_layer"]
    return thinker_worker(ctx, model, tokenizer, kv_share=THINKER_KV_SHARE)


@register_stage("Qwen3OmniMoeTalker", "ar")
def build_talker(ctx: StageContext) -> ARStageWorker:
    model_cfg = ctx.config["talker_config"]
    model = build_stage_model(Qwen3OmniTalkerForCausalLM, model_cfg, ctx, "talker.")
    quantize_experts(model, ctx.options.get("quantization"))
    model.residual_sampling = ResidualSampling(**ctx.stage.residual_sampling.model_dump())
    # the thinker's text rows are of the talker's width
    return talker_worker(ctx, model,
                         model_cfg["text_config"].get("max_position_embeddings", 32768),
                         talker_default_params(model_cfg), model.config.hidden_size,
                         kv_share=TALKER_KV_SHARE)


@register_pipeline("qwen3_omni")
class Qwen3OmniPipeline(ThinkerTalkerPipeline):
    ARCHITECTURES = ("Qwen3OmniMoeForConditionalGeneration",)
    family = "Qwen3-Omni"

    @classmethod
    def matches(cls, config: dict) -> bool:
        archs = config.get("architectures") or []
        return any(a in cls.ARCHITECTURES for a in archs) or \
            config.get("model_type") == "qwen3_omni_moe"

    def __init__(self, path, config: dict, pipeline: PipelineConfig, device: torch.device,
                 dtype: torch.dtype, engine_options: dict[str, Any]) -> None:
        options = self.split_options(engine_options, pop_code2wav_options)
        st, sk, sc = self._init_front(path, config, pipeline, options, Qwen3OmniInputProcessor)
        thinker_cfg = config["thinker_config"]
        speaks = bool(sk and sc and has_talker(config))
        stages = [st] + ([sk, sc] if speaks else [])
        self.output_modalities = ["text", "audio"] if speaks else ["text"]
        self.voices: dict[str, int] = {}
        if speaks:
            talker_cfg = config["talker_config"]
            # speakers are matched case-insensitively (transformers lower-cases the name)
            self.voices = {name.lower(): int(i) for name, i in
                           (talker_cfg.get("speaker_id") or {}).items()}
            if not self.voices:
                raise ValueError("config.talker_config.speaker_id: no speakers")
            self.talker_config = talker_cfg
            # the talker's token ids, with the thinker's audio window (the talker has none)
            self.talker_rope = Qwen3OmniRopeConfig.from_thinker_config(
                talker_cfg, thinker_cfg.get("audio_config"))
            self.talker_vocab_size = talker_cfg["text_config"]["vocab_size"]
            self.token_ids = {
                "im_start": config["im_start_token_id"], "user": config["user_token_id"],
                "assistant": config["assistant_token_id"],
                "tts_bos": config["tts_bos_token_id"], "tts_eos": config["tts_eos_token_id"],
                "tts_pad": config["tts_pad_token_id"]}
            self.media_token_ids = [thinker_cfg[k] for k in
                                    ("audio_token_id", "image_token_id", "video_token_id")]
            talker_defaults = talker_default_params(talker_cfg)
            self.codec_specials = set(talker_defaults.suppress_token_ids)
            self.codec_eos = talker_cfg["codec_eos_token_id"]
            self.default_params[sk.name] = sk.default_sampling.apply(talker_defaults)
            self.default_params[sc.name] = SamplingParams()
        self._build_workers(stages, path, config, device, dtype, options)

    @property
    def engines_by_role(self) -> dict[str, AREngine]:
        return {role: self.workers[s.name].engine for role, s in self.roles.items()
                if s is not None and isinstance(self.workers.get(s.name), ARStageWorker)}

    # ---------------------------------------------------------------- requests
    def prepare_audio(self, req: RuntimeRequest, seq: Sequence, processed: Any, prompt: Any,
                      params: dict[str, SamplingParams], where: str) -> None:
        voice = prompt.get("voice") if isinstance(prompt, dict) else None
        voice = DEFAULT_VOICE if voice is None else voice
        if not isinstance(voice, str) or voice.lower() not in self.voices:
            raise ValueError(f"{where}.voice: {voice!r} is not available; voices: "
                             f"{sorted(self.voices)}")
        tp = self._talker_params(params, where)
        # the codec's special ids are never codes (code2wav could not decode them): suppressed
        # and eos a stop whatever the request's talker params say
        tp = dataclasses.replace(
            tp, suppress_token_ids=sorted(set(tp.suppress_token_ids) | self.codec_specials),
            stop_token_ids=sorted(set(tp.stop_token_ids) | {self.codec_eos}))
        tseed = tp.seed if tp.seed is not None else stage_seed(seq.seed, 1)
        c = self.talker_config
        codec_ids = [c["codec_nothink_id"], c["codec_think_bos_id"], c["codec_think_eos_id"],
                     self.voices[voice.lower()], c["codec_pad_id"], c["codec_bos_id"]]
        try:
            adapter = ADAPTER_REGISTRY[self.roles["talker"].inputs[0].adapter](
                list(seq.prompt_token_ids), self.media_token_ids, self.token_ids, codec_ids)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from e
        # the talker reads the thinker's rows at prompt positions only (reply rows are token
        # embeddings, which the adapter takes from the sampled ids)
        seq.export_hidden = seq.export_prompt_only = True
        positions, delta = None, 0  # a prompt without media: sequential, as transformers does
        if processed is not None and processed.media:
            positions, delta = talker_positions(
                list(seq.prompt_token_ids), adapter.user.tolist(), self.token_ids["tts_pad"],
                processed, self.talker_rope)
        talker_seq = talker_sequence(seq.request_id, adapter, c["codec_pad_id"], positions,
                                     delta, tp, tseed, seq.media)
        to_code2wav = ADAPTER_REGISTRY[self.roles["code2wav"].inputs[0].adapter](self.codec_eos)
        self._route_audio(req, adapter, talker_seq, to_code2wav, Qwen3OmniCode2WavRequest(),
                          SAMPLE_RATE)
        talker, stops = self.roles["talker"].name, set(tp.stop_token_ids)
        req.finalize = lambda out: self._finalize_frames(out, talker, stops)

    def _finalize_frames(self, out, talker: str, stops: set[int]) -> None:
        """Codebook 0 without its stop code; `codes` = the frames that became audio."""
        self._finalize(out, talker, stops)
        stage = out.stages.get(talker)
        if stage is not None and stage.codes is not None and stage.finish_reason == "length":
            stage.codes = stage.codes[:-1]
