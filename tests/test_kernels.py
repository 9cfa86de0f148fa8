"""Paged attention: the step metadata builder against a plain reader of its format, and every
backend available here against plain causal attention over each sequence's contiguous keys/values."""

import numpy as np
import pytest
import torch

from audio_pipeline_kernels import (StepMetadata, allocate_paged_cache, causal_attention_reference,
                                    paged_attention_reference, read_sequence_kv, select_attention_backend,
                                    write_paged_kv)

MIXES = {
    "decode": ([9, 33, 17, 1], [1, 1, 1, 1]),
    "forced": ([12, 40, 7, 3], [3, 1, 2, 3]),
    "prefill": ([5, 31, 64], [5, 31, 64]),
    "mixed": ([50, 13, 2, 29, 8], [1, 13, 2, 3, 5]),
}


def available_backends():
    names = ["torch"]
    try:
        select_attention_backend("native", torch.device("cpu"), torch.float32, num_heads=4, num_kv_heads=2,
                                 head_dim=8, page_size=4)
        names.append("native")
    except ValueError:
        pass
    if torch.cuda.is_available():
        names.append("flashinfer")
    return names


def _ragged_case(generator, *, heads, kv_heads, page_size, lengths, new, dim=8, device="cpu",
                 dtype=torch.float32):
    """A paged cache holding random sequences in scattered pages (their new tokens written through
    the step's slot mapping, as the model does), the step's metadata, its queries, and each
    sequence's contiguous keys/values."""
    num_pages = sum(-(-n // page_size) for n in lengths) + 4
    [key_cache], [value_cache] = allocate_paged_cache(1, num_pages, page_size, kv_heads, dim, dtype,
                                                      torch.device(device))
    free = torch.randperm(num_pages, generator=generator).tolist()
    tables, contiguous = [], []
    for length in lengths:
        pages = [free.pop() for _ in range(-(-length // page_size))]
        tables.append(pages + [free[0]])  # a spare page past the end: never read
        contiguous.append((torch.randn(length, kv_heads, dim, generator=generator),
                           torch.randn(length, kv_heads, dim, generator=generator)))
    metadata = StepMetadata.build(tables, [n - q for n, q in zip(lengths, new)], new, page_size)
    # Earlier tokens through one write of all of them, the new ones through the step's own slots.
    old = [(k[:n - q], v[:n - q]) for (k, v), n, q in zip(contiguous, lengths, new)]
    old_meta = [(t, n - q) for t, n, q in zip(tables, lengths, new) if n > q]
    if old_meta:
        before = StepMetadata.build([t for t, _ in old_meta], [0] * len(old_meta), [n for _, n in old_meta],
                                    page_size)
        write_paged_kv(key_cache, value_cache, torch.cat([k for k, _ in old if len(k)]).to(device),
                       torch.cat([v for _, v in old if len(v)]).to(device),
                       torch.from_numpy(before.slot_mapping).to(device))
    new_k = torch.cat([k[n - q:] for (k, _), n, q in zip(contiguous, lengths, new)])
    new_v = torch.cat([v[n - q:] for (_, v), n, q in zip(contiguous, lengths, new)])
    write_paged_kv(key_cache, value_cache, new_k.to(device), new_v.to(device),
                   torch.from_numpy(metadata.slot_mapping).to(device))
    query = torch.randn(sum(new), heads, dim, generator=generator)
    return key_cache, value_cache, metadata, query, contiguous


def _contiguous_attention(query, contiguous, new):
    rows = np.cumsum([0, *new])
    return torch.cat([causal_attention_reference(query[a:b], k, v)
                      for a, b, (k, v) in zip(rows[:-1], rows[1:], contiguous)])


@pytest.mark.parametrize("page_size", [1, 4, 16, 128])
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_metadata_is_read_back_as_each_sequence_contiguous_cache(page_size, mix):
    """The builder's page lists (FlashInfer's indptr / indices / last-page-length form) read with
    plain torch give back every sequence's keys and values, and its slot mapping put the new
    tokens where that reader finds them."""
    lengths, new = MIXES[mix]
    generator = torch.Generator().manual_seed(page_size)
    key_cache, value_cache, metadata, _, contiguous = _ragged_case(
        generator, heads=4, kv_heads=2, page_size=page_size, lengths=lengths, new=new)
    assert metadata.qo_indptr.tolist() == np.cumsum([0, *new]).tolist()
    assert metadata.seq_lens.tolist() == lengths
    for b, length in enumerate(lengths):
        pages = metadata.kv_indptr[b + 1] - metadata.kv_indptr[b]
        assert (pages - 1) * page_size + metadata.kv_last_page_len[b] == length
        assert 1 <= metadata.kv_last_page_len[b] <= page_size
        torch.testing.assert_close(read_sequence_kv(key_cache, metadata, b), contiguous[b][0], rtol=0, atol=0)
        torch.testing.assert_close(read_sequence_kv(value_cache, metadata, b), contiguous[b][1], rtol=0, atol=0)
    for array in (metadata.qo_indptr, metadata.kv_indptr, metadata.kv_indices, metadata.kv_last_page_len):
        assert array.dtype == np.int32
    assert metadata.positions.tolist() == [p for n, q in zip(lengths, new) for p in range(n - q, n)]


def test_metadata_refuses_a_sequence_without_its_pages():
    with pytest.raises(RuntimeError, match="not allocated"):
        StepMetadata.build([[0, 1]], [7], [2], 4)


@pytest.mark.parametrize("backend", available_backends())
@pytest.mark.parametrize("page_size", [1, 4, 16, 128])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_every_backend_equals_contiguous_attention(backend, page_size, heads, kv_heads, mix):
    """Each backend available here (the torch form, the native CPU kernel that reads the cache in
    place, FlashInfer on CUDA) equals per-sequence causal attention over contiguous KV for decode
    rows, multi-token rows (forced tokens), whole prompts and mixed steps, at several page sizes and
    with grouped-query attention; so does the plain reader of the metadata."""
    lengths, new = MIXES[mix]
    generator = torch.Generator().manual_seed(page_size * 100 + heads * 10 + kv_heads)
    device = "cuda" if backend == "flashinfer" else "cpu"
    dim = 64 if backend == "flashinfer" else 8  # FlashInfer's smallest head size
    dtype = torch.bfloat16 if backend == "flashinfer" else torch.float32
    key_cache, value_cache, metadata, query, contiguous = _ragged_case(
        generator, heads=heads, kv_heads=kv_heads, page_size=page_size, lengths=lengths, new=new, dim=dim,
        device=device, dtype=dtype)
    want = _contiguous_attention(query, contiguous, new)
    torch.testing.assert_close(paged_attention_reference(query.to(device), key_cache.float(), value_cache.float(),
                                                         metadata).cpu(), want, atol=1e-5, rtol=1e-5)
    chosen = select_attention_backend(backend, torch.device(device), dtype, num_heads=heads, num_kv_heads=kv_heads,
                                      head_dim=dim, page_size=page_size)
    assert chosen.name == backend
    got = chosen.plan(metadata).attend(query.to(device, dtype), key_cache, value_cache).float().cpu()
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dim", [32, 48, 64, 96, 128, 40])
@pytest.mark.parametrize("page_size", [4, 128])
def test_native_kernel_at_real_head_sizes(dim, page_size):
    """The native kernel unrolls the common head sizes (32 ... 128) and loops over any other (40):
    both equal contiguous attention on a mixed ragged step with forced-token rows."""
    if "native" not in available_backends():
        pytest.skip("the native kernel cannot be built here (no C++ compiler)")
    generator = torch.Generator().manual_seed(dim + page_size)
    lengths, new = [50, 13, 2, 29, 300, 130], [1, 13, 2, 3, 2, 1]
    key_cache, value_cache, metadata, query, contiguous = _ragged_case(
        generator, heads=4, kv_heads=2, page_size=page_size, lengths=lengths, new=new, dim=dim)
    backend = select_attention_backend("native", torch.device("cpu"), torch.float32, num_heads=4, num_kv_heads=2,
                                       head_dim=dim, page_size=page_size)
    got = backend.plan(metadata).attend(query, key_cache, value_cache)
    torch.testing.assert_close(got, _contiguous_attention(query, contiguous, new), atol=1e-5, rtol=1e-5)


def test_torch_form_needs_no_mask_when_nothing_needs_one():
    """Equal lengths with one query each need no mask; the result is still exact."""
    generator = torch.Generator().manual_seed(7)
    key_cache, value_cache, metadata, query, contiguous = _ragged_case(
        generator, heads=4, kv_heads=2, page_size=4, lengths=[7, 7, 7], new=[1, 1, 1])
    backend = select_attention_backend("torch", torch.device("cpu"), torch.float32, num_heads=4, num_kv_heads=2,
                                       head_dim=8, page_size=4)
    plan = backend.plan(metadata)
    assert plan.step.mask is None
    torch.testing.assert_close(plan.attend(query, key_cache, value_cache),
                               _contiguous_attention(query, contiguous, [1, 1, 1]), atol=1e-5, rtol=1e-5)


def test_backend_choice_names_the_setting():
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="attention_kernel=flashinfer runs on CUDA only"):
        select_attention_backend("flashinfer", cpu, torch.float32, num_heads=4, num_kv_heads=2, head_dim=8,
                                 page_size=4)
    with pytest.raises(ValueError, match="attention_kernel=native.*float32"):
        select_attention_backend("native", cpu, torch.bfloat16, num_heads=4, num_kv_heads=2, head_dim=8,
                                 page_size=4)
    assert select_attention_backend("auto", cpu, torch.bfloat16, num_heads=4, num_kv_heads=2, head_dim=8,
                                    page_size=4).name == "torch"


def test_the_attention_benchmark_times_every_backend_at_every_page_size(capsys):
    """python -m audio_pipeline.bench.attention: one row per backend that runs here and page size
    (times are never asserted)."""
    import re

    from audio_pipeline.bench.attention import main

    threads = torch.get_num_threads()
    try:
        assert main(["--device", "cpu", "--batches", "1,2", "--context", "40", "--page-sizes", "16,128"]) == 0
    finally:
        torch.set_num_threads(threads)
    rows = re.findall(r"^\s+(\w+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)$", capsys.readouterr().out, re.M)
    assert {(name, int(page)) for name, page, *_ in rows} == {(b, p) for b in available_backends() for p in (16, 128)}
