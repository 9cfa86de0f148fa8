"""Ragged paged attention against plain causal attention over each sequence's contiguous keys/values."""

import pytest
import torch

from audio_pipeline_kernels import (RaggedStep, causal_attention_reference, native_attention,
                                    ragged_paged_attention, sequence_slots, write_paged_kv)


def _ragged_case(generator, *, heads, kv_heads, block_size, lengths, new, dim=8, kernel="torch"):
    """A paged cache holding random sequences in scattered blocks, and each one's contiguous keys/values."""
    num_blocks = sum(-(-n // block_size) for n in lengths) + 4
    key_cache = torch.zeros(kv_heads, num_blocks * block_size, dim)
    value_cache = torch.zeros_like(key_cache)
    free = torch.randperm(num_blocks, generator=generator).tolist()
    width = max(-(-n // block_size) for n in lengths) + 1  # one spare column of padding
    tables, contiguous = [], []
    for length in lengths:
        blocks = [free.pop() for _ in range(-(-length // block_size))]
        tables.append(blocks + [free[0]] * (width - len(blocks)))
        k = torch.randn(length, kv_heads, dim, generator=generator)
        v = torch.randn(length, kv_heads, dim, generator=generator)
        slots = sequence_slots(torch.tensor(blocks), length, block_size)
        write_paged_kv(key_cache, value_cache, k, v, slots)
        contiguous.append((k, v))
    queries = [torch.randn(n, heads, dim, generator=generator) for n in new]
    step = RaggedStep.build(torch.tensor(tables), torch.tensor(lengths), torch.tensor(new), block_size)
    if kernel == "native":
        native = native_attention()
        if native is None:
            pytest.skip("the native kernel cannot be built here (no C++ compiler)")
        new_t = torch.tensor(new)
        got = native(torch.cat(queries), key_cache, value_cache, torch.tensor(tables), torch.tensor(lengths),
                     torch.cumsum(new_t, 0) - new_t, new_t, block_size, dim ** -0.5)
    else:
        got = ragged_paged_attention(torch.cat(queries), key_cache, value_cache, step)
    want = torch.cat([causal_attention_reference(q, k, v) for q, (k, v) in zip(queries, contiguous)])
    return got, want, step


@pytest.mark.parametrize("kernel", ["torch", "native"])
@pytest.mark.parametrize("block_size", [1, 4, 16, 128])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("mix", ["decode", "forced", "prefill", "mixed"])
def test_ragged_paged_attention_equals_contiguous_attention(block_size, heads, kv_heads, mix, kernel):
    """One batched attention per layer (the torch form, and the native kernel that reads the cache in
    place) equals per-sequence causal attention over contiguous KV, for decode rows, multi-token rows
    (forced tokens), whole prompts and mixed steps, at several page sizes and with grouped-query
    attention."""
    generator = torch.Generator().manual_seed(block_size * 100 + heads * 10 + kv_heads)
    lengths, new = {
        "decode": ([9, 33, 17, 1], [1, 1, 1, 1]),
        "forced": ([12, 40, 7, 3], [3, 1, 2, 3]),
        "prefill": ([5, 31, 64], [5, 31, 64]),
        "mixed": ([50, 13, 2, 29, 8], [1, 13, 2, 3, 5]),
    }[mix]
    got, want, _ = _ragged_case(generator, heads=heads, kv_heads=kv_heads, block_size=block_size,
                                lengths=lengths, new=new, kernel=kernel)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dim", [32, 48, 64, 96, 128, 40])
@pytest.mark.parametrize("block_size", [4, 128])
def test_native_kernel_at_real_head_sizes(dim, block_size):
    """The native kernel unrolls the common head sizes (32 ... 128) and loops over any other (40):
    both equal contiguous attention on a mixed ragged step with forced-token rows."""
    generator = torch.Generator().manual_seed(dim + block_size)
    got, want, _ = _ragged_case(generator, heads=4, kv_heads=2, block_size=block_size,
                                lengths=[50, 13, 2, 29, 300, 130], new=[1, 13, 2, 3, 2, 1], dim=dim, kernel="native")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_ragged_paged_attention_without_a_mask_when_nothing_needs_one():
    """Equal full-block lengths with one query each need no mask; the result is still exact."""
    generator = torch.Generator().manual_seed(7)
    got, want, step = _ragged_case(generator, heads=4, kv_heads=2, block_size=4, lengths=[7, 7, 7], new=[1, 1, 1])
    assert step.mask is None
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
