"""Qwen2.5-Omni's pipeline: thinker (AR) -> talker (AR) -> code2wav (generation), built from the
pipeline YAML (built-in: config/pipelines/qwen2_5_omni.yaml).

prepare() validates and processes one prompt (ids, encoder features, 3-axis positions, voice,
seeds) and wires its routes: thinker rows -> the talker's adapter, talker codes -> code2wav."""

from __future__ import annotations

from typing import Any

import torch

from omnistage.checkpoint import eos_token_ids, iter_tensors, load_generation_config
from omnistage.config.schema import PipelineConfig, StageConfig
from omnistage.engine.ar.engine import AREngine
from omnistage.engine.ar.sequence import Sequence
from omnistage.models.qwen2_5_omni.code2wav_options import pop_code2wav_options
from omnistage.engine.gen import GenStageWorker
from omnistage.models.qwen2_5_omni.code2wav_stage import Code2WavRequest, build_code2wav_stage
from omnistage.models.qwen2_5_omni.processor import Qwen2_5OmniInputProcessor
from omnistage.models.qwen2_5_omni.talker import (HANDOFFS, Qwen2_5OmniTalkerForCausalLM,
                                                  talker_default_params, talker_sequence,
                                                  talker_token_ids)
from omnistage.models.qwen2_5_omni.thinker import (Qwen2_5OmniThinkerForCausalLM,
                                                   thinker_sequence)
from omnistage.models.qwen2_5_omni.voices import load_voices
from omnistage.models.registry import ADAPTER_REGISTRY, register_pipeline, register_stage
from omnistage.outputs import OmniRequestOutput
from omnistage.runtime.build import (StageContext, build_model, build_stage_worker,
                                     build_stages, generation_defaults, new_request_id,
                                     resolve_seed, stage_engine_config)
from omnistage.runtime.orchestrator import RuntimeRequest
from omnistage.runtime.process import pop_stage_worker
from omnistage.runtime.stage import ARStageWorker, StageLink
from omnistage.sampling_params import SamplingParams

SAMPLE_RATE = 24000
DEFAULT_VOICE = "Chelsie"


def _roles(cfg: PipelineConfig) -> dict[str, StageConfig | None]:
    """The stages by their part, read off the YAML's outputs and inputs: the thinker gives
    text, code2wav gives audio, the talker feeds code2wav."""
    thinker = next((s for s in cfg.stages if s.output == "text"), None)
    code2wav = next((s for s in cfg.stages if s.output == "audio"), None)
    talker = None
    if code2wav is not None and code2wav.inputs:
        talker = cfg.stage(code2wav.inputs[0].upstream)
    return {"thinker": thinker, "talker": talker, "code2wav": code2wav}


def _kv_fraction(ctx: StageContext, fraction: float) -> dict[str, Any]:
    """The AR engine options; on CUDA, unless sized by the user, KV takes `fraction` of the
    free memory. NOTE: stages share one GPU: the thinker (built first) takes 45% for KV, the
    talker half of what is left, and the rest stays for code2wav and graphs."""
    opts = dict(ctx.options["engine"])
    sized = {"num_kv_blocks", "kv_cache_memory_fraction"}
    if ctx.device.type == "cuda" \
            and not sized & {k for k, v in opts.items() if v is not None} \
            and not sized & {k for k, v in ctx.stage.engine.model_dump().items() if v is not None}:
        opts["kv_cache_memory_fraction"] = fraction
    return opts


@register_stage("Qwen2_5OmniThinker", "ar")
def build_thinker(ctx: StageContext) -> ARStageWorker:
    model_cfg = ctx.config["thinker_config"]
    tokenizer = Qwen2_5OmniInputProcessor.from_pretrained(ctx.path).tokenizer
    gen_cfg = load_generation_config(ctx.path)
    model = build_model(Qwen2_5OmniThinkerForCausalLM, model_cfg,
                        iter_tensors(ctx.path, ctx.prefix("thinker.")), ctx.device, ctx.dtype)
    cfg = stage_engine_config(model_cfg["text_config"].get("max_position_embeddings", 32768),
                              _kv_fraction(ctx, 0.45), ctx.stage.engine)
    engine = AREngine(model, cfg, ctx.device, ctx.dtype, tokenizer,
                      eos_token_ids(gen_cfg, ctx.config, None))
    engine.runner.warmup_graphs([ctx.stage.default_sampling.apply(generation_defaults(gen_cfg))])
    # the thinker's stream ahead of the talker's: the talker's steps wait for its rows
    return ARStageWorker(ctx.name, engine, priority=-2)


@register_stage("Qwen2_5OmniTalker", "ar")
def build_talker(ctx: StageContext) -> ARStageWorker:
    model_cfg = ctx.config["talker_config"]
    model = build_model(Qwen2_5OmniTalkerForCausalLM, model_cfg,
                        iter_tensors(ctx.path, ctx.prefix("talker.")), ctx.device, ctx.dtype)
    cfg = stage_engine_config(model_cfg.get("max_position_embeddings", 32768),
                              _kv_fraction(ctx, 0.5), ctx.stage.engine)
    engine = AREngine(model, cfg, ctx.device, ctx.dtype, None, set())
    params = talker_default_params(talker_token_ids(model_cfg)[0])
    # decode steps add the thinker's rows (of the talker's embedding width)
    engine.runner.warmup_graphs([ctx.stage.default_sampling.apply(params)],
                                model_cfg["embedding_size"])
    return ARStageWorker(ctx.name, engine, priority=-1)


@register_stage("Qwen2_5OmniToken2Wav", "gen", sample_rate=SAMPLE_RATE)
def build_code2wav(ctx: StageContext) -> GenStageWorker:
    return build_code2wav_stage(ctx.path, ctx.config, ctx.stage, ctx.name, ctx.device, ctx.dtype,
                                *ctx.options["code2wav"])


@register_pipeline("qwen2_5_omni")
class Qwen2_5OmniPipeline:
    ARCHITECTURES = ("Qwen2_5OmniForConditionalGeneration", "Qwen2_5OmniModel")

    @classmethod
    def matches(cls, config: dict) -> bool:
        archs = config.get("architectures") or []
        return any(a in cls.ARCHITECTURES for a in archs) or (
            "thinker_config" in config and "token2wav_config" in config)

    def __init__(self, path, config: dict, pipeline: PipelineConfig, device: torch.device,
                 dtype: torch.dtype, engine_options: dict[str, Any]) -> None:
        """The front end (processor, voices, request preparation) in this process; each stage
        built here or, where its `worker` is "process", in a stage process of its own."""
        thinker_cfg = config.get("thinker_config")
        if not thinker_cfg:
            raise ValueError(f"model: {path}/config.json has no thinker_config")
        options = self._check_options(engine_options)
        self.talker_handoff = options["talker_handoff"]
        self.config = pipeline
        self.roles = _roles(pipeline)
        st, sk, sc = self.roles["thinker"], self.roles["talker"], self.roles["code2wav"]
        if st is None:
            raise ValueError("pipeline: a Qwen2.5-Omni pipeline needs a stage with output: text")
        self.processor = Qwen2_5OmniInputProcessor.from_pretrained(path)
        self.tokenizer = self.processor.tokenizer
        gen_cfg = load_generation_config(path)
        text_cfg = thinker_cfg["text_config"]
        self.thinker_vocab_size = text_cfg["vocab_size"]
        self.thinker_eos = eos_token_ids(gen_cfg, config, None)
        self.max_model_len = stage_engine_config(
            text_cfg.get("max_position_embeddings", 32768), options["engine"],
            st.engine).max_model_len
        self.default_params: dict[str, SamplingParams] = {
            st.name: st.default_sampling.apply(generation_defaults(gen_cfg))}
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
        self.stage_order = [s.name for s in stages]
        self.workers, self.process_stages = build_stages(path, config, pipeline, stages, device,
                                                         dtype, options)

    @classmethod
    def _check_options(cls, engine_options: dict[str, Any]) -> dict[str, Any]:
        opts = dict(engine_options)
        handoff = opts.pop("talker_handoff", "qwen")
        if handoff not in HANDOFFS:
            raise ValueError(f"talker_handoff: {handoff!r}; one of {HANDOFFS}")
        # code2wav_*: the code2wav stage's engine and model options (code2wav_options.py)
        code2wav = pop_code2wav_options(opts)
        worker = pop_stage_worker(opts)
        return {"talker_handoff": handoff, "code2wav": code2wav, "stage_worker": worker,
                "engine": opts}

    build_stage = staticmethod(build_stage_worker)  # by each stage's registered `model`

    @property
    def stage_names(self) -> list[str]:
        return list(self.stage_order)

    # the stage models and workers of this process (tests, benchmarks)
    @property
    def thinker(self) -> Qwen2_5OmniThinkerForCausalLM:
        return self.workers[self.roles["thinker"].name].engine.runner.model

    @property
    def talker(self) -> Qwen2_5OmniTalkerForCausalLM:
        return self.workers[self.roles["talker"].name].engine.runner.model

    @property
    def code2wav(self) -> GenStageWorker:
        return self.workers[self.roles["code2wav"].name]

    @property
    def engines(self) -> dict[str, AREngine]:
        return {n: w.engine for n, w in self.workers.items() if isinstance(w, ARStageWorker)}

    # ---------------------------------------------------------------- requests
    def prepare(self, prompt: Any, params: dict[str, SamplingParams], modalities: list[str],
                where: str, index: int) -> RuntimeRequest:
        names = {role: (s.name if s else None) for role, s in self.roles.items()}
        p = params[names["thinker"]]
        p.validate(where.replace("prompts", "sampling_params") + f"[{names['thinker']}]",
                   self.thinker_vocab_size)
        seq = self._thinker_seq(prompt, p, modalities, where, index)
        if isinstance(prompt, dict) and prompt.get("forced_reply"):
            self._force_reply(seq, prompt["forced_reply"])
        req = RuntimeRequest(seq.request_id, [names["thinker"]], {names["thinker"]: seq},
                             text_stage=names["thinker"], seed=seq.seed,
                             prompt_token_ids=list(seq.prompt_token_ids))
        if "audio" not in modalities:
            return req
        voice = prompt.get("voice") if isinstance(prompt, dict) else None
        voice = DEFAULT_VOICE if voice is None else voice
        if voice not in self.voices:
            raise ValueError(f"{where}.voice: {voice!r} is not available; voices: "
                             f"{sorted(self.voices)}")
        tp = params[names["talker"]]
        tp.validate(where.replace("prompts", "sampling_params") + f"[{names['talker']}]",
                    self.talker_vocab_size)
        cp = params[names["code2wav"]]
        tseed = tp.seed if tp.seed is not None else seq.seed + 1
        cseed = cp.seed if cp.seed is not None else seq.seed + 2
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
        req.path += [names["talker"], names["code2wav"]]
        req.stage_requests.update({names["talker"]: talker_seq, names["code2wav"]: c2w})
        req.links = [StageLink(names["thinker"], names["talker"], adapter),
                     StageLink(names["talker"], names["code2wav"], to_code2wav)]
        req.audio_stage, req.sample_rate = names["code2wav"], SAMPLE_RATE
        stops = set(tp.stop_token_ids)
        req.finalize = lambda out: self._finalize(out, names["talker"], stops)
        return req

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

    @staticmethod
    def _finalize(out: OmniRequestOutput, talker: str, stops: set[int]) -> None:
        stage = out.stages.get(talker)
        if stage is not None and stage.finish_reason == "stop" and stage.token_ids \
                and stage.token_ids[-1] in stops:  # codes without the stop code that ended them
            stage.token_ids = stage.token_ids[:-1]
            out.metrics.tokens_per_stage[talker] = len(stage.token_ids)

    def _thinker_seq(self, prompt, p: SamplingParams, modalities, where, index) -> Sequence:
        max_prompt = self.max_model_len - 1
        with_av = prompt.get("use_audio_in_video", False) if isinstance(prompt, dict) else False
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
            return thinker_sequence(new_request_id(index), processed, p, resolve_seed(p))
        ids = list(prompt["prompt_token_ids"])  # raw token ids: text only
        bad = [t for t in ids if not 0 <= t < self.thinker_vocab_size]
        if bad:
            raise ValueError(f"{where}.prompt_token_ids: ids {bad[:4]} outside the vocabulary")
        if len(ids) > max_prompt:
            raise ValueError(f"{where}: {len(ids)} tokens; max_model_len is {max_prompt + 1}")
        return Sequence(new_request_id(index), ids, p, resolve_seed(p),
                        mrope_positions=torch.arange(len(ids)).expand(3, -1).clone())

