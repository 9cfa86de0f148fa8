"""KV cache managers and the cache tensors they hand to the model."""

from audio_pipeline.kv_cache.contiguous import ContiguousKVCacheManager, SequenceKVCache

__all__ = ["ContiguousKVCacheManager", "SequenceKVCache"]
