"""The sampling rule as one C++ call on CPU (audio_pipeline_kernels/native_sampler.py) against the torch form."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from audio_pipeline.core.sampler import FLOAT_FIELDS, NUCLEUS_PREFIX, DeviceSamplingRows, SamplingRows, sample_rows
from audio_pipeline_kernels.native_sampler import PREFIX
from audio_pipeline_kernels.native_sampler import native_sampler
from helpers import run_to_completion

pytestmark = pytest.mark.skipif(native_sampler() is None, reason="the native sampler cannot be built here")


def random_rows(generator: np.random.Generator, batch: int, codebook: int, extra: int, *, penalized: bool,
                greedy_share: float = 0.2) -> SamplingRows:
    """Rows with every setting the rule reads drawn at random: temperatures (some greedy), top_k
    (1, within the prefix, past it, unlimited), top_p, min_p, penalties, blocked candidates (stop ids
    off a frame boundary, a forced row allowing one id), the uniform draw."""
    width = codebook + extra
    floats = np.zeros((len(FLOAT_FIELDS), batch), dtype=np.float32)
    floats[0] = np.where(generator.random(batch) < greedy_share, 0.0, generator.uniform(0.05, 2.5, batch))
    floats[1] = generator.choice([1.0, 0.95, 0.8, 0.5, 0.1, 1e-6], batch)
    floats[2] = generator.choice([0.0, 0.0, 0.05, 0.3], batch)
    if penalized:
        floats[3] = generator.choice([1.0, 1.1, 1.5, 0.8], batch)
        floats[4] = generator.choice([0.0, 0.5, -0.5], batch)
        floats[5] = generator.choice([0.0, 1.0, -1.0], batch)
    else:
        floats[3] = 1.0
    floats[6] = np.where(floats[0] > 0, generator.random(batch), 0.0)
    top_k = generator.choice([1, 5, PREFIX, PREFIX + 4, NUCLEUS_PREFIX, NUCLEUS_PREFIX + 36, width, width],
                             batch).astype(np.int64)
    blocked = np.zeros((batch, width), dtype=bool)
    blocked[:, codebook:] = generator.random((batch, extra)) < 0.5
    blocked[:, :codebook] = generator.random((batch, codebook)) < 0.05
    forced = generator.random(batch) < 0.1
    for row in np.flatnonzero(forced):
        blocked[row] = True
        blocked[row, generator.integers(width)] = False
    sampled = [int(k) for k, t in zip(top_k, floats[0]) if t > 0]
    return SamplingRows(codebook, generator.integers(0, 4, batch) * codebook + 10,
                        generator.integers(1, 9, (batch, extra)), blocked, floats, top_k,
                        np.zeros(batch, dtype=np.int64), any_sampling=bool(sampled), penalized=penalized,
                        prefix_suffices=all(k <= NUCLEUS_PREFIX for k in sampled),
                        prefix_may_suffice=all(k <= NUCLEUS_PREFIX or k == width for k in sampled))


def both(scores: torch.Tensor, rows: SamplingRows, counts: torch.Tensor) -> tuple[list[int], list[int]]:
    device_rows = DeviceSamplingRows.copy_of(rows, torch.device("cpu"))
    native = sample_rows(scores, rows, device_rows, counts, sync_free=False)
    spelled = sample_rows(scores, rows, device_rows, counts, sync_free=False, native=False)
    return native.tolist(), spelled.tolist()


@pytest.mark.parametrize("codebook, extra", [(1024, 1), (4096, 2), (100, 3)])
@pytest.mark.parametrize("penalized", [False, True])
def test_the_native_rule_picks_what_the_torch_form_picks(codebook, extra, penalized):
    generator = np.random.default_rng(codebook + extra + penalized)
    picks = set()
    for batch in (1, 3, 32):
        for _ in range(8):
            rows = random_rows(generator, batch, codebook, extra, penalized=penalized)
            # Peaked and flat rows: logits of speech models span both.
            spread = torch.from_numpy(generator.choice([0.5, 3.0, 12.0], (batch, 1)).astype(np.float32))
            scores = torch.from_numpy(generator.standard_normal((batch, codebook + extra)).astype(np.float32)) * spread
            counts = torch.from_numpy(generator.poisson(0.3, (batch, codebook)).astype(np.float32))
            native, spelled = both(scores, rows, counts)
            assert native == spelled, (batch, rows.floats, rows.top_k)
            picks.update(native)
    assert len(picks) > 50  # draws, not one fixed choice


def test_each_rows_pick_depends_on_its_own_row_alone():
    generator = np.random.default_rng(5)
    rows = random_rows(generator, 9, 1024, 1, penalized=True)
    scores = torch.randn(9, 1025) * 4
    counts = torch.from_numpy(generator.poisson(0.3, (9, 1024)).astype(np.float32))
    device_rows = DeviceSamplingRows.copy_of(rows, torch.device("cpu"))
    together = sample_rows(scores, rows, device_rows, counts, sync_free=False).tolist()
    for row in range(9):
        alone = SamplingRows(rows.codebook_size, *(getattr(rows, name)[row:row + 1] for name in
                                                   ("starts", "extra_ids", "blocked")),
                             rows.floats[:, row:row + 1], rows.top_k[row:row + 1], rows.frame_slots[row:row + 1],
                             any_sampling=rows.any_sampling, penalized=True)
        ids = sample_rows(scores[row:row + 1], alone, DeviceSamplingRows.copy_of(alone, torch.device("cpu")),
                          counts[row:row + 1], sync_free=False).tolist()
        assert ids == [together[row]]


def test_extreme_scores_fall_back_to_the_allowed_candidates_as_the_torch_form_does():
    generator = np.random.default_rng(9)
    rows = random_rows(generator, 6, 64, 1, penalized=False, greedy_share=0.5)
    scores = torch.randn(6, 65)
    scores[0] = float("nan")
    scores[1, :10] = float("inf")
    scores[2, 3] = float("nan")
    scores[3] = float("-inf")
    scores[4, 7] = 3e38
    native, spelled = both(scores, rows, torch.zeros(6, 64))
    assert native == spelled
    allowed = [set(np.flatnonzero(~rows.blocked[r])) for r in range(6)]
    for row, pick in enumerate(native):
        column = pick - rows.starts[row] if pick - rows.starts[row] in range(64) else None
        if column is not None:
            assert column in allowed[row]


def test_a_forced_row_gets_its_forced_id_whatever_it_draws():
    generator = np.random.default_rng(2)
    rows = random_rows(generator, 16, 1024, 1, penalized=True, greedy_share=0.0)
    rows.blocked[:] = True
    forced = generator.integers(0, 1024, 16)
    rows.blocked[np.arange(16), forced] = False
    native, spelled = both(torch.randn(16, 1025) * 5, rows, torch.ones(16, 1024))
    assert native == spelled == (rows.starts + forced).tolist()


def test_the_engine_samples_natively_and_speaks_what_the_torch_form_speaks(monkeypatch):
    # The default voice draws twice a pass (the frame's first code with repetition penalties, then
    # the depth head's code): seeded streams give the same frames either way.
    import audio_pipeline_kernels.native_sampler as native
    from audio_pipeline.config import DEFAULT_MODEL, AudioGenerationConfig
    from audio_pipeline.service.engine import TTSEngine

    calls = []
    kernel = native.native_sampler()
    monkeypatch.setattr(native.native_sampler, "kernel", lambda *args: calls.append(args[0].shape[0]) or kernel(*args))
    engine = TTSEngine(AudioGenerationConfig.load(env={}, audio_flags=[], model={"device": "cpu",
                                                                                  "model_path": DEFAULT_MODEL}))
    engine.start()

    def speak():
        contexts = [engine.create_context(text, temperature=1.0, top_p=0.98, seed=seed)
                    for seed, text in enumerate(["Good morning, Anna.", "The museum opens at nine."])]
        run_to_completion(engine, contexts)
        return [(list(c.generated), [list(f) for f in c.frames]) for c in contexts]

    try:
        natively = speak()
        assert calls  # the engine's steps drew through the kernel
        monkeypatch.setattr(native.native_sampler, "kernel", None)
        spelled = speak()
    finally:
        engine.stop()
    assert natively == spelled and all(frames for _, frames in natively)
