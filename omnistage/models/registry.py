"""Model registry: config.json `architectures` name -> our class. Never imports from strings."""

from __future__ import annotations

from collections.abc import Callable

MODEL_REGISTRY: dict[str, type] = {}
ADAPTER_REGISTRY: dict[str, type] = {}  # stage input adapters (e.g. thinker -> talker rows)


def register_model(*architectures: str) -> Callable[[type], type]:
    def wrap(cls: type) -> type:
        for arch in architectures:
            MODEL_REGISTRY[arch] = cls
        return cls
    return wrap


OMNI_ARCHITECTURES = ("Qwen2_5OmniForConditionalGeneration", "Qwen2_5OmniModel")


def register_adapter(name: str) -> Callable[[type], type]:
    def wrap(cls: type) -> type:
        ADAPTER_REGISTRY[name] = cls
        return cls
    return wrap


def _import_builtin_models() -> None:
    # importing the families registers them
    from omnistage.models.llama import model as _llama  # noqa: F401
    from omnistage.models.qwen2 import model as _qwen2  # noqa: F401


def import_all_models() -> None:
    """Register every built-in model and adapter (the names pipeline YAMLs may use)."""
    _import_builtin_models()
    from omnistage.entrypoints import lm_pipeline  # noqa: F401  (causal_lm)
    from omnistage.models.qwen2_5_omni import code2wav_stage, talker, thinker  # noqa: F401


def resolve_pipeline(config: dict) -> type:
    """The pipeline class for a checkpoint: Qwen2.5-Omni's stages, or a one-stage LM."""
    archs = config.get("architectures") or []
    if any(a in OMNI_ARCHITECTURES for a in archs) or "thinker_config" in config:
        from omnistage.models.qwen2_5_omni.pipeline import Qwen2_5OmniPipeline
        return Qwen2_5OmniPipeline
    resolve_architecture(archs)  # fail early on an unsupported LM
    from omnistage.entrypoints.lm_pipeline import CausalLMPipeline
    return CausalLMPipeline


def resolve_architecture(architectures: list[str]) -> tuple[str, type]:
    _import_builtin_models()
    for arch in architectures:
        if arch in MODEL_REGISTRY:
            return arch, MODEL_REGISTRY[arch]
    raise ValueError(f"config.architectures: {architectures} not supported; "
                     f"supported: {sorted(MODEL_REGISTRY)}")
