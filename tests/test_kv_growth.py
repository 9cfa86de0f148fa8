"""The CPU's KV cache starts with room for each row's first tokens and grows on demand: an idle
server holds little, and streams that need more get it with the same speech."""

from __future__ import annotations

import pytest
import torch

from audio_pipeline.core.kv_cache.paged import PagedKVCache
from audio_pipeline.models.interface import KVCacheParams
from helpers import run_to_completion, start_engine


def test_growing_keeps_every_block_and_moves_the_scratch_block_to_the_end():
    params = KVCacheParams(num_layers=2, n_kv_heads=2, head_dim=4, dtype=torch.float32, page_size=3)
    cache = PagedKVCache(params, 2, torch.device("cpu"))
    for layer in range(2):
        cache.keys[layer][:2] = torch.randn(2, 3, 2, 4)
        cache.values[layer][:2] = torch.randn(2, 3, 2, 4)
    before = [t[:2].clone() for t in (*cache.keys, *cache.values)]
    cache.grow(5)
    assert cache.scratch_block == 5 and all(t.shape[0] == 6 for t in (*cache.keys, *cache.values))
    for old, new in zip(before, (*cache.keys, *cache.values)):
        assert torch.equal(old, new[:2])


def speak_all(engine, count):
    """``count`` seeded requests at once; each one's generated tokens."""
    contexts = [engine.create_context(f"Sentence number {index} is a little longer than the others.",
                                      seed=index, temperature=0.8, min_tokens=280, max_tokens=280)
                for index in range(count)]
    run_to_completion(engine, contexts)
    return [list(context.generated) for context in contexts]


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_streams_that_outgrow_the_starting_cache_grow_it_and_speak_as_with_a_fixed_one(tiny_model_dir, overlap):
    """With overlap the CPU's worker may be running a step as the scheduler asks for room: the
    cache grows only once it has finished (its views of the old tensors would go stale)."""
    runs = {}
    for name, flags in (("grows", ()), ("fixed", ("model.kv_cache.kv_cache_memory_bytes=67108864",))):
        engine = start_engine(tiny_model_dir, "max_batch_size=4", "max_queue_size_tg=4",
                              f"enable_overlap_scheduler={str(overlap).lower()}", *flags)
        try:
            start = engine.scheduler.block_manager.total_num_blocks
            runs[name] = speak_all(engine, 4)
            grown = engine.scheduler.block_manager.total_num_blocks
        finally:
            engine.stop()
        if name == "grows":
            # Room for 4 rows of 256 tokens at first; four streams of ~300 tokens need more.
            assert start * engine.scheduler.block_manager.block_size == 4 * 256 and grown > start
            assert engine.metrics.kv_blocks_total._value.get() == grown
        else:
            assert grown == start
    assert runs["grows"] == runs["fixed"]
