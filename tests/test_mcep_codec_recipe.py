"""The recipe's codec diagnostics (recipes/builtin_voice/mcep_codec.py): a round trip that leaves
the envelope or the prosody unquantized really skips that quantization."""

import numpy as np
import torch

from audio_pipeline.decoders.mcep import DEFAULT_CONFIG
from recipes.builtin_voice.mcep_codec import Quantizer, exact_codec

ORDER, BANDS = DEFAULT_CONFIG["order"], len(DEFAULT_CONFIG["aperiodicity_bands"]) - 1


def analysis(frames=30, seed=0):
    rng = np.random.default_rng(seed)
    cepstrum = rng.normal(0, 1, (frames, ORDER + 1)) * 0.5 / np.arange(1, ORDER + 2)
    cepstrum[:, 0] = rng.uniform(-9, -5, frames)
    bands = rng.uniform(-40, -1, (frames, BANDS))
    f0 = np.where(rng.random(frames) < 0.3, 0.0, rng.uniform(100, 250, frames))
    return cepstrum, bands, f0


def test_exact_parts_skip_their_quantization():
    rng = np.random.default_rng(1)
    shipped = Quantizer(rng.normal(0, 0.1, (8, ORDER + BANDS)), {**DEFAULT_CONFIG})
    utterance = analysis()
    cepstrum, bands, f0 = utterance

    coarse = shipped.encode(*utterance)
    assert set(coarse[:, 0]) <= set(range(8))

    decoder, exact = exact_codec(shipped, utterance, ["envelope", "prosody"])
    codes = exact.encode(*utterance)
    # The envelope: each frame is its own codebook entry, exactly as analysed.
    np.testing.assert_array_equal(exact.codebook[codes[:, 0]], np.concatenate([cepstrum[:, 1:], bands], 1))
    # The prosody: 1,024 levels, so F0 comes back within a thousandth of the range per level.
    f0_code, _ = np.divmod(codes[:, 1], 1024)
    assert ((f0_code == 0) == (f0 == 0)).all()
    lo, hi = DEFAULT_CONFIG["log_f0_range"]
    voiced = f0 > 0
    decoded = np.exp(lo + (f0_code[voiced] - 1) / 1023 * (hi - lo))
    inside = (np.log(f0[voiced]) > lo) & (np.log(f0[voiced]) < hi)
    assert np.abs(np.log(decoded[inside] / f0[voiced][inside])).max() <= (hi - lo) / 1023
    frames = np.zeros((len(codes), 4), dtype=np.int64)
    frames[:, 2:] = codes
    audio = decoder.decode(torch.from_numpy(frames.reshape(-1)))
    assert audio.shape == (30 * 320,) and torch.isfinite(audio).all()

    # The envelope alone: the shipped levels stay.
    _, envelope_only = exact_codec(shipped, utterance, ["envelope"])
    assert envelope_only.config["f0_levels"] == DEFAULT_CONFIG["f0_levels"]
    assert np.array_equal(envelope_only.encode(*utterance)[:, 1], coarse[:, 1])


def test_a_codec_translates_each_code_to_the_other_codecs_nearest():
    """Quantizer.translation (train.py --init-codec): to itself, every code is its own; to a codec
    with other levels and entries, each code goes to the entry nearest by the cepstrum (whatever
    the bands' aperiodicity) and to the levels nearest its F0 and gain."""
    rng = np.random.default_rng(2)
    old = Quantizer(rng.normal(0, 0.3, (16, ORDER + BANDS)), {**DEFAULT_CONFIG})
    envelope, prosody = old.translation(old)
    np.testing.assert_array_equal(envelope, np.arange(16))
    np.testing.assert_array_equal(prosody, np.arange(32 * 32))

    # The new codec: old entries shuffled, nudged, their bands flat (a teacher-parameter codec's).
    order = rng.permutation(16)
    entries = old.codebook[order] + rng.normal(0, 0.01, (16, ORDER + BANDS))
    entries[:, ORDER:] = -60.0
    lo, hi = DEFAULT_CONFIG["log_f0_range"]
    narrow = {**DEFAULT_CONFIG, "log_f0_range": [lo + (hi - lo) * 10 / 30, lo + (hi - lo) * 20 / 30],
              "gain_range": DEFAULT_CONFIG["gain_range"]}
    new = Quantizer(entries, narrow)
    envelope, prosody = new.translation(old)
    np.testing.assert_array_equal(envelope, order)
    f0_code, gain = np.divmod(prosody, 32)
    # Unvoiced stays unvoiced; the narrow range's 31 levels land on the old levels 10..20 in order.
    assert (f0_code[:32] == 0).all() and (gain[:32] == np.arange(32)).all()
    new_f0 = np.repeat(np.arange(1, 32), 32)
    expected = 1 + np.round(10 + (new_f0 - 1) / 30 * 10)
    np.testing.assert_array_equal(f0_code[32:], expected)
    np.testing.assert_array_equal(gain[32:], np.tile(np.arange(32), 31))
