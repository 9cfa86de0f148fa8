"""Compute kernels for audio-pipeline; each has a pure-torch reference that runs anywhere."""

from audio_pipeline_kernels.attention import causal_attention_reference
from audio_pipeline_kernels.paged_attention import (gather_sequence_kv, paged_attention_reference,
                                                    paged_decode_attention_reference, write_paged_kv)

__all__ = ["causal_attention_reference", "gather_sequence_kv", "paged_attention_reference",
           "paged_decode_attention_reference", "write_paged_kv"]
