"""Paged attention: the step metadata builder against a plain reader of its format, and every
backend available here against plain causal attention over each sequence's contiguous keys/values."""

import platform

import numpy as np
import pytest
import torch

from audio_pipeline_kernels import (NativeBackend, StepMetadata, allocate_paged_cache, causal_attention_reference,
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
    # The reader of the metadata sees what the cache holds: the keys and values rounded to its dtype.
    stored = _contiguous_attention(query, _rounded(contiguous, dtype), new)
    torch.testing.assert_close(paged_attention_reference(query.to(device), key_cache.float(), value_cache.float(),
                                                         metadata).cpu(), stored, atol=1e-5, rtol=1e-5)
    chosen = select_attention_backend(backend, torch.device(device), dtype, num_heads=heads, num_kv_heads=kv_heads,
                                      head_dim=dim, page_size=page_size)
    assert chosen.name == backend
    got = chosen.plan(metadata).attend(query.to(device, dtype), key_cache, value_cache).float().cpu()
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("backend", [b for b in available_backends() if b != "flashinfer"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("window", [1, 5, 16, 40])
@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("dim", [8, 64])
def test_a_sliding_window_equals_windowed_contiguous_attention(backend, page_size, window, mix, dim):
    """With a sliding window (a query sees the ``window`` positions ending at its own) each backend
    equals plain windowed attention over each sequence's contiguous keys and values, for decode
    rows, multi-token rows, whole prompts and mixed steps, windows shorter than a page, across
    pages and longer than some sequences; and the windowed reference differs from the unwindowed
    one wherever a sequence is longer than the window."""
    lengths, new = MIXES[mix]
    generator = torch.Generator().manual_seed(page_size * 1000 + window)
    key_cache, value_cache, metadata, query, contiguous = _ragged_case(
        generator, heads=4, kv_heads=2, page_size=page_size, lengths=lengths, new=new, dim=dim)
    rows = np.cumsum([0, *new])
    want = torch.cat([causal_attention_reference(query[a:b], k, v, window=window)
                      for a, b, (k, v) in zip(rows[:-1], rows[1:], contiguous)])
    if max(lengths) > window:
        assert not torch.allclose(want, _contiguous_attention(query, contiguous, new))
    torch.testing.assert_close(paged_attention_reference(query, key_cache, value_cache, metadata, window=window),
                               want, atol=1e-5, rtol=1e-5)
    chosen = select_attention_backend(backend, torch.device("cpu"), torch.float32, num_heads=4, num_kv_heads=2,
                                      head_dim=dim, page_size=page_size, window=window)
    torch.testing.assert_close(chosen.plan(metadata).attend(query, key_cache, value_cache), want,
                               atol=1e-5, rtol=1e-5)


def test_a_window_is_not_passed_to_flashinfer_and_says_so():
    with pytest.raises(ValueError, match="sliding attention window"):
        select_attention_backend("flashinfer", torch.device("cpu"), torch.float32, num_heads=4, num_kv_heads=2,
                                 head_dim=64, page_size=16, window=8)


#: How far attention over a 16-bit cache may be from attention over the float32 keys and values
#: it holds rounded (max abs difference of outputs; random normal queries, keys and values). Measured
#: on the cases below: bfloat16 (8 significant bits) 8.3e-3, float16 (11) 1.0e-3; the bounds are
#: 2.5-3 times that.
CACHE_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 3e-3}
CACHE_DTYPES = pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16],
                                       ids=["float32", "bfloat16", "float16"])


def _rounded(contiguous, dtype):
    """Each sequence's keys and values as a cache of ``dtype`` holds them, back in float32."""
    return [(k.to(dtype).float(), v.to(dtype).float()) for k, v in contiguous]


@CACHE_DTYPES
@pytest.mark.parametrize("dim", [32, 48, 64, 96, 128, 40])
@pytest.mark.parametrize("page_size", [4, 128])
def test_native_kernel_at_real_head_sizes(dim, page_size, cache_dtype):
    """The native kernel unrolls the common head sizes (32 ... 128) into vector loads and loops over
    any other (40), widening a 16-bit cache to float32 as it reads it: each equals contiguous
    float32 attention over the keys and values the cache holds (float32 rounding: the widening is
    exact), on a mixed ragged step with forced-token rows. The new keys and values go in through
    write_paged_kv, which rounds them to the cache's dtype."""
    if "native" not in available_backends():
        pytest.skip("the native kernel cannot be built here (no C++ compiler)")
    generator = torch.Generator().manual_seed(dim + page_size)
    lengths, new = [50, 13, 2, 29, 300, 130], [1, 13, 2, 3, 2, 1]
    key_cache, value_cache, metadata, query, contiguous = _ragged_case(
        generator, heads=4, kv_heads=2, page_size=page_size, lengths=lengths, new=new, dim=dim, dtype=cache_dtype)
    assert key_cache.dtype == value_cache.dtype == cache_dtype
    backend = select_attention_backend("native", torch.device("cpu"), torch.float32, num_heads=4, num_kv_heads=2,
                                       head_dim=dim, page_size=page_size, cache_dtype=cache_dtype)
    got = backend.plan(metadata).attend(query, key_cache, value_cache)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, _contiguous_attention(query, _rounded(contiguous, cache_dtype), new),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("page_size", [1, 16, 128])
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_native_kernel_over_a_16_bit_cache_is_within_its_tolerance(mix, page_size, cache_dtype):
    """Against attention over the unrounded float32 keys and values, a 16-bit cache costs at most
    CACHE_TOLERANCE[dtype], at the built-in voice's head size (the vector loads) and at 8 (the
    portable loops), for every ragged mix; over the rounded ones it is exact to float32 rounding."""
    if "native" not in available_backends():
        pytest.skip("the native kernel cannot be built here (no C++ compiler)")
    lengths, new = MIXES[mix]
    for dim in (48, 8):
        generator = torch.Generator().manual_seed(page_size * 10 + dim)
        key_cache, value_cache, metadata, query, contiguous = _ragged_case(
            generator, heads=4, kv_heads=2, page_size=page_size, lengths=lengths, new=new, dim=dim,
            dtype=cache_dtype)
        backend = select_attention_backend("native", torch.device("cpu"), torch.float32, num_heads=4,
                                           num_kv_heads=2, head_dim=dim, page_size=page_size, cache_dtype=cache_dtype)
        got = backend.plan(metadata).attend(query, key_cache, value_cache)
        torch.testing.assert_close(got, _contiguous_attention(query, _rounded(contiguous, cache_dtype), new),
                                   atol=1e-5, rtol=1e-5)
        tolerance = CACHE_TOLERANCE[cache_dtype]
        torch.testing.assert_close(got, _contiguous_attention(query, contiguous, new), atol=tolerance, rtol=0)


@pytest.mark.slow
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86-64 instruction sets")
@pytest.mark.parametrize("target", [["-march=x86-64"], ["-march=x86-64", "-mavx2", "-mfma", "-mf16c"]],
                         ids=["portable", "avx2"])
def test_native_kernel_builds_for_other_instruction_sets(target):
    """The kernel built for a baseline x86-64 (no F16C or AVX2: the portable loops ARM builds too)
    and for AVX2 with FMA and F16C (where this machine may have AVX-512) reads each cache dtype as
    the default build does: contiguous attention over the keys and values the cache holds."""
    from audio_pipeline_kernels.native_paged_attention import build_native_attention

    if "native" not in available_backends():
        pytest.skip("the native kernel cannot be built here (no C++ compiler)")
    kernel = build_native_attention(target)
    lengths, new = [50, 13, 2, 29, 300, 130], [1, 13, 2, 3, 2, 1]
    for cache_dtype in (torch.float32, torch.bfloat16, torch.float16):
        for dim in (48, 128, 40):
            generator = torch.Generator().manual_seed(dim)
            key_cache, value_cache, metadata, query, contiguous = _ragged_case(
                generator, heads=4, kv_heads=2, page_size=16, lengths=lengths, new=new, dim=dim, dtype=cache_dtype)
            got = NativeBackend(kernel, dim ** -0.5).plan(metadata).attend(query, key_cache, value_cache)
            torch.testing.assert_close(got, _contiguous_attention(query, _rounded(contiguous, cache_dtype), new),
                                       atol=1e-5, rtol=1e-5)


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
    with pytest.raises(ValueError, match="attention_kernel=native.*float32 model"):
        select_attention_backend("native", cpu, torch.bfloat16, num_heads=4, num_kv_heads=2, head_dim=8,
                                 page_size=4)
    assert select_attention_backend("auto", cpu, torch.bfloat16, num_heads=4, num_kv_heads=2, head_dim=8,
                                    page_size=4).name == "torch"
    # A float32 model with a 16-bit cache: the native kernel, asked for or not; an fp8 cache: the torch form.
    if "native" in available_backends():
        for name in ("auto", "native"):
            for cache_dtype in (torch.bfloat16, torch.float16):
                assert select_attention_backend(name, cpu, torch.float32, num_heads=4, num_kv_heads=2, head_dim=8,
                                                page_size=4, cache_dtype=cache_dtype).name == "native"
    with pytest.raises(ValueError, match="attention_kernel=native.*float16 or bfloat16 cache"):
        select_attention_backend("native", cpu, torch.float32, num_heads=4, num_kv_heads=2, head_dim=8,
                                 page_size=4, cache_dtype=torch.float8_e4m3fn)
    assert select_attention_backend("auto", cpu, torch.float32, num_heads=4, num_kv_heads=2, head_dim=8,
                                    page_size=4, cache_dtype=torch.float8_e4m3fn).name == "torch"


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


def test_the_attention_benchmark_compares_cache_dtypes_against_the_read_floor(capsys):
    """python -m audio_pipeline.bench.attention --cache-dtypes: a row per cache dtype and batch, with
    the bytes it reads, its rate and its time over the read-bandwidth floor (never asserted)."""
    import re

    from audio_pipeline.bench.attention import main

    threads = torch.get_num_threads()
    try:
        assert main(["--device", "cpu", "--cache-dtypes", "float32,bfloat16,float16", "--batches", "1,2",
                     "--context", "40", "--page-sizes", "16", "--rounds", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert re.search(r"^read-bandwidth floor: [\d.]+ GB/s", out, re.M)
    rows = re.findall(r"^\s*(\w+)\s+(\w+)\s+(\d+)\s+([\d.]+)\s+[\d.]+\s+\([\d.-]+\)\s+[\d.]+\s+[\d.]+$", out, re.M)
    assert [(dtype, int(batch)) for dtype, _, batch, _ in rows] == [
        (dtype, batch) for dtype in ("float32", "bfloat16", "float16") for batch in (1, 2)]
    # 4 layers x keys and values x 40 tokens x 4 kv heads x 48 per sequence, at each dtype's width.
    assert [float(mb) for *_, mb in rows] == [round(b * 2 * 4 * 40 * 4 * 48 * width / 1e6, 2)
                                              for width in (4, 2, 2) for b in (1, 2)]
    if "native" in available_backends():
        assert {backend for _, backend, *_ in rows} == {"native"}


@pytest.mark.parametrize("head_dim", [16, 48, 96])
def test_a_model_flashinfer_has_no_kernels_for_takes_the_torch_form_on_cuda_and_says_why(head_dim, caplog):
    """FlashInfer instantiates head sizes 64, 128 and 256 only: on CUDA a model of another size (the
    tiny test models' 16, the built-in voices' 48) gets the torch form with a start-up warning that
    names the head size, and asking for flashinfer is refused naming it. Nothing runs on the
    device here, so this holds without a GPU."""
    from audio_pipeline_kernels.flashinfer_attention import flashinfer_unavailable

    cuda = torch.device("cuda")
    reason = flashinfer_unavailable(head_dim, torch.bfloat16, torch.bfloat16)
    assert reason is not None and f"head_dim {head_dim}" in reason
    with caplog.at_level("WARNING", logger="audio_pipeline_kernels.backends"):
        chosen = select_attention_backend("auto", cuda, torch.bfloat16, num_heads=4, num_kv_heads=2,
                                          head_dim=head_dim, page_size=16)
    assert chosen.name == "torch"
    assert f"head_dim {head_dim}" in caplog.text and "torch form" in caplog.text
    with pytest.raises(ValueError, match=f"attention_kernel=flashinfer: head_dim {head_dim}"):
        select_attention_backend("flashinfer", cuda, torch.bfloat16, num_heads=4, num_kv_heads=2,
                                 head_dim=head_dim, page_size=16)


def test_flashinfer_is_refused_for_dtypes_it_has_no_kernels_for():
    from audio_pipeline_kernels.flashinfer_attention import flashinfer_unavailable

    assert "float32" in flashinfer_unavailable(128, torch.float32, torch.float32)
    for head_dim in (64, 128, 256):  # a shape it has kernels for: only the package may be missing
        reason = flashinfer_unavailable(head_dim, torch.bfloat16, torch.float8_e4m3fn)
        assert reason is None or "not installed" in reason


def test_the_prefill_kernel_choice_is_checked_and_names_its_setting():
    from audio_pipeline.config import AudioGenerationConfig

    with pytest.raises(ValueError, match="model.kv_cache.prefill_backend"):
        select_attention_backend("auto", torch.device("cpu"), torch.float32, num_heads=4, num_kv_heads=2, head_dim=8,
                                 page_size=4, prefill_backend="fa9")
    with pytest.raises(ValueError, match="prefill_backend"):
        AudioGenerationConfig.load(env={}, audio_flags=["model.kv_cache.prefill_backend=fa9"])
    config = AudioGenerationConfig.load(env={}, audio_flags=["model.kv_cache.prefill_backend=fa2"])
    assert config.model.kv_cache.prefill_backend == "fa2"


def test_the_set_up_builds_every_native_kernel_ahead_of_its_first_use():
    """`python -m audio_pipeline_kernels.build` (scripts/setup.sh runs it) leaves the three kernels
    built, so a server's first request finds them; it says so and succeeds."""
    import subprocess
    import sys

    if "native" not in available_backends():
        pytest.skip("the native kernels cannot be built here (no C++ compiler)")
    done = subprocess.run([sys.executable, "-m", "audio_pipeline_kernels.build"], capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr
    assert "native CPU kernels: 3 of 3 ready" in done.stderr
