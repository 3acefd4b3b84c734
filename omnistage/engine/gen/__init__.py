"""The non-AR engine: step-level batching of per-request outputs, first outputs first, steps
in parts, the launcher thread and graph services (code2wav of any family, diffusion DiTs,
prefill-only encoders). A family implements `GenModel` (model.py)."""

from omnistage.engine.gen.config import MAX_BATCH, GenEngineConfig
from omnistage.engine.gen.graphs import BUCKETS, GraphCache, SegmentGraph, bucket_for
from omnistage.engine.gen.model import GenModel, GenRequest
from omnistage.engine.gen.worker import GenStageWorker, StepJob

__all__ = ["BUCKETS", "MAX_BATCH", "GenEngineConfig", "GenModel", "GenRequest",
           "GenStageWorker", "GraphCache", "SegmentGraph", "StepJob", "bucket_for"]
