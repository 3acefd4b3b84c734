"""What OmniLLM and AsyncOmniLLM share: checkpoint -> pipeline YAML -> stages -> runtime."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch

from omnistage.checkpoint import load_config, resolve_model_path
from omnistage.config.schema import load_pipeline
from omnistage.prompts import check_prompt_shape, per_stage_params
from omnistage.models.registry import check_registered, resolve_pipeline
from omnistage.layers.compile import persist_compile_caches
from omnistage.runtime import startup
from omnistage.runtime.build import resolve_device, resolve_dtype
from omnistage.runtime.orchestrator import Orchestrator, RuntimeRequest
from omnistage.runtime.pipeline import Pipeline
from omnistage.runtime.ray_placement import placement_options

MAX_PROMPTS_PER_CALL = 100_000
# warmup(): its prompt and lengths (tokens of the first stage, of the stages after it: enough
# for code2wav's first and a later chunk)
WARMUP_PROMPT = "Hello."
WARMUP_TOKENS, WARMUP_LATER_TOKENS = 8, 64
WARMUP_TIMEOUT_S = 600.0
WARMUP_PLANS = ("full", "lazy")
log = logging.getLogger("omnistage")


class OmniBase:
    background_runtime = True  # the runtime loop in its own thread (False: the caller drives it)
    def __init__(self, model: str, pipeline: str | None = None, device: str | None = None,
                 dtype: str | torch.dtype = "auto", request_timeout: float | None = None,
                 overlap: bool | None = None, **engine_options: Any) -> None:
        """engine_options: AR engine options (EngineOptions' fields) for every AR stage, and the
        pipeline's own options (e.g. Qwen2.5-Omni's code2wav_*); overlap: the pipeline YAML's
        `overlap` (None: the YAML's, else on when a stage runs on a GPU); warmup_plan: "full"
        (every CUDA graph at load, the default) or "lazy" (what a first request and a burst at
        the largest batch need at load, the rest in a background runtime's idle passes)."""
        with startup.recording() as self.startup_seconds:
            self._build(model, pipeline, device, dtype, request_timeout, overlap, engine_options)
        log.info("start-up (%s): %s", model, startup.describe(self.startup_seconds))

    def _build(self, model: str, pipeline: str | None, device: str | None,
               dtype: str | torch.dtype, request_timeout: float | None, overlap: bool | None,
               engine_options: dict[str, Any]) -> None:
        self.path = resolve_model_path(model)
        config = load_config(self.path)
        with startup.phase("imports"):  # the model families' modules (transformers' processors)
            pipeline_cls = resolve_pipeline(config)
        self.pipeline_config = load_pipeline(pipeline or pipeline_cls.builtin)
        check_registered(self.pipeline_config)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        if self.device.type == "cuda":  # before any compile: caches that outlive the process
            persist_compile_caches()
        if request_timeout is not None and not (isinstance(request_timeout, (int, float))
                                                and request_timeout > 0):
            raise ValueError(f"request_timeout: must be > 0 seconds, got {request_timeout!r}")
        self.request_timeout = request_timeout
        if overlap is not None and not isinstance(overlap, bool):
            raise ValueError(f"overlap: true, false or None, got {overlap!r}")
        # ray_address: stages placed as Ray actors (runtime/ray_placement.py)
        engine_options = placement_options(self.pipeline_config, engine_options, pipeline_cls)
        self._set_warmup_plan(engine_options, pipeline_cls)
        self.pipeline: Pipeline = pipeline_cls(self.path, config, self.pipeline_config, self.device,
                                     self.dtype, dict(engine_options))
        with startup.phase("runtime"):  # (stage processes build their stages in here)
            self.runtime = Orchestrator(
                self.pipeline.workers, background=self.background_runtime,
                process_stages=self.pipeline.process_stages,
                order=self.pipeline.stage_names,
                overlap=self.pipeline_config.overlap if overlap is None else overlap)

    @staticmethod
    def _set_warmup_plan(engine_options: dict[str, Any], pipeline_cls: type) -> None:
        """`warmup_plan` ("full", "lazy"; None: each stage's own, full) -> the pipeline's
        per-stage plan options (`warmup_plan_options`) not given.

        NOTE (why not lazy by default): a lazy start holds a c32 burst (the largest bucket is
        captured at load) but c8 right after it ran at 21.8 against 45.6 audio-s/s on the H200
        (its DiT steps padded to 32 rows), and the other graphs come only in idle passes, which
        a steady load never leaves (benchmarks/results/
        qwen2_5_omni_pipeline_gpu_h200_lazy_top_bucket_session23_issue24_2026-11-29.json)."""
        plan = engine_options.pop("warmup_plan", None)
        if plan is not None and plan not in WARMUP_PLANS:
            raise ValueError(f"warmup_plan: 'full' or 'lazy', got {plan!r}")
        for key in getattr(pipeline_cls, "warmup_plan_options", ()) if plan else ():
            if engine_options.get(key) is None:
                engine_options[key] = plan

    # -------------------------------------------------------------- conveniences
    @property
    def engine(self):
        """The first AR stage's engine."""
        return next(iter(self.pipeline.engines.values()))

    @property
    def tokenizer(self):
        return self.pipeline.tokenizer

    @property
    def stage_names(self) -> list[str]:
        return self.pipeline.stage_names

    # -------------------------------------------------------------- requests
    def _modalities(self, output_modalities: list[str] | None) -> list[str]:
        available = self.pipeline.output_modalities
        if output_modalities is None:
            return list(available)
        if not isinstance(output_modalities, list) or not output_modalities or \
                ("text" in available and "text" not in output_modalities) or \
                any(m not in available for m in output_modalities):
            raise ValueError(f"output_modalities: {output_modalities!r}; this model gives "
                             f"{available} (text always included where it is one)")
        return list(output_modalities)

    def _prepare(self, prompts: list, sampling_params: Any,
                 output_modalities: list[str] | None) -> list[RuntimeRequest]:
        """Validate every prompt and parameter (ValueError naming the prompt and field)."""
        if len(prompts) > MAX_PROMPTS_PER_CALL:
            raise ValueError(f"prompts: at most {MAX_PROMPTS_PER_CALL} per call")
        modalities = self._modalities(output_modalities)
        params = per_stage_params(sampling_params, len(prompts), self.stage_names,
                                  self.pipeline.default_params)
        reqs = []
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            where = f"prompts[{i}]"
            check_prompt_shape(prompt, where)
            req = self.pipeline.prepare(prompt, sp, modalities, where, i)
            if self.request_timeout is not None:
                req.deadline = time.monotonic() + self.request_timeout
            reqs.append(req)
        return reqs

    def _warmup_request(self) -> RuntimeRequest | None:
        """A short request through every stage (see warmup()); None when the pipeline has no
        token stages to warm (image pipelines warm up while they are built)."""
        if not self.pipeline.default_params:
            return None
        first = self.stage_names[0]
        params = {name: dataclasses.replace(
            p, max_tokens=n, min_tokens=n, ignore_eos=True, seed=0, stop=[], stop_token_ids=[])
            for name, p in self.pipeline.default_params.items()
            for n in [WARMUP_TOKENS if name == first else WARMUP_LATER_TOKENS]}
        # a chat turn for the models that speak (Qwen3-Omni's talker needs one); plain text
        # for the rest (a plain LM may have no chat template)
        prompt = {"messages": [{"role": "user", "content": WARMUP_PROMPT}]} \
            if self.pipeline.voices else WARMUP_PROMPT
        req = self._prepare([prompt], params, None)[0]
        req.deadline = None
        return req

    def warmup(self) -> float | None:
        """Run one short request through every stage (text and audio) and wait for it, so that
        the first user request finds every kernel compiled and tuned for the shapes a request
        brings (as the server does before it answers /health). Returns its seconds (also
        startup_seconds["warmup"]), None when there is nothing to warm."""
        req = self._warmup_request()
        if req is None:
            return None
        done: list = []
        t0 = time.perf_counter()
        self.runtime.submit(req, lambda out: done.append(out) if out.finished else None,
                            stream=False)
        if self.background_runtime:
            deadline = time.monotonic() + WARMUP_TIMEOUT_S
            while not done and time.monotonic() < deadline and self.runtime.alive:
                time.sleep(0.01)
        else:
            self.runtime.run_until(lambda: bool(done))
        if not done or done[0].error:
            raise RuntimeError(f"warm-up request failed: "
                               f"{done[0].error if done else 'no answer in time'}")
        seconds = self.startup_seconds["warmup"] = time.perf_counter() - t0
        log.info("warm-up request: %.2f s (%s)", seconds, done[0].metrics.tokens_per_stage)
        return seconds

    def shutdown(self) -> None:
        """Stop the runtime; requests still running end with an error."""
        self.runtime.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        runtime = getattr(self, "runtime", None)
        if runtime is not None and runtime.alive:
            runtime.shutdown(timeout=1.0)
