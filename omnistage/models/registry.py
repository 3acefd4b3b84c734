"""Model registry: config.json `architectures` name -> our class. Never imports from strings."""

from __future__ import annotations

from collections.abc import Callable

MODEL_REGISTRY: dict[str, type] = {}


def register_model(*architectures: str) -> Callable[[type], type]:
    def wrap(cls: type) -> type:
        for arch in architectures:
            MODEL_REGISTRY[arch] = cls
        return cls
    return wrap


def _import_builtin_models() -> None:
    # importing the families registers them
    from omnistage.models.llama import model as _llama  # noqa: F401
    from omnistage.models.qwen2 import model as _qwen2  # noqa: F401


def resolve_architecture(architectures: list[str]) -> tuple[str, type]:
    _import_builtin_models()
    for arch in architectures:
        if arch in MODEL_REGISTRY:
            return arch, MODEL_REGISTRY[arch]
    raise ValueError(f"config.architectures: {architectures} not supported; "
                     f"supported: {sorted(MODEL_REGISTRY)}")
