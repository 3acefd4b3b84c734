from omnistage.config.schema import EngineOptions, PipelineConfig, StageConfig, load_pipeline

__all__ = ["EngineOptions", "PipelineConfig", "StageConfig", "load_pipeline"]
