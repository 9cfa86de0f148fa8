"""Paged attention (torch reference) against plain causal attention over contiguous keys/values."""

import torch

from audio_pipeline_kernels import causal_attention_reference, paged_attention_reference, write_paged_kv


def test_paged_attention_equals_contiguous_attention_for_a_ragged_batch():
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, block_size, num_blocks = 4, 2, 8, 4, 32
    key_cache = torch.zeros(num_blocks, block_size, kv_heads, dim)
    value_cache = torch.zeros_like(key_cache)
    # Three sequences: a decode step (1 query), a prefill chunk on top of a cache, a whole prompt.
    lengths, new = [9, 13, 6], [1, 5, 6]
    free = torch.randperm(num_blocks, generator=generator).tolist()  # scattered, out-of-order blocks
    tables, full_k, full_v = [], [], []
    for length in lengths:
        blocks = [free.pop() for _ in range(-(-length // block_size))]
        tables.append(blocks + [0] * (4 - len(blocks)))
        k = torch.randn(length, kv_heads, dim, generator=generator)
        v = torch.randn(length, kv_heads, dim, generator=generator)
        slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(length)])
        write_paged_kv(key_cache, value_cache, k, v, slots)
        full_k.append(k)
        full_v.append(v)
    queries = [torch.randn(n, heads, dim, generator=generator) for n in new]
    starts = [0, 1, 6]
    got = paged_attention_reference(torch.cat(queries), key_cache, value_cache, torch.tensor(tables),
                                    torch.tensor(lengths), starts, new)
    want = torch.cat([causal_attention_reference(q, k, v) for q, k, v in zip(queries, full_k, full_v)])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
