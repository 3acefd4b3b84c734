"""Registries: names from config.json, pipeline YAMLs and checkpoints -> our classes. Nothing is
ever imported from a string; importing a family's modules registers its names.

- MODEL_REGISTRY: a YAML stage's `model` / a config.json `architectures` name -> model class.
- ADAPTER_REGISTRY: a YAML stage input's `adapter` -> link adapter class.
- STAGE_BUILDERS: a YAML stage's `model` -> how to build that stage's worker (its engine kind,
  "ar" or "gen", must be the YAML stage's `kind`).
- PIPELINE_REGISTRY: a built-in pipeline name -> pipeline class; `resolve_pipeline` picks the
  first whose `matches(config)` accepts a checkpoint's config.json (else the causal LM one)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MODEL_REGISTRY: dict[str, type] = {}
ADAPTER_REGISTRY: dict[str, type] = {}  # stage input adapters (e.g. thinker -> talker rows)
PIPELINE_REGISTRY: dict[str, type] = {}
ENGINE_KINDS = ("ar", "gen")


@dataclass(frozen=True)
class StageBuilder:
    kind: str  # the engine it runs on: "ar" (engine/ar) or "gen" (engine/gen)
    # build(runtime.build.StageContext) -> a StageWorker (runs here or in a stage process)
    build: Callable[[Any], Any]
    sample_rate: int | None = None  # of the audio it emits (a stage with `output: audio`)
    # kernels_ahead(StageContext) -> [engine.kernels_ahead.KernelJob]: Triton kernel variants
    # its build will launch, compiled in processes of their own while earlier stages load
    kernels_ahead: Callable[[Any], list] | None = None


STAGE_BUILDERS: dict[str, StageBuilder] = {}
CAUSAL_LM_PIPELINE = "llm"


def register_model(*architectures: str) -> Callable[[type], type]:
    def wrap(cls: type) -> type:
        for arch in architectures:
            MODEL_REGISTRY[arch] = cls
        return cls
    return wrap


def register_adapter(name: str) -> Callable[[type], type]:
    def wrap(cls: type) -> type:
        ADAPTER_REGISTRY[name] = cls
        return cls
    return wrap


def register_stage(model: str, kind: str, sample_rate: int | None = None,
                   kernels_ahead: Callable[[Any], list] | None = None
                   ) -> Callable[[Callable], Callable]:
    """A stage builder under a YAML `model` name: `build(ctx: StageContext) -> StageWorker`
    (kernels_ahead: StageBuilder's)."""
    if kind not in ENGINE_KINDS:
        raise ValueError(f"kind: {kind!r}; one of {ENGINE_KINDS}")

    def wrap(build: Callable) -> Callable:
        STAGE_BUILDERS[model] = StageBuilder(kind, build, sample_rate, kernels_ahead)
        return build
    return wrap


def register_pipeline(name: str) -> Callable[[type], type]:
    """A pipeline class under its built-in YAML's name (config/pipelines/<name>.yaml)."""
    def wrap(cls: type) -> type:
        cls.builtin = name
        PIPELINE_REGISTRY[name] = cls
        return cls
    return wrap


def _import_builtin_models() -> None:
    # importing the families registers them
    from omnistage.models.llama import model as _llama  # noqa: F401
    from omnistage.models.qwen2 import model as _qwen2  # noqa: F401


def import_all_models() -> None:
    """Register every built-in model, adapter and pipeline (the names pipeline YAMLs may use)."""
    _import_builtin_models()
    from omnistage.models import causal_lm  # noqa: F401
    from omnistage.models.qwen2_5_omni import pipeline  # noqa: F401
    from omnistage.models.qwen3_omni import pipeline as _qwen3_omni  # noqa: F401
    from omnistage.models.qwen_image import pipeline as _qwen_image  # noqa: F401
    from omnistage.models.z_image import pipeline as _z_image  # noqa: F401


def resolve_pipeline(config: dict) -> type:
    """The pipeline class for a checkpoint's config.json: the first registered family pipeline
    that matches it, else a one-stage causal LM (its architecture checked here)."""
    import_all_models()
    for name, cls in PIPELINE_REGISTRY.items():
        if name != CAUSAL_LM_PIPELINE and cls.matches(config):
            return cls
    resolve_architecture(config.get("architectures") or [])  # fail early on an unsupported LM
    return PIPELINE_REGISTRY[CAUSAL_LM_PIPELINE]


def resolve_architecture(architectures: list[str]) -> tuple[str, type]:
    _import_builtin_models()
    for arch in architectures:
        if arch in MODEL_REGISTRY:
            return arch, MODEL_REGISTRY[arch]
    raise ValueError(f"config.architectures: {architectures} not supported; "
                     f"supported: {sorted(MODEL_REGISTRY)}")


def check_registered(cfg) -> None:
    """Every `model` and `adapter` name of a PipelineConfig is registered, each stage's `kind`
    that of its builder (ValueError naming the field). The YAML schema itself imports no
    models: this runs where a pipeline is built."""
    import_all_models()
    for i, s in enumerate(cfg.stages):
        builder = STAGE_BUILDERS.get(s.model)
        if builder is None:
            raise ValueError(f"stages[{i}].model: {s.model!r} is not a registered stage model; "
                             f"known: {sorted(STAGE_BUILDERS)}")
        if builder.kind != s.kind:
            raise ValueError(f"stages[{i}].kind: {s.model!r} runs on the {builder.kind!r} "
                             f"engine, not {s.kind!r}")
        for j, inp in enumerate(s.inputs):
            if inp.adapter not in ADAPTER_REGISTRY:
                raise ValueError(f"stages[{i}].inputs[{j}].adapter: {inp.adapter!r} is not a "
                                 f"registered adapter; known: {sorted(ADAPTER_REGISTRY)}")
