"""Compute kernels for audio-pipeline; each has a pure-torch reference that runs anywhere."""

from audio_pipeline_kernels.attention import causal_attention_reference

__all__ = ["causal_attention_reference"]
