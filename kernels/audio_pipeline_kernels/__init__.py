"""Compute kernels for audio-pipeline; each has a pure-torch reference that runs anywhere."""

from audio_pipeline_kernels.attention import causal_attention_reference
from audio_pipeline_kernels.paged_attention import RaggedStep, ragged_paged_attention, sequence_slots, write_paged_kv

__all__ = ["RaggedStep", "causal_attention_reference", "ragged_paged_attention", "sequence_slots", "write_paged_kv"]
