"""Qwen2.5-Omni as a pipeline of stages: thinker (AR) -> talker (AR) -> code2wav (generation).

Requests are validated and processed up front (prompt -> ids + encoder features + 3-axis
positions). One loop steps both AR engines: the thinker's hidden rows go to each request's
adapter as they are produced, the talker request is gated row by row on them, and finished
talker requests are decoded to audio together (several utterances per code2wav batch)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from omnistage.checkpoint import eos_token_ids, iter_tensors, load_generation_config
from omnistage.engine.ar.engine import AREngine, SequenceUpdate
from omnistage.engine.ar.sequence import Sequence
from omnistage.entrypoints.lm_pipeline import (build_model, generation_defaults, new_request_id,
                                               resolve_seed, stage_result)
from omnistage.entrypoints.options import engine_config
from omnistage.models.qwen2_5_omni.processor import Qwen2_5OmniInputProcessor
from omnistage.models.qwen2_5_omni.talker import (HANDOFFS, Qwen2_5OmniTalkerForCausalLM,
                                                  Qwen2_5OmniThinkerToTalker, talker_sequence)
from omnistage.models.qwen2_5_omni.thinker import (Qwen2_5OmniThinkerForCausalLM,
                                                   thinker_sequence)
from omnistage.models.qwen2_5_omni.token2wav import Qwen2_5OmniToken2Wav
from omnistage.models.qwen2_5_omni.voices import load_voices
from omnistage.outputs import OmniRequestOutput, StageOutput
from omnistage.sampling_params import SamplingParams

SAMPLE_RATE = 24000
DEFAULT_VOICE = "Chelsie"


@dataclass
class OmniRequest:
    """One request's state across the three stages."""

    thinker: Sequence
    modalities: list[str]
    voice: str
    seed: int
    talker_params: SamplingParams | None = None
    talker_seed: int = 0
    code2wav_seed: int = 0
    adapter: Qwen2_5OmniThinkerToTalker | None = None
    talker: Sequence | None = None
    audio: np.ndarray | None = None
    error: str | None = None
    t_first_token: float | None = None
    t_first_audio: float | None = None
    t_done: float | None = None
    codes: list[int] = field(default_factory=list)

    @property
    def wants_audio(self) -> bool:
        return "audio" in self.modalities


class Qwen2_5OmniPipeline:
    stage_names = ["thinker", "talker", "code2wav"]

    def __init__(self, path, config: dict, device: torch.device, dtype: torch.dtype,
                 engine_options: dict[str, Any]) -> None:
        thinker_cfg = config.get("thinker_config")
        if not thinker_cfg:
            raise ValueError(f"model: {path}/config.json has no thinker_config")
        self.talker_handoff = engine_options.pop("talker_handoff", "qwen")
        if self.talker_handoff not in HANDOFFS:
            raise ValueError(f"talker_handoff: {self.talker_handoff!r}; one of {HANDOFFS}")
        self.device = device
        self.code2wav_batch_sizes: list[int] = []  # metric: utterances per code2wav batch
        self.processor = Qwen2_5OmniInputProcessor.from_pretrained(path)
        self.tokenizer = self.processor.tokenizer
        self.thinker = build_model(Qwen2_5OmniThinkerForCausalLM, thinker_cfg,
                                   iter_tensors(path, "thinker."), device, dtype)
        gen_cfg = load_generation_config(path)
        text_cfg = thinker_cfg["text_config"]
        self.engines = {"thinker": AREngine(
            self.thinker, engine_config(text_cfg.get("max_position_embeddings", 32768),
                                        **engine_options),
            device, dtype, self.tokenizer, eos_token_ids(gen_cfg, config, None))}
        self.default_params = {"thinker": generation_defaults(gen_cfg)}
        self.voices = load_voices(path) if config.get("talker_config") else {}
        self.output_modalities = ["text", "audio"] if self.voices else ["text"]
        if not self.voices:
            return
        talker_cfg = config["talker_config"]
        self.talker = build_model(Qwen2_5OmniTalkerForCausalLM, talker_cfg,
                                  iter_tensors(path, "talker."), device, dtype)
        self.engines["talker"] = AREngine(
            self.talker, engine_config(talker_cfg.get("max_position_embeddings", 32768),
                                       **engine_options), device, dtype)
        self.default_params["talker"] = self.talker.default_params()
        self.default_params["code2wav"] = SamplingParams()
        with torch.device(device):
            self.token2wav = Qwen2_5OmniToken2Wav(config["token2wav_config"])
        self.token2wav.load_state_dict(dict(iter_tensors(path, "token2wav.")), strict=True)
        self.token2wav.float().eval()  # fp32 by design, as transformers runs it

    # ---------------------------------------------------------------- requests
    def prepare(self, prompt: Any, params: dict[str, SamplingParams], modalities: list[str],
                where: str, index: int) -> OmniRequest:
        p = params["thinker"]
        p.validate(where.replace("prompts", "sampling_params") + "[thinker]",
                   self.thinker.vocab_size)
        seq = self._thinker_seq(prompt, p, modalities, where, index)
        voice = DEFAULT_VOICE
        if isinstance(prompt, dict) and prompt.get("voice") is not None:
            voice = prompt["voice"]
        req = OmniRequest(seq, modalities, voice, seq.seed)
        if not req.wants_audio:
            return req
        if voice not in self.voices:
            raise ValueError(f"{where}.voice: {voice!r} is not available; voices: "
                             f"{sorted(self.voices)}")
        tp = params["talker"]
        tp.validate(where.replace("prompts", "sampling_params") + "[talker]",
                    self.talker.vocab_size)
        tseed = tp.seed if tp.seed is not None else req.seed + 1
        cseed = params["code2wav"].seed
        req.code2wav_seed = cseed if cseed is not None else req.seed + 2
        req.talker_params, req.talker_seed, req.thinker.export_hidden = tp, tseed, True
        return req

    def _thinker_seq(self, prompt, p: SamplingParams, modalities, where, index) -> Sequence:
        max_prompt = self.engines["thinker"].config.max_model_len - 1
        if isinstance(prompt, dict) and prompt.get("use_audio_in_video"):
            raise ValueError(f"{where}.use_audio_in_video: video input is not supported yet")
        try:
            if isinstance(prompt, str):
                processed = self.processor.process_prompt(prompt, max_prompt_tokens=max_prompt)
            elif "messages" in prompt:
                processed = self.processor.process(prompt["messages"],
                                                   add_audio_system_prompt="audio" in modalities,
                                                   max_prompt_tokens=max_prompt)
            elif "prompt" in prompt:
                processed = self.processor.process_prompt(
                    prompt["prompt"], prompt.get("multi_modal_data"), max_prompt_tokens=max_prompt)
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

    # ---------------------------------------------------------------- run
    def run(self, reqs: list[OmniRequest], use_tqdm: bool) -> list[OmniRequestOutput]:
        start = time.perf_counter()
        thinker_engine = self.engines["thinker"]
        by_thinker = {r.thinker.request_id: r for r in reqs}
        by_talker: dict[str, OmniRequest] = {}
        for r in reqs:
            thinker_engine.add_request(r.thinker)
            if r.wants_audio:
                r.adapter = Qwen2_5OmniThinkerToTalker(
                    self.thinker, self.talker, r.thinker, int(self.voices[r.voice]["bos_token"]),
                    self.talker_handoff)
                r.talker = talker_sequence(r.thinker.request_id + "-talker", r.thinker,
                                           r.adapter, self.talker, r.talker_params, r.talker_seed)
                self.engines["talker"].add_request(r.talker)
                by_talker[r.talker.request_id] = r
        bar = tqdm(total=len(reqs), desc="generate", disable=not use_tqdm)
        while any(e.has_unfinished() for e in self.engines.values()):
            now = time.perf_counter() - start
            for u in thinker_engine.step():
                self._on_thinker(by_thinker[u.request_id], u, now, bar)
            if "talker" not in self.engines:
                continue
            done = [by_talker[u.request_id] for u in self.engines["talker"].step()
                    if u.finished]
            if done:
                self._code2wav(done, time.perf_counter() - start)
                bar.update(len(done))
        bar.close()
        return [self._output(r, time.perf_counter() - start) for r in reqs]

    def _on_thinker(self, r: OmniRequest, u: SequenceUpdate, now: float, bar) -> None:
        if u.new_token_ids and r.t_first_token is None:
            r.t_first_token = now
        if r.adapter is not None and u.hidden is not None:
            r.adapter.add_thinker_rows(*u.hidden)
        if not u.finished:
            return
        r.t_done = now
        if r.adapter is not None:
            r.adapter.finish_thinker()
        if u.error and r.talker is not None:  # the talker cannot go on without its rows
            self.engines["talker"].abort(r.talker.request_id)
            r.error = u.error
        if not r.wants_audio or u.error:
            bar.update(1)

    def _code2wav(self, done: list[OmniRequest], now: float) -> None:
        stops = set(self.talker.default_params().stop_token_ids)
        batch = []
        for r in done:
            codes = r.talker.output_token_ids
            if codes and codes[-1] in stops and r.talker.finish_reason == "stop":
                codes = codes[:-1]
            r.codes = list(codes)
            if r.codes:
                batch.append(r)
        if not batch:
            return
        voices = [self.voices[r.voice] for r in batch]
        dev = self.device
        codes = [torch.tensor(r.codes, dtype=torch.long, device=dev) for r in batch]
        noises = [Qwen2_5OmniToken2Wav.initial_noise(r.code2wav_seed, 2 * len(r.codes)).to(dev)
                  for r in batch]
        _, wavs = self.token2wav.generate(
            codes, [v["cond"].to(dev).float() for v in voices],
            [v["ref_mel"].to(dev).float() for v in voices], noises)
        for r, w in zip(batch, wavs):
            r.audio = w.float().cpu().numpy()
            r.t_first_audio = r.t_done = now
        self.code2wav_batch_sizes.append(len(batch))

    def _output(self, r: OmniRequest, e2e: float) -> OmniRequestOutput:
        s = r.thinker
        out = OmniRequestOutput(s.request_id, text=s.output_text,
                                token_ids=list(s.output_token_ids), finished=True,
                                error=r.error or s.error, prompt_token_ids=s.prompt_token_ids)
        out.stages["thinker"] = stage_result(s, "thinker")
        m = out.metrics
        m.ttft, m.e2e, m.seed = r.t_first_token, r.t_done or e2e, r.seed
        m.num_cached_tokens = s.num_cached_tokens
        m.tokens_per_stage = {"thinker": len(s.output_token_ids)}
        if r.talker is not None:
            out.stages["talker"] = StageOutput("talker", r.codes, "", r.talker.finish_reason)
            m.tokens_per_stage["talker"] = len(r.codes)
            audio = r.audio if r.audio is not None else np.zeros(0, dtype=np.float32)
            out.stages["code2wav"] = StageOutput("code2wav", audio=audio, finish_reason="stop")
            out.audio, out.sample_rate, m.ttfa = audio, SAMPLE_RATE, r.t_first_audio
        return out
