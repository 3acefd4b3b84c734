"""The Pipeline protocol: what a model family's pipeline class gives the API and the runtime.
Registered by name (models.registry.register_pipeline), built by entrypoints.base.OmniBase."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from omnistage.config.schema import PipelineConfig
from omnistage.runtime.orchestrator import RuntimeRequest
from omnistage.runtime.process import StageProcessSpec
from omnistage.runtime.stage import StageWorker
from omnistage.sampling_params import SamplingParams


class Pipeline(Protocol):
    """Built once per OmniLLM: `__init__(path, config, pipeline, device, dtype, options)` builds
    the stages of this process (`workers`) and the specs of stage processes (`process_stages`)."""

    builtin: str  # the built-in pipeline YAML's name (set by register_pipeline)
    config: PipelineConfig
    workers: dict[str, StageWorker]  # stages running in this process
    process_stages: dict[str, StageProcessSpec]  # stages running in processes of their own
    output_modalities: list[str]  # e.g. ["text", "audio"]
    default_params: dict[str, SamplingParams]  # per stage, from the checkpoint and the YAML
    voices: dict[str, Any]  # speaker name -> voice data ({} when the model does not speak)
    max_model_len: int  # the first stage's context length (prompt bound)
    tokenizer: Any
    # the constructor options that choose each stage's graph warm-up, "full" or "lazy": the
    # ones OmniBase's `warmup_plan` sets
    warmup_plan_options: tuple[str, ...]

    @classmethod
    def matches(cls, config: dict) -> bool:
        """Whether a checkpoint's config.json is this family's."""

    @classmethod
    def build_stage(cls, path: Path, config: dict, pipeline: PipelineConfig, name: str,
                    device: torch.device, dtype: torch.dtype, options: dict[str, Any]
                    ) -> StageWorker:
        """One stage's model and worker (here, or in a stage process)."""

    @property
    def stage_names(self) -> list[str]: ...

    def prepare(self, prompt: Any, params: dict[str, SamplingParams], modalities: list[str],
                where: str, index: int) -> RuntimeRequest:
        """Validate one prompt (ValueError naming `where` and the field) and build its
        RuntimeRequest: each stage's request and the links between them."""
