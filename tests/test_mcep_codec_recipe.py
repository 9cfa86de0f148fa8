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
