"""Qwen2.5-Omni's pipeline: thinker (AR) -> talker (AR) -> code2wav (generation), built from the
pipeline YAML (built-in: config/pipelines/qwen2_5_omni.yaml).

prepare() validates and processes one prompt (ids, encoder features, 3-axis positions, voice,
seeds) and wires its routes: thinker rows -> the talker's adapter, talker codes -> code2wav."""

from __future__ import annotations

import os
from typing import Any

import torch

from omnistage.checkpoint import eos_token_ids, iter_tensors, load_generation_config
from omnistage.config.schema import PipelineConfig, StageConfig
from omnistage.engine.ar.engine import AREngine
from omnistage.engine.ar.sequence import Sequence
from omnistage.entrypoints.lm_pipeline import (build_model, generation_defaults, new_request_id,
                                               resolve_seed, stage_engine_config)
from omnistage.entrypoints.options import resolve_device, resolve_dtype
from omnistage.models.qwen2_5_omni.code2wav_graphs import VOCODER_DTYPES
from omnistage.models.qwen2_5_omni.code2wav_stage import Code2WavRequest, Qwen2_5OmniCode2WavStage
from omnistage.models.qwen2_5_omni.code2wav_stream import Qwen2_5OmniCode2WavStreamConfig
from omnistage.models.qwen2_5_omni.processor import Qwen2_5OmniInputProcessor
from omnistage.models.qwen2_5_omni.talker import (HANDOFFS, Qwen2_5OmniTalkerForCausalLM,
                                                  talker_default_params, talker_sequence,
                                                  talker_token_ids)
from omnistage.models.qwen2_5_omni.thinker import (Qwen2_5OmniThinkerForCausalLM,
                                                   thinker_sequence)
from omnistage.models.qwen2_5_omni.token2wav import Qwen2_5OmniToken2Wav
from omnistage.models.qwen2_5_omni.voices import load_voices
from omnistage.models.registry import ADAPTER_REGISTRY
from omnistage.outputs import OmniRequestOutput
from omnistage.runtime.orchestrator import RuntimeRequest
from omnistage.runtime.process import StageProcessSpec, pop_stage_worker, stage_process_spec
from omnistage.runtime.stage import ARStageWorker, StageLink
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
        """The front end (processor, voices, request preparation) in this process; each stage
        built here or, where its `worker` is "process", in a stage process of its own."""
        thinker_cfg = config.get("thinker_config")
        if not thinker_cfg:
            raise ValueError(f"model: {path}/config.json has no thinker_config")
        options = self._check_options(engine_options)
        self.talker_handoff = options["talker_handoff"]
        self.config = pipeline
        self.roles = {role: _role(pipeline, model) for role, model in (
            ("thinker", "Qwen2_5OmniThinker"), ("talker", "Qwen2_5OmniTalker"),
            ("code2wav", "Qwen2_5OmniToken2Wav"))}
        st, sk, sc = self.roles["thinker"], self.roles["talker"], self.roles["code2wav"]
        if st is None:
            raise ValueError("pipeline: a Qwen2.5-Omni pipeline needs a Qwen2_5OmniThinker stage")
        self.processor = Qwen2_5OmniInputProcessor.from_pretrained(path)
        self.tokenizer = self.processor.tokenizer
        gen_cfg = load_generation_config(path)
        text_cfg = thinker_cfg["text_config"]
        self.thinker_vocab_size = text_cfg["vocab_size"]
        self.thinker_eos = eos_token_ids(gen_cfg, config, None)
        self.thinker_max_len = stage_engine_config(
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
        # stages, in pipeline order: a worker built here, or the spec of a stage process
        self.workers: dict[str, Any] = {}
        self.process_stages: dict[str, StageProcessSpec] = {}
        self.stage_order = [s.name for s in stages]
        for stage in stages:
            dev, dt = self._placement(stage, device, dtype)
            if (options["stage_worker"] or stage.worker) == "process":
                self.process_stages[stage.name] = stage_process_spec(
                    path, config, pipeline, stage.name, dev, dt, options)
            else:
                self.workers[stage.name] = self.build_stage(path, config, pipeline, stage.name,
                                                            dev, dt, options)

    @classmethod
    def _check_options(cls, engine_options: dict[str, Any]) -> dict[str, Any]:
        opts = dict(engine_options)
        handoff = opts.pop("talker_handoff", "qwen")
        if handoff not in HANDOFFS:
            raise ValueError(f"talker_handoff: {handoff!r}; one of {HANDOFFS}")
        # code2wav_window: None = one-shot per utterance, else a streaming window config;
        # "auto" = 1-block chunks on CPU; on CUDA a 1-block first chunk, then 24-block chunks
        window = opts.pop("code2wav_window", "auto")
        if window not in (None, "auto") and \
                not isinstance(window, Qwen2_5OmniCode2WavStreamConfig):
            raise ValueError("code2wav_window: a Qwen2_5OmniCode2WavStreamConfig, None or 'auto'")
        # the DiT's compute dtype; None = $OMNISTAGE_CODE2WAV_DIT_DTYPE, else bf16 on CUDA
        # (measured on the H100 at 7B shapes: mel SNR 52.7 dB, waveform 75 dB against fp32)
        dit_dtype = opts.pop("code2wav_dit_dtype", None)
        if dit_dtype not in (None, "float32", "tf32", "bfloat16"):
            raise ValueError(f"code2wav_dit_dtype: {dit_dtype!r}; one of float32, tf32, bfloat16")
        # BigVGAN's conv dtype; None = $OMNISTAGE_CODE2WAV_VOCODER_DTYPE, else fp16 on CUDA
        # (H100, 7B shapes, batch 32: 103 vs 133 ms with TF32, waveform SNR 60.7 dB vs 64.4 dB
        # for TF32, against strict fp32; bf16: 43 dB at the same speed)
        vocoder_dtype = opts.pop("code2wav_vocoder_dtype", None)
        if vocoder_dtype is not None and vocoder_dtype not in VOCODER_DTYPES:
            raise ValueError(f"code2wav_vocoder_dtype: {vocoder_dtype!r}; one of "
                             f"{', '.join(VOCODER_DTYPES)}")
        # SMs a later-chunk DiT step leaves to the talker beside it (a CUDA green context);
        # None = $OMNISTAGE_CODE2WAV_FREE_SMS, else "auto" on CUDA (H100: 32 of 132). NOTE: H100,
        # 7B shapes: c32 73.0-74.6 audio-s/s (70.7-71.3 without), c64 81.1-84.0 (80.8-81.2),
        # the talker's busy time at c64 7.4 s (9.6-10.1 s: it no longer stalls behind the DiT's
        # GEMMs); the second graph per shape of batch >= 8 adds ~15 s of capture at load
        free_sms = opts.pop("code2wav_free_sms", None)
        if free_sms is not None and free_sms != "auto" and (
                not isinstance(free_sms, int) or isinstance(free_sms, bool) or free_sms < 0):
            raise ValueError(f"code2wav_free_sms: {free_sms!r}; an int >= 0 or 'auto'")
        warmup = opts.pop("code2wav_warmup", None)  # None = capture code2wav's graphs on CUDA
        if warmup not in (None, True, False):
            raise ValueError(f"code2wav_warmup: {warmup!r}; true or false")
        worker = pop_stage_worker(opts)
        return {"talker_handoff": handoff, "code2wav_window": window, "stage_worker": worker,
                "code2wav_dit_dtype": dit_dtype, "code2wav_vocoder_dtype": vocoder_dtype,
                "code2wav_free_sms": free_sms, "code2wav_warmup": warmup, "engine": opts}

    @classmethod
    def build_stage(cls, path, config: dict, pipeline: PipelineConfig, name: str,
                    device: torch.device, dtype: torch.dtype, options: dict[str, Any]):
        """One stage's model and worker (in this process; a stage process calls it too)."""
        stage = pipeline.stage(name)
        if stage.model == "Qwen2_5OmniToken2Wav":
            with torch.device(device):
                token2wav = Qwen2_5OmniToken2Wav(config["token2wav_config"])
            token2wav.load_state_dict(dict(iter_tensors(path, _prefix(stage, "token2wav."))),
                                      strict=True)
            token2wav.to(dtype if stage.dtype != "auto" else torch.float32).eval()
            cuda = device.type == "cuda"
            window = options["code2wav_window"]
            if window == "auto":
                # NOTE: H100 at 7B shapes, 24- vs 12-block chunks after the first (1 block):
                # the DiT runs 27 blocks per 24 new ones instead of 15 per 12 (10% less work);
                # overlap would not hide it: beside a DiT graph the talker's kernels barely run
                # (code2wav_gpu.py --sections overlap). c32 69.0 vs 62.0 audio-s/s in one A/B
                # (65.3-69.2 over four runs at 24), c64 74-77 vs 66, c1 RTF 0.119 vs 0.124, TTFA
                # about the same when requests arrive together; a request arriving while a
                # batch-32 step runs waits for it (~1.8 s vs ~1.0 s: c32 arriving over 6 s,
                # TTFA p50 0.67 s, max 1.73 s). 12 vs 6 blocks: c32 50.0 vs 45.6
                window = Qwen2_5OmniCode2WavStreamConfig(
                    chunk_blocks=24, first_chunk_blocks=1) if cuda \
                    else Qwen2_5OmniCode2WavStreamConfig()
            dit_dtype = options["code2wav_dit_dtype"]
            if dit_dtype is None and cuda and not os.environ.get("OMNISTAGE_CODE2WAV_DIT_DTYPE"):
                dit_dtype = "bfloat16"
            vocoder_dtype = options["code2wav_vocoder_dtype"]
            if vocoder_dtype is None and cuda \
                    and not os.environ.get("OMNISTAGE_CODE2WAV_VOCODER_DTYPE"):
                vocoder_dtype = "float16"
            free_sms = options["code2wav_free_sms"]
            if free_sms is None and cuda and not os.environ.get("OMNISTAGE_CODE2WAV_FREE_SMS"):
                free_sms = "auto"
            warmup = options["code2wav_warmup"]
            return Qwen2_5OmniCode2WavStage(name, token2wav, device, window, dit_dtype=dit_dtype,
                                            vocoder_dtype=vocoder_dtype, free_sms=free_sms,
                                            warmup=cuda if warmup is None else warmup)
        engine_opts = dict(options["engine"])
        sized = {"num_kv_blocks", "kv_cache_memory_fraction"}
        if device.type == "cuda" \
                and not sized & {k for k, v in engine_opts.items() if v is not None} \
                and not sized & {k for k, v in stage.engine.model_dump().items() if v is not None}:
            # NOTE: stages share one GPU: the thinker (built first) takes 45% of the free memory
            # for KV, the talker half of what is left, and the rest stays for code2wav and graphs
            engine_opts["kv_cache_memory_fraction"] = (
                0.45 if stage.model == "Qwen2_5OmniThinker" else 0.5)
        if stage.model == "Qwen2_5OmniThinker":
            model_cfg, cls_, prefix = config["thinker_config"], Qwen2_5OmniThinkerForCausalLM, \
                "thinker."
            tokenizer = Qwen2_5OmniInputProcessor.from_pretrained(path).tokenizer
            gen_cfg = load_generation_config(path)
            eos = eos_token_ids(gen_cfg, config, None)
            max_len = model_cfg["text_config"].get("max_position_embeddings", 32768)
            params, rows_width = generation_defaults(gen_cfg), None
        else:
            model_cfg, cls_, prefix = config["talker_config"], Qwen2_5OmniTalkerForCausalLM, \
                "talker."
            tokenizer, eos = None, set()
            max_len = model_cfg.get("max_position_embeddings", 32768)
            params = talker_default_params(talker_token_ids(model_cfg)[0])
            rows_width = model_cfg["embedding_size"]  # decode steps add the thinker's rows
        model = build_model(cls_, model_cfg, iter_tensors(path, _prefix(stage, prefix)), device,
                            dtype)
        cfg = stage_engine_config(max_len, engine_opts, stage.engine)
        engine = AREngine(model, cfg, device, dtype, tokenizer, eos)
        engine.runner.warmup_graphs([stage.default_sampling.apply(params)], rows_width)
        # the thinker's stream ahead of the talker's: the talker's steps wait for its rows
        return ARStageWorker(name, engine, priority=-2 if rows_width is None else -1)

    @staticmethod
    def _placement(stage: StageConfig, device, dtype) -> tuple[torch.device, torch.dtype]:
        dev = resolve_device(stage.device) if stage.device else device
        return dev, (dtype if stage.dtype == "auto" else resolve_dtype(stage.dtype, dev))

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
    def code2wav(self) -> Qwen2_5OmniCode2WavStage:
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
        max_prompt = self.thinker_max_len - 1
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

