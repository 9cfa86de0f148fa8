"""The paged KV cache: torch-free block bookkeeping (with prefix caching) and the cache tensors.

The block manager imports no torch; the tensor side (``PagedKVCache``, ``PagedKVCacheManager``,
``PagedBatch``) loads on first use.
"""

from audio_pipeline.core.kv_cache.block_manager import BlockManager, KVCacheFull, PrefixCacheStats

__all__ = ["BlockManager", "KVCacheFull", "PagedBatch", "PagedKVCache", "PagedKVCacheManager", "PrefixCacheStats"]


def __getattr__(name: str):
    if name in ("PagedBatch", "PagedKVCache", "PagedKVCacheManager"):
        from audio_pipeline.core.kv_cache import paged

        return getattr(paged, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
