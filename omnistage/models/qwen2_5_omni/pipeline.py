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
from omnistage.entrypoints.lm_pipeline import (build_model, generation_defaults, new_request_id,
                                               resolve_seed, stage_engine_config)
from omnistage.entrypoints.options import resolve_device, resolve_dtype
from omnistage.models.qwen2_5_omni.code2wav_stage import Code2WavRequest, Qwen2_5OmniCode2WavStage
from omnistage.models.qwen2_5_omni.code2wav_stream import Qwen2_5OmniCode2WavStreamConfig
from omnistage.models.qwen2_5_omni.processor import Qwen2_5OmniInputProcessor
from omnistage.models.qwen2_5_omni.talker import (HANDOFFS, Qwen2_5OmniTalkerForCausalLM,
                                                  talker_sequence)
from omnistage.models.qwen2_5_omni.thinker import (Qwen2_5OmniThinkerForCausalLM,
                                                   thinker_sequence)
from omnistage.models.qwen2_5_omni.token2wav import Qwen2_5OmniToken2Wav
from omnistage.models.qwen2_5_omni.voices import load_voices
from omnistage.models.registry import ADAPTER_REGISTRY
from omnistage.outputs import OmniRequestOutput
from omnistage.runtime.orchestrator import RuntimeRequest
from omnistage.runtime.stage import ARStageWorker
from omnistage.sampling_params import SamplingParams

SAMPLE_RATE = 24000
DEFAULT_VOICE = "Chelsie"


def _role(cfg: PipelineConfig, model: str) -> StageConfig | None:
    return next((s for s in cfg.stages if s.model == model), None)


def _prefix(stage: StageConfig, default: str) -> str:
    return default if stage.checkpoint_prefix is None else stage.checkpoint_prefix


class Qwen2_5OmniPipeline:
    builtin = "qwen2_5_omni"

    def __init__(self, path, config: dict, pipeline: PipelineConfig, device: torch.device,
                 dtype: torch.dtype, engine_options: dict[str, Any]) -> None:
        thinker_cfg = config.get("thinker_config")
        if not thinker_cfg:
            raise ValueError(f"model: {path}/config.json has no thinker_config")
        self.talker_handoff = engine_options.pop("talker_handoff", "qwen")
        if self.talker_handoff not in HANDOFFS:
            raise ValueError(f"talker_handoff: {self.talker_handoff!r}; one of {HANDOFFS}")
        # code2wav_window: None = one-shot per utterance, else a streaming window config
        window = engine_options.pop("code2wav_window", Qwen2_5OmniCode2WavStreamConfig())
        if window is not None and not isinstance(window, Qwen2_5OmniCode2WavStreamConfig):
            raise ValueError("code2wav_window: a Qwen2_5OmniCode2WavStreamConfig or None")
        self.config = pipeline
        self.roles = {role: _role(pipeline, model) for role, model in (
            ("thinker", "Qwen2_5OmniThinker"), ("talker", "Qwen2_5OmniTalker"),
            ("code2wav", "Qwen2_5OmniToken2Wav"))}
        if self.roles["thinker"] is None:
            raise ValueError("pipeline: a Qwen2.5-Omni pipeline needs a Qwen2_5OmniThinker stage")
        self.processor = Qwen2_5OmniInputProcessor.from_pretrained(path)
        self.tokenizer = self.processor.tokenizer
        gen_cfg = load_generation_config(path)
        self.workers: dict = {}
        self.default_params: dict[str, SamplingParams] = {}

        st = self.roles["thinker"]
        t_dev, t_dtype = self._placement(st, device, dtype)
        self.thinker = build_model(Qwen2_5OmniThinkerForCausalLM, thinker_cfg,
                                   iter_tensors(path, _prefix(st, "thinker.")), t_dev, t_dtype)
        self._add_ar(st, self.thinker, t_dev, t_dtype, engine_options,
                     thinker_cfg["text_config"], eos_token_ids(gen_cfg, config, None),
                     tokenizer=self.tokenizer)
        self.default_params[st.name] = st.default_sampling.apply(generation_defaults(gen_cfg))

        sk, sc = self.roles["talker"], self.roles["code2wav"]
        self.voices = load_voices(path) if sk and sc and config.get("talker_config") else {}
        if not self.voices:
            self.output_modalities = ["text"]
            return
        self.output_modalities = ["text", "audio"]
        k_dev, k_dtype = self._placement(sk, device, dtype)
        talker_cfg = config["talker_config"]
        self.talker = build_model(Qwen2_5OmniTalkerForCausalLM, talker_cfg,
                                  iter_tensors(path, _prefix(sk, "talker.")), k_dev, k_dtype)
        self._add_ar(sk, self.talker, k_dev, k_dtype, engine_options, talker_cfg, set())
        self.default_params[sk.name] = sk.default_sampling.apply(self.talker.default_params())
        c_dev, c_dtype = self._placement(sc, device, dtype)
        with torch.device(c_dev):
            token2wav = Qwen2_5OmniToken2Wav(config["token2wav_config"])
        token2wav.load_state_dict(dict(iter_tensors(path, _prefix(sc, "token2wav."))), strict=True)
        token2wav.to(c_dtype if sc.dtype != "auto" else torch.float32).eval()
        self.code2wav = Qwen2_5OmniCode2WavStage(sc.name, token2wav, c_dev, window)
        self.workers[sc.name] = self.code2wav
        self.default_params[sc.name] = SamplingParams()
        self.code2wav_device = c_dev

    @staticmethod
    def _placement(stage: StageConfig, device, dtype) -> tuple[torch.device, torch.dtype]:
        dev = resolve_device(stage.device) if stage.device else device
        return dev, (dtype if stage.dtype == "auto" else resolve_dtype(stage.dtype, dev))

    def _add_ar(self, stage: StageConfig, model, device, dtype, options, model_cfg: dict,
                eos: set[int], tokenizer=None) -> None:
        options = dict(options)
        sized = {"num_kv_blocks", "kv_cache_memory_fraction"}
        if device.type == "cuda" and not sized & {k for k, v in options.items() if v is not None} \
                and not sized & {k for k, v in stage.engine.model_dump().items() if v is not None}:
            # NOTE: stages share one GPU: the thinker (built first) takes 45% of the free memory
            # for KV, the talker half of what is left, and the rest stays for code2wav and graphs
            options["kv_cache_memory_fraction"] = 0.45 if not self.workers else 0.5
        cfg = stage_engine_config(model_cfg.get("max_position_embeddings", 32768), options,
                                  stage.engine)
        self.workers[stage.name] = ARStageWorker(
            stage.name, AREngine(model, cfg, device, dtype, tokenizer, eos))

    @property
    def stage_names(self) -> list[str]:
        return list(self.workers)

    @property
    def engines(self) -> dict[str, AREngine]:
        return {n: w.engine for n, w in self.workers.items() if isinstance(w, ARStageWorker)}

    # ---------------------------------------------------------------- requests
    def prepare(self, prompt: Any, params: dict[str, SamplingParams], modalities: list[str],
                where: str, index: int) -> RuntimeRequest:
        names = {role: (s.name if s else None) for role, s in self.roles.items()}
        p = params[names["thinker"]]
        p.validate(where.replace("prompts", "sampling_params") + f"[{names['thinker']}]",
                   self.thinker.vocab_size)
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
                    self.talker.vocab_size)
        cp = params[names["code2wav"]]
        tseed = tp.seed if tp.seed is not None else seq.seed + 1
        cseed = cp.seed if cp.seed is not None else seq.seed + 2
        seq.export_hidden = True
        v = self.voices[voice]
        adapter = ADAPTER_REGISTRY[self.roles["talker"].inputs[0].adapter](
            self.thinker, self.talker, seq, v["bos_token"], self.talker_handoff)
        talker_seq = talker_sequence(seq.request_id, seq, adapter, self.talker, tp, tseed)
        dev = self.code2wav_device
        c2w = Code2WavRequest(v["cond"].to(dev), v["ref_mel"].to(dev), cseed)
        to_code2wav = ADAPTER_REGISTRY[self.roles["code2wav"].inputs[0].adapter](
            self.code2wav, tp.stop_token_ids)
        req.path += [names["talker"], names["code2wav"]]
        req.stage_requests.update({names["talker"]: talker_seq, names["code2wav"]: c2w})
        req.routes = {names["thinker"]: [adapter.on_event],
                      names["talker"]: [to_code2wav.on_event]}
        req.audio_stage, req.sample_rate = names["code2wav"], SAMPLE_RATE
        req.finalize = lambda out: self._finalize(out, names["talker"], to_code2wav)
        return req

    def _force_reply(self, seq: Sequence, text: str) -> None:
        """The thinker's reply is exactly `text` (then its end token): no sampling."""
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        eos = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        if eos is None or eos < 0 or eos == self.tokenizer.unk_token_id:
            eos = min(self.workers[self.roles["thinker"].name].engine.eos_token_ids)
        seq.forced_output_ids = ids + [eos]
        seq.params = SamplingParams(**{**seq.params.__dict__, "temperature": 0.0,
                                       "max_tokens": len(ids) + 1, "min_tokens": 0,
                                       "stop": [], "ignore_eos": False})

    @staticmethod
    def _finalize(out: OmniRequestOutput, talker: str, to_code2wav) -> None:
        if talker in out.stages:  # codes without the stop code that ended them
            out.stages[talker].token_ids = list(to_code2wav.codes)
            out.metrics.tokens_per_stage[talker] = len(to_code2wav.codes)

    def _thinker_seq(self, prompt, p: SamplingParams, modalities, where, index) -> Sequence:
        engine = self.workers[self.roles["thinker"].name].engine
        max_prompt = engine.config.max_model_len - 1
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
        bad = [t for t in ids if not 0 <= t < self.thinker.vocab_size]
        if bad:
            raise ValueError(f"{where}.prompt_token_ids: ids {bad[:4]} outside the vocabulary")
        if len(ids) > max_prompt:
            raise ValueError(f"{where}: {len(ids)} tokens; max_model_len is {max_prompt + 1}")
        return Sequence(new_request_id(index), ids, p, resolve_seed(p),
                        mrope_positions=torch.arange(len(ids)).expand(3, -1).clone())

