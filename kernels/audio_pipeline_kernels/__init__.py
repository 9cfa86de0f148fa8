"""Compute kernels for audio-pipeline; each has a pure-torch reference that runs anywhere."""

from audio_pipeline_kernels.attention import causal_attention_reference
from audio_pipeline_kernels.native_paged_attention import native_attention
from audio_pipeline_kernels.paged_attention import RaggedStep, ragged_paged_attention, sequence_slots, write_paged_kv

__all__ = ["RaggedStep", "causal_attention_reference", "native_attention", "ragged_paged_attention", "sequence_slots",
           "write_paged_kv"]
