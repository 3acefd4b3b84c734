"""Qwen2.5-Omni as a pipeline of stages: thinker (AR) -> talker (AR) -> code2wav (generation).

This issue's scope: the thinker stage (text out). Requests are validated and processed up
front (prompt -> ids + encoder features + 3-axis positions); the thinker runs them with
continuous batching and runs the encoders batched over each step's new prompts."""

from __future__ import annotations

import time
from typing import Any

import torch

from omnistage.checkpoint import eos_token_ids, iter_tensors, load_generation_config
from omnistage.engine.ar.engine import AREngine
from omnistage.engine.ar.sequence import Sequence
from omnistage.entrypoints.lm_pipeline import (build_model, drive, generation_defaults,
                                               new_request_id, resolve_seed, stage_result)
from omnistage.entrypoints.options import engine_config
from omnistage.models.qwen2_5_omni.processor import Qwen2_5OmniInputProcessor
from omnistage.models.qwen2_5_omni.thinker import (Qwen2_5OmniThinkerForCausalLM,
                                                   thinker_sequence)
from omnistage.outputs import OmniRequestOutput
from omnistage.sampling_params import SamplingParams


class Qwen2_5OmniPipeline:
    stage_names = ["thinker"]
    output_modalities = ["text"]

    def __init__(self, path, config: dict, device: torch.device, dtype: torch.dtype,
                 engine_options: dict[str, Any]) -> None:
        thinker_cfg = config.get("thinker_config")
        if not thinker_cfg:
            raise ValueError(f"model: {path}/config.json has no thinker_config")
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

    # ---------------------------------------------------------------- requests
    def prepare(self, prompt: Any, params: dict[str, SamplingParams], modalities: list[str],
                where: str, index: int) -> Sequence:
        engine = self.engines["thinker"]
        p = params["thinker"]
        p.validate(where.replace("prompts", "sampling_params"), self.thinker.vocab_size)
        max_prompt = engine.config.max_model_len - 1
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
        if processed is None:  # raw token ids: text only
            ids = list(prompt["prompt_token_ids"])
            bad = [t for t in ids if not 0 <= t < self.thinker.vocab_size]
            if bad:
                raise ValueError(f"{where}.prompt_token_ids: ids {bad[:4]} outside the vocabulary")
            if len(ids) > max_prompt:
                raise ValueError(f"{where}: {len(ids)} tokens; max_model_len is {max_prompt + 1}")
            return Sequence(new_request_id(index), ids, p, resolve_seed(p),
                            mrope_positions=torch.arange(len(ids)).expand(3, -1).clone())
        if prompt.get("use_audio_in_video") if not isinstance(prompt, str) else False:
            raise ValueError(f"{where}.use_audio_in_video: video input is not supported yet")
        return thinker_sequence(new_request_id(index), processed, p, resolve_seed(p))

    def run(self, seqs: list[Sequence], use_tqdm: bool) -> list[OmniRequestOutput]:
        start = time.perf_counter()
        first = drive(self.engines["thinker"], seqs, use_tqdm)
        e2e = time.perf_counter() - start
        outs = []
        for s in seqs:
            out = OmniRequestOutput(s.request_id, text=s.output_text,
                                    token_ids=list(s.output_token_ids), finished=True,
                                    error=s.error, prompt_token_ids=s.prompt_token_ids)
            out.stages["thinker"] = stage_result(s, "thinker")
            m = out.metrics
            m.ttft, m.e2e, m.seed = first.get(s.request_id), e2e, s.seed
            m.num_cached_tokens = s.num_cached_tokens
            m.tokens_per_stage = {"thinker": len(s.output_token_ids)}
            outs.append(out)
        return outs
