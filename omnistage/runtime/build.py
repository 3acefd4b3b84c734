"""What every pipeline uses to build its stages: device and dtype placement, a model built on
its device, an AR stage's engine config, default sampling, request ids and seeds."""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from omnistage.config.schema import (MAX_STAGE_DEVICES, EngineOptions, PipelineConfig,
                                     StageConfig)
from omnistage.engine.ar.engine import AREngine
from omnistage.engine.ar.scheduler import EngineConfig, engine_config
from omnistage.engine.ar.tp_workers import start_workers
from omnistage.engine.kernels_ahead import WAIT_SECONDS, KernelsAhead, cuda_target
from omnistage.layers.parallel import current_tp, tensor_parallel
from omnistage.layers.symm_all_reduce import check_mode
from omnistage.runtime.process import StageProcessSpec, stage_process_spec
from omnistage.runtime.stage import on_device
from omnistage.runtime import startup
from omnistage.sampling_params import SamplingParams

log = logging.getLogger(__name__)

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
    compiled layers) and `graphs` start-up phases. With the stage's tensor_parallel_size > 1,
    `model` is this rank's shard (built by build_ranks inside its group); the config records
    the ranks and their devices."""
    tp = getattr(ctx, "tensor_parallel_size", 1)
    if tp != cfg.tensor_parallel_size or tp > 1:  # the stage's placement decides its ranks
        devices = tuple(str(d) for d in ctx.devices) if tp > 1 else None
        cfg = dataclasses.replace(cfg, tensor_parallel_size=tp, devices=devices)
    with startup.phase("engine"):
        engine = AREngine(model, cfg, ctx.device, ctx.dtype, tokenizer, eos_token_ids)
    if ctx.kernels_ready is not None:
        with startup.phase("kernels_ahead"):
            ctx.kernels_ready()
    with startup.phase("graphs"):
        engine.runner.warmup_graphs([warm_params], row_width)
    return engine


def stage_engine_config(model_max_len: int, options: dict[str, Any],
                        stage: EngineOptions) -> EngineConfig:
    """Constructor engine options, overridden by the stage's YAML `engine:` keys."""
    merged = dict(options)
    merged.update({k: v for k, v in stage.model_dump().items() if v is not None})
    # the TP group's all-reduce: not the engine's (build_ranks gives it to the group)
    if (mode := merged.pop("tp_all_reduce", None)) is not None:
        check_mode(mode)
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
    # this replica's devices, its tensor-parallel ranks in order (device = devices[0]); a
    # builder that shards its model (TP > 1) places rank i on devices[i]
    devices: tuple[torch.device, ...] = ()
    tensor_parallel_size: int = 1  # the stage's own (StagePlacement.tp)
    replica: int = 0  # which of the stage's `replicas` this is
    # waits for the Triton kernels compiled ahead for this stage (build_stages; an AR stage's
    # engine calls it just before its graphs: its weights load meanwhile); None: none listed
    kernels_ready: Callable[[], None] | None = None

    @property
    def name(self) -> str:
        return self.stage.name

    def prefix(self, default: str) -> str:
        """The stage's tensors in the checkpoint (the YAML's checkpoint_prefix, else default)."""
        return default if self.stage.checkpoint_prefix is None else self.stage.checkpoint_prefix


def build_stage_worker(path, config: dict, pipeline: PipelineConfig, name: str,
                       device: torch.device, dtype: torch.dtype, options: dict[str, Any],
                       placement: StagePlacement | None = None,
                       kernels_ready: Callable[[], None] | None = None):
    """A stage's worker from its YAML `model` through the registry (here or in a stage
    process): no pipeline names its stages' classes. `placement`: which replica, on which
    devices (None: one replica on `device`). kernels_ready: StageContext's."""
    from omnistage.models.registry import STAGE_BUILDERS
    placement = placement or StagePlacement(0, (str(device),), 1)
    ctx = dataclasses.replace(
        stage_context(path, config, pipeline, name, device, dtype, options, placement),
        kernels_ready=kernels_ready)
    with on_device(ctx.devices[0]):  # its warm-up kernels and graphs go to its own GPU
        return build_ranks(ctx, STAGE_BUILDERS[ctx.stage.model].build, placement)


def stage_context(path, config: dict, pipeline: PipelineConfig, name: str,
                  device: torch.device, dtype: torch.dtype, options: dict[str, Any],
                  placement: StagePlacement) -> StageContext:
    """What stage `name`'s registered builder gets (every model family imported)."""
    from omnistage.models.registry import import_all_models
    import_all_models()
    return StageContext(Path(path), config, pipeline, pipeline.stage(name), device, dtype,
                        placement.stage_options(options),
                        tuple(torch.device(d) for d in placement.devices), placement.tp,
                        placement.replica)


@dataclass(frozen=True)
class StagePlacement:
    """One replica of a stage: its index, its devices (TP ranks in order), its TP size."""

    replica: int
    devices: tuple[str, ...]
    tp: int

    def stage_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """The constructor options as this stage sees them: a constructor-wide
        `tensor_parallel_size` engine option is replaced by the stage's own TP, so no stage
        inherits another's (vLLM-Omni's broadcast crashed one-device stages)."""
        engine = options.get("engine")
        if not isinstance(engine, dict) or "tensor_parallel_size" not in engine:
            return options
        return {**options, "engine": {**engine, "tensor_parallel_size": self.tp}}


def stage_placements(stage: StageConfig, index: int, device: torch.device,
                     options: dict[str, Any], num_stages: int) -> list[StagePlacement]:
    """Each replica's devices, checked to exist (ValueError naming stages[i].devices[j]).
    A constructor-wide tensor_parallel_size applies only to a one-stage pipeline (a plain LM)
    whose stage names no devices or TP of its own: its ranks go on GPUs 0..TP-1 (or all on
    the CPU); every other stage keeps its own TP (1 without `devices`)."""
    engine = options.get("engine")
    wide_tp = engine.get("tensor_parallel_size") if isinstance(engine, dict) else None
    own_tp = stage.tensor_parallel_size or getattr(stage.engine, "tensor_parallel_size", None)
    if wide_tp is not None and (not isinstance(wide_tp, int) or isinstance(wide_tp, bool)
                                or not 1 <= wide_tp <= MAX_STAGE_DEVICES):
        raise ValueError(f"tensor_parallel_size: {wide_tp!r}; an integer in "
                         f"[1, {MAX_STAGE_DEVICES}]")
    if (wide_tp or 1) > 1 and num_stages == 1 and stage.devices is None and own_tp is None \
            and stage.device is None and stage.kind == "ar":
        devs = ["cpu"] * wide_tp if device.type == "cpu" else [f"cuda:{i}" for i in
                                                               range(wide_tp)]
        stage = stage.model_copy(update={"devices": devs * stage.replicas,
                                         "tensor_parallel_size": wide_tp})
    placements = []
    for r, devs in enumerate(stage.replica_devices(str(device))):
        checked = []
        for j, d in enumerate(devs):
            where = f"stages[{index}].devices[{r * stage.tp_size + j}]" if stage.devices \
                else f"stages[{index}].device"
            try:
                checked.append(str(resolve_device(d)))
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from e
        placements.append(StagePlacement(r, tuple(checked), stage.tp_size))
    return placements


# a stage replica built in this process: (unit name, its stage, device, dtype, placement)
LocalUnit = tuple[str, StageConfig, torch.device, torch.dtype, StagePlacement]


def build_stages(path, config: dict, pipeline: PipelineConfig, stages: list[StageConfig],
                 device: torch.device, dtype: torch.dtype, options: dict[str, Any]
                 ) -> tuple[dict[str, Any], dict[str, StageProcessSpec]]:
    """The stages, in pipeline order, each replica placed on its YAML devices/dtype (else the
    constructor's): a worker built here, or the spec of a stage process or Ray actor of its
    own (options["stage_worker"] for every stage, else the stage's `worker`). Keys: the
    replica's unit name (runtime.replicas.unit_name: the stage's name for one replica)."""
    from omnistage.runtime.replicas import unit_name
    workers: dict[str, Any] = {}
    process_stages: dict[str, StageProcessSpec] = {}
    local: list[LocalUnit] = []
    for stage in stages:
        placements = stage_placements(stage, pipeline.stage_names.index(stage.name), device,
                                      options, len(pipeline.stages))
        kind = options.get("stage_worker") or stage.worker
        for placement in placements:
            dev = torch.device(placement.devices[0])
            dt = dtype if stage.dtype == "auto" else resolve_dtype(stage.dtype, dev)
            unit = unit_name(stage.name, placement.replica, stage.replicas)
            if kind in ("process", "ray"):
                process_stages[unit] = stage_process_spec(
                    path, config, pipeline, stage.name, dev, dt, options, placement, kind)
            else:
                local.append((unit, stage, dev, dt, placement))
    from omnistage.models.registry import STAGE_BUILDERS
    ahead = start_kernels_ahead(path, config, pipeline, local, options)
    try:
        for unit, stage, dev, dt, placement in local:
            with startup.phase(unit):
                ar = STAGE_BUILDERS[stage.model].kind == "ar"
                ready = (_WaitOnce(ahead, unit, AR_WAIT_SECONDS if ar else WAIT_SECONDS)
                         if ahead.listed(unit) else None)
                if ready is not None and not ar:
                    with startup.phase("kernels_ahead"):  # (its warm-up is in its build)
                        ready()
                try:
                    workers[unit] = build_stage_worker(path, config, pipeline, stage.name, dev,
                                                       dt, options, placement, ready)
                except ValueError as e:  # e.g. num_kv_blocks: which stage did not fit
                    raise ValueError(f"stage {unit}: {e}") from e
                if ready is not None:
                    ready()  # (a builder that did not call it: its jobs are collected here)
    finally:
        ahead.close()
    return workers, process_stages


# NOTE (why AR stages do not wait): an AR stage takes the jobs done by the time its graphs start
# and compiles the rest itself; a launch still finds in the cache a variant that a job finished
# meanwhile. The 7B thinker, the first stage, waited 7.7 s of a cold start on the H200 for its
# 14 jobs (a process each) and its graphs then took 11.9 s against 15.7 s without them
# (benchmarks/results/qwen2_5_omni_pipeline_gpu_h200_startup_session26_issue24_2026-11-29.json).
# Code2wav waits for its Snake jobs, so they are submitted first.
AR_WAIT_SECONDS = 0.0


@dataclass
class _WaitOnce:
    """A unit's KernelsAhead.wait, run once (later calls return at once)."""

    ahead: KernelsAhead
    unit: str
    timeout: float
    done: bool = False

    def __call__(self) -> None:
        if not self.done:
            self.done = True
            self.ahead.wait(self.unit, self.timeout)


def start_kernels_ahead(path, config: dict, pipeline: PipelineConfig, local: list[LocalUnit],
                        options: dict[str, Any]) -> KernelsAhead:
    """The Triton kernel variants that this process's stages list (their builders'
    kernels_ahead), compiling in processes of their own while the stages build in order."""
    from omnistage.models.registry import STAGE_BUILDERS, import_all_models
    import_all_models()
    jobs: dict[str, tuple[tuple[str, int, int], list]] = {}
    for unit, stage, dev, dt, placement in local:
        if dev.type != "cuda" or (listed := STAGE_BUILDERS[stage.model].kernels_ahead) is None:
            continue
        ctx = stage_context(path, config, pipeline, stage.name, dev, dt, options, placement)
        try:
            jobs[unit] = cuda_target(dev), listed(ctx)
        except Exception:  # noqa: BLE001 - only a head start: the build compiles them itself
            log.exception("stage %s: listing its kernels to compile ahead failed", unit)
    # the jobs of stages that wait for theirs first (AR stages do not: AR_WAIT_SECONDS)
    waits = {unit for unit, stage, *_ in local if STAGE_BUILDERS[stage.model].kind != "ar"}
    return KernelsAhead.start(dict(sorted(jobs.items(), key=lambda kv: kv[0] not in waits)))


def build_ranks(ctx: StageContext, build: Callable[[StageContext], Any],
                placement: StagePlacement):
    """build(ctx); with ctx.tensor_parallel_size N > 1 (outside a rank's group) as rank 0 of N:
    ranks 1..N-1 start in processes of their own (engine/ar/tp_workers.py), each building the same
    stage on its device (ctx.devices[rank]) and following rank 0's steps."""
    size = ctx.tensor_parallel_size
    if size == 1 or current_tp().enabled:  # one rank, or a worker rank building its shard
        return build(ctx)
    devices = list(ctx.devices)
    tp, workers = start_workers(size, devices, build_tp_rank,
                                (str(ctx.path), ctx.config, ctx.pipeline, ctx.name, ctx.dtype,
                                 ctx.options, placement), all_reduce=tp_all_reduce(ctx))
    try:
        with tensor_parallel(tp):
            worker = build(dataclasses.replace(ctx, device=devices[0]))
        workers.attach(worker.engine.runner)
        workers.wait_ready()
    except BaseException:
        workers.abandon()  # its ranks failed, or wait for a step that will not come
        raise
    return worker


def tp_all_reduce(ctx: StageContext) -> str:
    """The stage's tp_all_reduce: its YAML `engine:` key, else the constructor's, else "auto"
    (ValueError naming tp_all_reduce for a bad constructor value). "auto": the one-shot kernel
    for a decode step's small all-reduces where the ranks' GPUs have peer access (it equals
    NCCL's sums and decodes faster: benchmarks/results/
    qwen3_omni_thinker_tp2_auto_h200x2_issue27_session17_2026-11-28.json), NCCL elsewhere."""
    own = getattr(ctx.stage.engine, "tp_all_reduce", None)
    engine = ctx.options.get("engine")
    wide = engine.get("tp_all_reduce") if isinstance(engine, dict) else None
    return check_mode(own or wide or "auto")


def build_tp_rank(path: str, config: dict, pipeline: PipelineConfig, name: str,
                  dtype: torch.dtype, options: dict[str, Any], placement: StagePlacement,
                  device: torch.device):
    """A worker rank's build (engine/ar/tp_workers.py calls it inside the rank's group): the
    stage as rank 0 builds it, on this rank's device; returns its ModelRunner."""
    worker = build_stage_worker(path, config, pipeline, name, device, dtype, options, placement)
    return worker.engine.runner
