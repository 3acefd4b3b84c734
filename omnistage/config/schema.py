"""Pipeline YAML schema: what a user types is a pydantic model with unknown fields forbidden;
load_pipeline() validates the graph (unique names, known upstreams, DAG, registered models and
adapters, valid devices) and names the offending field."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import (BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

from omnistage.sampling_params import (INT32_MAX, MAX_REPETITION_PENALTY, MAX_TEMPERATURE,
                                       SamplingParams)

BUILTIN_DIR = Path(__file__).parent / "pipelines"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EngineOptions(_Strict):
    """AR engine settings of one stage (unset = the OmniLLM constructor's value or default)."""

    max_num_seqs: int | None = Field(None, ge=1, le=4096)
    max_model_len: int | None = Field(None, ge=16, le=1 << 20)
    max_num_batched_tokens: int | None = Field(None, ge=1, le=1 << 20)
    block_size: int | None = Field(None, ge=1, le=1024)
    num_kv_blocks: int | None = Field(None, ge=2)
    kv_cache_memory_fraction: float | None = Field(None, gt=0, le=0.95)
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool | None = None
    # engine/kernel switches: EngineConfig (engine/ar/scheduler.py) says what each one does
    cuda_graphs: Literal["auto", "off", "eager"] | None = None
    prefill_graphs: bool | None = None
    graph_warmup: bool | None = None
    graph_warmup_plan: Literal["full", "lazy"] | None = None
    compile: bool | None = None
    async_scheduling: bool | None = None
    fast_sampler: bool | None = None
    pdl: bool | None = None
    fused_rope_kv: bool | None = None
    triton_gemv: bool | None = None
    gemv_fused_reduce: bool | None = None
    ar_stream: str | None = Field(None, min_length=1, max_length=64)
    # this stage's tensor-parallel ranks (docs/distributed.md); never inherited by other stages
    tensor_parallel_size: int | None = Field(None, ge=1, le=64)
    # its all-reduces (docs/distributed.md): "auto" (one-shot over symmetric memory for small
    # tensors on CUDA GPUs with peer access, NCCL otherwise), "nccl", "symm_mem"
    tp_all_reduce: Literal["auto", "nccl", "symm_mem"] | None = None


class StageInput(_Strict):
    upstream: str
    adapter: str  # a name in models.registry.ADAPTER_REGISTRY


class SamplingDefaults(_Strict):
    """A stage's default sampling (SamplingParams fields, with SamplingParams.validate's bounds:
    a bad value fails where the YAML or HTTP body is read, naming its field)."""

    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)  # <= 0 = off
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=MAX_REPETITION_PENALTY)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    min_tokens: int | None = Field(None, ge=0, le=INT32_MAX)

    def apply(self, base: SamplingParams) -> SamplingParams:
        values = {k: v for k, v in self.model_dump().items() if v is not None}
        p = SamplingParams(**{**base.__dict__, **values})
        p.validate("default_sampling")
        return p


class ResidualSampling(_Strict):
    """How a multi-codebook AR stage (Qwen3-Omni's talker) draws codebooks 1..K-1 after its
    own sampling drew codebook 0; greedy whenever that sampling is greedy."""

    temperature: float = Field(1.0, ge=0, le=100)
    top_k: int = Field(50, ge=0, le=1 << 20)  # 0 = off
    top_p: float = Field(0.8, gt=0, le=1)


MAX_STAGE_DEVICES = 64  # devices of one stage (all its replicas' tensor-parallel ranks)


def check_device_name(v: str) -> str:
    """'cpu', 'cuda' or 'cuda:N' (whether the GPU exists is checked where stages are built)."""
    if v == "cpu" or v == "cuda" or (v.startswith("cuda:") and v[5:].isdigit()):
        return v
    raise ValueError(f"{v!r} is not 'cpu', 'cuda' or 'cuda:N'")


class RayPlacement(_Strict):
    """What a stage's Ray actor (one per replica) asks of a node (`worker: ray`, or
    `ray_address` set): Ray places the actor on a node with these resources free."""

    num_cpus: float = Field(1.0, ge=0, le=1024)
    # None: one per CUDA device the replica uses (0 on CPU)
    num_gpus: float | None = Field(None, ge=0, le=64)
    resources: dict[str, float] = Field(default_factory=dict, max_length=16)

    @field_validator("resources")
    @classmethod
    def _resources(cls, v: dict[str, float]) -> dict[str, float]:
        for key, amount in v.items():
            if not key or len(key) > 64 or not 0 < amount <= 1 << 20:
                raise ValueError(f"{key!r}: {amount}: a resource needs a name (1-64 chars) "
                                 "and an amount in (0, 2^20]")
        return v


class StageConfig(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-z][a-z0-9_]*$")
    kind: Literal["ar", "gen"]  # the engine: engine/ar (autoregressive) or engine/gen
    model: str  # the component's registered model name
    # the component's tensors in the checkpoint (e.g. "thinker."); None = the model's default
    checkpoint_prefix: str | None = None
    device: str | None = None  # "cpu", "cuda", "cuda:N"; None = the OmniLLM device
    # every device of the stage, replica by replica, each replica's tensor-parallel ranks
    # together: len = tensor_parallel_size x replicas (e.g. ["cuda:0", "cuda:1"]); None: each
    # replica on `device`
    devices: list[str] | None = Field(None, min_length=1, max_length=MAX_STAGE_DEVICES)
    # this stage's own TP size (no other stage's, nor the constructor's, applies to it)
    tensor_parallel_size: int | None = Field(None, ge=1, le=MAX_STAGE_DEVICES)
    # copies of the stage; each request runs on one of them (runtime/replicas.py)
    replicas: int = Field(1, ge=1, le=MAX_STAGE_DEVICES)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # where the stage runs: in the orchestrator's process, or in a (spawned) process of its own
    # or as Ray actors (one per replica; needs the constructor's ray_address)
    worker: Literal["inprocess", "process", "ray"] = "inprocess"
    placement: RayPlacement = RayPlacement()  # Ray only
    engine: EngineOptions = EngineOptions()
    inputs: list[StageInput] = []
    default_sampling: SamplingDefaults = SamplingDefaults()
    residual_sampling: ResidualSampling = ResidualSampling()  # multi-codebook stages only
    # the modality this stage gives the user
    output: Literal["text", "audio", "image"] | None = None

    @field_validator("device")
    @classmethod
    def _device(cls, v: str | None) -> str | None:
        return None if v is None else check_device_name(v)

    @field_validator("devices")
    @classmethod
    def _devices(cls, v: list[str] | None) -> list[str] | None:
        if v is not None:
            for i, d in enumerate(v):
                try:
                    check_device_name(d)
                except ValueError as e:
                    raise ValueError(f"devices[{i}]: {e}") from None
        return v

    @model_validator(mode="after")
    def _placement(self) -> StageConfig:
        """devices = tensor_parallel_size x replicas; a TP group's GPUs are distinct."""
        tp = self.tensor_parallel_size
        engine_tp = getattr(self.engine, "tensor_parallel_size", None)
        if tp is not None and engine_tp is not None and engine_tp != tp:
            raise ValueError(f"tensor_parallel_size: {tp}, but engine.tensor_parallel_size is "
                             f"{engine_tp} (set one)")
        tp = tp or engine_tp
        if self.devices is None:
            if tp is not None and tp > 1:
                raise ValueError(f"devices: tensor_parallel_size {tp} needs `devices`, "
                                 f"{tp} x replicas ({self.replicas}) of them")
            return self
        if self.device is not None:
            raise ValueError("devices: set `device` or `devices`, not both")
        tp = tp or len(self.devices) // self.replicas or 1
        if len(self.devices) != tp * self.replicas:
            raise ValueError(f"devices: {len(self.devices)} given; tensor_parallel_size {tp} x "
                             f"replicas {self.replicas} needs {tp * self.replicas}")
        if tp > 1 and self.kind != "ar":
            raise ValueError(f"tensor_parallel_size: {tp}; only AR stages (kind: ar) shard "
                             "their model")
        if tp > 1 and self.worker == "process":
            # a stage process is a daemon, and a daemon cannot start the TP ranks' processes
            raise ValueError(f"worker: 'process' cannot hold a tensor-parallel stage "
                             f"(tensor_parallel_size {tp}); use 'inprocess' or 'ray'")
        for r in range(self.replicas):
            group = self.devices[r * tp:(r + 1) * tp]
            if len({d.split(":")[0] for d in group}) > 1:
                raise ValueError(f"devices: replica {r} mixes CPU and CUDA devices {group}")
            gpus = [d for d in group if d.startswith("cuda")]
            if tp > 1 and gpus and ("cuda" in gpus or len(set(gpus)) < len(gpus)):
                raise ValueError(f"devices: replica {r}'s tensor-parallel ranks {group} need "
                                 "distinct 'cuda:N' devices")
        return self

    @property
    def tp_size(self) -> int:
        """The stage's tensor-parallel size (its own, never another stage's)."""
        tp = self.tensor_parallel_size or getattr(self.engine, "tensor_parallel_size", None)
        if tp is not None:
            return tp
        return len(self.devices) // self.replicas if self.devices else 1

    def replica_devices(self, default: str | None = None) -> list[list[str] | None]:
        """Each replica's devices (its TP ranks in order); None: `device`, else `default`."""
        if self.devices is None:
            dev = self.device or default
            return [None if dev is None else [dev] for _ in range(self.replicas)]
        tp = self.tp_size
        return [list(self.devices[r * tp:(r + 1) * tp]) for r in range(self.replicas)]


class PipelineConfig(_Strict):
    name: str
    stages: list[StageConfig] = Field(min_length=1, max_length=16)
    # the runtime launches each stage's step on a CUDA stream of its own and collects whichever
    # finishes first; None: on when a stage of this process runs on a GPU
    overlap: bool | None = None

    def stage(self, name: str) -> StageConfig:
        return next(s for s in self.stages if s.name == name)

    @property
    def stage_names(self) -> list[str]:
        return [s.name for s in self.stages]

    @property
    def output_modalities(self) -> list[str]:
        return [s.output for s in self.stages if s.output]


def _check_graph(cfg: PipelineConfig) -> None:
    """Names, upstreams and order (registered model/adapter names are checked where the
    pipeline is built: models.registry.check_registered; this module imports no models)."""
    names = [s.name for s in cfg.stages]
    for i, s in enumerate(cfg.stages):
        where = f"stages[{i}]"
        if s.name in names[:i]:
            raise ValueError(f"{where}.name: {s.name!r} is used by more than one stage")
        for j, inp in enumerate(s.inputs):
            if inp.upstream not in names:
                raise ValueError(f"{where}.inputs[{j}].upstream: no stage named {inp.upstream!r}")
    # DAG: stages must be listed after their upstreams (this also rules out cycles)
    seen: set[str] = set()
    for i, s in enumerate(cfg.stages):
        for j, inp in enumerate(s.inputs):
            if inp.upstream == s.name or inp.upstream not in seen:
                raise ValueError(f"stages[{i}].inputs[{j}].upstream: {inp.upstream!r} makes a "
                                 "cycle or comes later (stages must form a DAG, listed in order)")
        seen.add(s.name)
    if not cfg.output_modalities:
        raise ValueError("stages: no stage declares an output modality")


def load_pipeline(source: str | Path | dict) -> PipelineConfig:
    """A PipelineConfig from a YAML path, a built-in name, or a dict. ValueError names the field."""
    if isinstance(source, dict):
        data, origin = source, "pipeline"
    else:
        path = Path(source)
        if not path.is_file():
            builtin = BUILTIN_DIR / f"{source}.yaml"
            if not builtin.is_file():
                raise ValueError(f"pipeline: {source!r} is neither a YAML file nor a built-in "
                                 f"pipeline ({sorted(p.stem for p in BUILTIN_DIR.glob('*.yaml'))})")
            path = builtin
        if path.stat().st_size > 1 << 20:
            raise ValueError(f"pipeline: {path} is larger than 1 MiB")
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError as e:
            raise ValueError(f"pipeline: {path} is not valid YAML: {e}") from e
        origin = str(path)
    if not isinstance(data, dict):
        raise ValueError(f"pipeline: {origin} must hold a mapping")
    try:
        cfg = PipelineConfig.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise ValueError(f"pipeline: {origin}: {loc}: {err['msg']}") from e
    _check_graph(cfg)
    return cfg
