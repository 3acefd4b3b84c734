"""omnistage: a fast, streaming serving engine for omni-modality models."""

from omnistage.entrypoints.async_llm import AsyncOmniLLM
from omnistage.entrypoints.llm import OmniLLM
from omnistage.outputs import OmniRequestOutput, RequestMetrics, StageOutput
from omnistage.sampling_params import DiffusionParams, SamplingParams

__all__ = ["AsyncOmniLLM", "DiffusionParams", "OmniLLM", "OmniRequestOutput", "RequestMetrics",
           "SamplingParams", "StageOutput"]
__version__ = "0.1.0"
