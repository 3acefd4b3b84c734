"""What every pipeline uses to build its stages: device and dtype placement, a model built on
its device, an AR stage's engine config, default sampling, request ids and seeds."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from omnistage.config.schema import EngineOptions, PipelineConfig, StageConfig
from omnistage.engine.ar.engine import AREngine
from omnistage.engine.ar.scheduler import EngineConfig, engine_config
from omnistage.runtime.process import StageProcessSpec, stage_process_spec
from omnistage.runtime import startup
from omnistage.sampling_params import SamplingParams

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def resolve_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device: {device!r} is not a device ({e})") from e
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device: {device!r}; expected 'cpu' or 'cuda[:N]'")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device: 'cuda' requested but no CUDA GPU is available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device: {device!r}; only {torch.cuda.device_count()} GPU(s)")
    return dev


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r}; expected 'auto' or one of {sorted(DTYPES)}")
    return DTYPES[dtype]


LOAD_FORMATS = ("safetensors", "dummy")
QUANTIZATIONS = (None, "fp8")


def pop_load_options(opts: dict[str, Any]) -> dict[str, Any]:
    """Constructor keywords (vLLM's names): load_format "safetensors" | "dummy" (random
    weights, seeded: benchmarks at real shapes without a checkpoint), quantization None |
    "fp8" (MoE experts stored as float8 e4m3 with per-channel scales)."""
    load_format = opts.pop("load_format", "safetensors")
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format: {load_format!r}; one of {LOAD_FORMATS}")
    quantization = opts.pop("quantization", None)
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization: {quantization!r}; one of {QUANTIZATIONS}")
    return {"load_format": load_format, "quantization": quantization}


def build_stage_model(cls: type, config: dict, ctx: StageContext, prefix: str):
    """A stage's model on its device and dtype, its weights as ctx.options' load_format says
    (the stage's tensors under `prefix`, or seeded random ones)."""
    from omnistage.checkpoint import dummy_tensors, iter_tensors
    dummy = ctx.options.get("load_format") == "dummy"
    tensors = dummy_tensors if dummy else iter_tensors(ctx.path, ctx.prefix(prefix))
    with startup.phase("weights"):
        return build_model(cls, config, tensors, ctx.device, ctx.dtype)


def build_model(cls: type, config: dict, tensors, device: torch.device, dtype: torch.dtype):
    """Instantiate directly on `device` in `dtype` (no fp32 copy of a 7B model), load weights
    (named tensors, or a function of the model giving them: checkpoint.dummy_tensors)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(config)
    finally:
        torch.set_default_dtype(default)
    model.load_weights(tensors(model) if callable(tensors) else tensors)
    return model.to(dtype).eval()


def build_ar_engine(ctx: StageContext, model: torch.nn.Module, cfg: EngineConfig, tokenizer: Any,
                    eos_token_ids: set[int], warm_params: SamplingParams,
                    row_width: int | None = None) -> AREngine:
    """An AR stage's engine on `model` (built and loaded), its decode graphs captured with
    `warm_params` (and `row_width`-wide additive rows); timed as the stage's `engine` (KV cache,
    compiled layers) and `graphs` start-up phases."""
    with startup.phase("engine"):
        engine = AREngine(model, cfg, ctx.device, ctx.dtype, tokenizer, eos_token_ids)
    with startup.phase("graphs"):
        engine.runner.warmup_graphs([warm_params], row_width)
    return engine


def stage_engine_config(model_max_len: int, options: dict[str, Any],
                        stage: EngineOptions) -> EngineConfig:
    """Constructor engine options, overridden by the stage's YAML `engine:` keys."""
    merged = dict(options)
    merged.update({k: v for k, v in stage.model_dump().items() if v is not None})
    try:
        return engine_config(model_max_len, **merged)
    except TypeError as e:
        raise ValueError(f"engine options: {e}") from e


def generation_defaults(gen_cfg: dict) -> SamplingParams:
    """The checkpoint's generation_config.json as default sampling (greedy when do_sample off)."""
    if not gen_cfg.get("do_sample", False):
        return SamplingParams(temperature=0.0, max_tokens=None,
                              repetition_penalty=gen_cfg.get("repetition_penalty", 1.0))
    return SamplingParams(temperature=gen_cfg.get("temperature", 1.0),
                          top_p=gen_cfg.get("top_p", 1.0), top_k=gen_cfg.get("top_k", 0) or 0,
                          repetition_penalty=gen_cfg.get("repetition_penalty", 1.0),
                          max_tokens=None)


def new_request_id(i: int) -> str:
    return f"{uuid.uuid4().hex[:12]}-{i}"


def resolve_seed(p: SamplingParams) -> int:
    return p.seed if p.seed is not None else AREngine.new_seed()


@dataclass(frozen=True)
class StageContext:
    """What a registered stage builder gets (models.registry.register_stage)."""

    path: Path  # the checkpoint directory
    config: dict  # its config.json
    pipeline: PipelineConfig
    stage: StageConfig  # this stage's YAML entry
    device: torch.device
    dtype: torch.dtype
    options: dict[str, Any]  # the pipeline's checked constructor options

    @property
    def name(self) -> str:
        return self.stage.name

    def prefix(self, default: str) -> str:
        """The stage's tensors in the checkpoint (the YAML's checkpoint_prefix, else default)."""
        return default if self.stage.checkpoint_prefix is None else self.stage.checkpoint_prefix


def build_stage_worker(path, config: dict, pipeline: PipelineConfig, name: str,
                       device: torch.device, dtype: torch.dtype, options: dict[str, Any]):
    """A stage's worker from its YAML `model` through the registry (here or in a stage
    process): no pipeline names its stages' classes."""
    from omnistage.models.registry import STAGE_BUILDERS, import_all_models
    import_all_models()
    stage = pipeline.stage(name)
    ctx = StageContext(Path(path), config, pipeline, stage, device, dtype, options)
    return STAGE_BUILDERS[stage.model].build(ctx)


def build_stages(path, config: dict, pipeline: PipelineConfig, stages: list[StageConfig],
                 device: torch.device, dtype: torch.dtype, options: dict[str, Any]
                 ) -> tuple[dict[str, Any], dict[str, StageProcessSpec]]:
    """The stages, in pipeline order, each placed on its YAML device/dtype (else the
    constructor's): a worker built here, or the spec of a stage process of its own
    (options["stage_worker"] for every stage, else the stage's `worker`)."""
    workers: dict[str, Any] = {}
    process_stages: dict[str, StageProcessSpec] = {}
    for stage in stages:
        dev = resolve_device(stage.device) if stage.device else device
        dt = dtype if stage.dtype == "auto" else resolve_dtype(stage.dtype, dev)
        if (options["stage_worker"] or stage.worker) == "process":
            process_stages[stage.name] = stage_process_spec(path, config, pipeline, stage.name,
                                                            dev, dt, options)
        else:
            with startup.phase(stage.name):
                workers[stage.name] = build_stage_worker(path, config, pipeline, stage.name, dev,
                                                         dt, options)
    return workers, process_stages
