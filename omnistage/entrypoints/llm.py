"""OmniLLM: the offline Python API over a model's pipeline of stages."""

from __future__ import annotations

from typing import Any

import torch

from omnistage.checkpoint import load_config, resolve_model_path
from omnistage.entrypoints.options import resolve_device, resolve_dtype
from omnistage.entrypoints.prompts import check_prompt_shape, per_stage_params
from omnistage.models.registry import resolve_pipeline
from omnistage.outputs import OmniRequestOutput


class OmniLLM:
    """Offline generation. `generate` validates every prompt and parameter before any work
    starts (ValueError naming the prompt index and field); errors that only appear while
    running come back in that request's `error`."""

    def __init__(self, model: str, pipeline: str | None = None, device: str | None = None,
                 dtype: str | torch.dtype = "auto", **engine_options: Any) -> None:
        self.path = resolve_model_path(model)
        config = load_config(self.path)
        pipeline_cls = resolve_pipeline(config)
        if pipeline is not None:
            raise ValueError("pipeline: custom pipeline YAML files are not supported yet")
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.pipeline = pipeline_cls(self.path, config, self.device, self.dtype, engine_options)

    @property
    def engine(self):
        """The first AR stage's engine."""
        return self.pipeline.engines[self.pipeline.stage_names[0]]

    @property
    def tokenizer(self):
        return self.pipeline.tokenizer

    def generate(self, prompts: Any, sampling_params: Any = None,
                 output_modalities: list[str] | None = None,
                 use_tqdm: bool = True) -> list[OmniRequestOutput]:
        prompts = prompts if isinstance(prompts, list) else [prompts]
        if not prompts:
            raise ValueError("prompts: empty list")
        modalities = self._modalities(output_modalities)
        params = per_stage_params(sampling_params, len(prompts), self.pipeline.stage_names,
                                  self.pipeline.default_params)
        requests = []
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            where = f"prompts[{i}]"
            check_prompt_shape(prompt, where)
            requests.append(self.pipeline.prepare(prompt, sp, modalities, where, i))
        return self.pipeline.run(requests, use_tqdm)

    def _modalities(self, output_modalities: list[str] | None) -> list[str]:
        available = self.pipeline.output_modalities
        if output_modalities is None:
            return list(available)
        if not isinstance(output_modalities, list) or not output_modalities or \
                any(m not in available for m in output_modalities):
            raise ValueError(f"output_modalities: {output_modalities!r}; this model gives "
                             f"{available}")
        return list(output_modalities)
