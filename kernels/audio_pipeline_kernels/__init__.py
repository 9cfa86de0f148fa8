"""Compute kernels for audio-pipeline: paged attention backends over one cache layout, each checked
against a pure-torch reference that runs anywhere."""

from audio_pipeline_kernels.attention import causal_attention_reference
from audio_pipeline_kernels.backends import (BACKENDS, AttentionBackend, AttentionPlan, NativeBackend, TorchBackend,
                                             select_attention_backend)
from audio_pipeline_kernels.native_paged_attention import native_attention
from audio_pipeline_kernels.paged_attention import RaggedStep, ragged_paged_attention
from audio_pipeline_kernels.paged_layout import (StepMetadata, allocate_paged_cache, paged_attention_reference,
                                                 read_sequence_kv, write_paged_kv)

__all__ = ["BACKENDS", "AttentionBackend", "AttentionPlan", "NativeBackend", "RaggedStep", "StepMetadata",
           "TorchBackend", "allocate_paged_cache", "causal_attention_reference", "native_attention",
           "paged_attention_reference", "ragged_paged_attention", "read_sequence_kv", "select_attention_backend",
           "write_paged_kv"]
