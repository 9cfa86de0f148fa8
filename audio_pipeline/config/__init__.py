"""The configuration: its models and their fields (settings.py), where values come from (sources.py:
defaults, the model's own, files, the environment, flags) and the values the engine takes where a
limit is left open (defaults.py). ``from audio_pipeline.config import AudioGenerationConfig``."""

from audio_pipeline.config.settings import (DEFAULT_MODEL, AudioGenerationConfig, EngineProcess, KVCacheConfig,
                                            LimitsConfig,
                                            MAXModelConfig, ModelConfig, PipelineConfig, PrependPromptSpeechTokens,
                                            PrometheusMetricsMode, SamplingConfig)

__all__ = ["DEFAULT_MODEL", "AudioGenerationConfig", "EngineProcess", "KVCacheConfig", "LimitsConfig", "MAXModelConfig", "ModelConfig",
           "PipelineConfig", "PrependPromptSpeechTokens", "PrometheusMetricsMode", "SamplingConfig"]
