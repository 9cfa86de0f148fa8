"""Prototype of the built-in voice's codec: a source-filter (LPC) vocoder, 50 frames per second.

Analysis of a 16 kHz waveform, per 20 ms frame (40 ms Hann window):
- spectral envelope: order-16 LPC by autocorrelation and Levinson-Durbin, kept as log-area ratios
  (stable under averaging and vector quantisation);
- gain: the prediction error energy;
- F0: normalised autocorrelation peak between 60 and 400 Hz; 0 when unvoiced.
Synthesis: a pulse train at F0 with continuous phase (voiced) or white noise (unvoiced), through the
all-pole filter, whose state carries over frame to frame: causal, and exactly streamable.

    python -m recipes.builtin_voice.lpc_codec --evaluate      # round-trip intelligibility vs eSpeak NG
"""

from __future__ import annotations

import argparse

import numpy as np
import soxr
from scipy.signal import lfilter

RATE = 16000
HOP = 320
WINDOW = 640
ORDER = 16
F0_MIN, F0_MAX = 60.0, 400.0


def levinson(r: np.ndarray, order: int) -> tuple[np.ndarray, np.ndarray, float]:
    """Autocorrelation -> (LPC polynomial a[0..order] with a[0]=1, reflection coefficients, error)."""
    a = np.zeros(order + 1)
    a[0] = 1.0
    k = np.zeros(order)
    error = r[0]
    for i in range(1, order + 1):
        acc = r[i] + np.dot(a[1:i], r[i - 1:0:-1])
        ki = -acc / error if error > 0 else 0.0
        ki = float(np.clip(ki, -0.999, 0.999))
        k[i - 1] = ki
        a[1:i] = a[1:i] + ki * a[i - 1:0:-1]
        a[i] = ki
        error *= 1 - ki * ki
    return a, k, error


def reflection_to_lpc(k: np.ndarray) -> np.ndarray:
    a = np.zeros(len(k) + 1)
    a[0] = 1.0
    for i, ki in enumerate(k, 1):
        a[1:i] = a[1:i] + ki * a[i - 1:0:-1]
        a[i] = ki
    return a


def lar(k: np.ndarray) -> np.ndarray:
    return np.log((1 + k) / (1 - k))


def lar_to_reflection(values: np.ndarray) -> np.ndarray:
    return np.tanh(values / 2)


def analyse(samples: np.ndarray, rate: int) -> dict[str, np.ndarray]:
    """Per-frame parameters: 'lar' [F, ORDER], 'gain' [F], 'f0' [F] (0 = unvoiced)."""
    if rate != RATE:
        samples = soxr.resample(samples.astype(np.float32), rate, RATE)
    x = np.concatenate([np.zeros(WINDOW // 2), samples.astype(np.float64), np.zeros(WINDOW)])
    x = np.append(x[0], x[1:] - 0.9 * x[:-1])  # pre-emphasis
    frames = len(samples) // HOP
    window = np.hanning(WINDOW)
    lars, gains, f0s = [], [], []
    lags = np.arange(int(RATE / F0_MAX), int(RATE / F0_MIN) + 1)
    for f in range(frames):
        seg = x[f * HOP:f * HOP + WINDOW] * window
        r = np.correlate(seg, seg, "full")[WINDOW - 1:WINDOW + ORDER]
        r[0] *= 1.0001
        r[0] += 1e-9
        _, k, error = levinson(r, ORDER)
        lars.append(lar(k))
        gains.append(max(error, 1e-10) / WINDOW)
        full = np.correlate(seg, seg, "full")[WINDOW - 1:]
        norm = full[0] + 1e-12
        peak = lags[np.argmax(full[lags])]
        voiced = full[peak] / norm > 0.35 and norm / WINDOW > 1e-6
        f0s.append(RATE / peak if voiced else 0.0)
    return {"lar": np.array(lars), "gain": np.array(gains), "f0": np.array(f0s)}


class Synthesizer:
    """Stateful synthesis: filter memory, pulse phase and noise generator carry across calls."""

    def __init__(self, seed: int = 0):
        self.zi = np.zeros(ORDER)
        self.phase = 0.0
        self.rng = np.random.default_rng(seed)
        self.deemphasis = 0.0

    def __call__(self, params: dict[str, np.ndarray]) -> np.ndarray:
        out = []
        for lar_f, gain, f0 in zip(params["lar"], params["gain"], params["f0"]):
            a = reflection_to_lpc(lar_to_reflection(lar_f))
            if f0 > 0:
                excitation = np.zeros(HOP)
                period = RATE / f0
                for n in range(HOP):
                    self.phase += 1.0 / period
                    if self.phase >= 1.0:
                        self.phase -= 1.0
                        excitation[n] = np.sqrt(period)
            else:
                excitation = self.rng.standard_normal(HOP)
            y, self.zi = lfilter([np.sqrt(gain)], a, excitation, zi=self.zi)
            out.append(y)
        y = np.concatenate(out) if out else np.zeros(0)
        # De-emphasis (inverse of the analysis pre-emphasis), with its own state.
        y, (self.deemphasis,) = lfilter([1.0], [1.0, -0.9], y, zi=[self.deemphasis])
        return np.clip(y, -1, 1).astype(np.float32)


F0_LEVELS = 63  # voiced levels; code 0 is unvoiced
GAIN_LEVELS = 32
LOG_F0 = (np.log(F0_MIN), np.log(F0_MAX))
LOG_GAIN = (-23.0, -4.0)


def _uniform(values: np.ndarray, bounds: tuple[float, float], levels: int) -> np.ndarray:
    lo, hi = bounds
    return np.clip(np.round((values - lo) / (hi - lo) * (levels - 1)), 0, levels - 1).astype(np.int64)


def _level(codes: np.ndarray, bounds: tuple[float, float], levels: int) -> np.ndarray:
    lo, hi = bounds
    return lo + codes / (levels - 1) * (hi - lo)


class Quantizer:
    """Frame parameters <-> three codes: envelope (k-means over LAR vectors), F0 level, gain level."""

    def __init__(self, centroids: np.ndarray):
        self.centroids = centroids

    @classmethod
    def fit(cls, lars: np.ndarray, size: int = 1024, iterations: int = 20, seed: int = 0) -> "Quantizer":
        import torch

        data = torch.from_numpy(lars).float()
        generator = torch.Generator().manual_seed(seed)
        centroids = data[torch.randperm(len(data), generator=generator)[:size]].clone()
        for _ in range(iterations):
            assign = torch.cdist(data, centroids).argmin(dim=1)
            sums = torch.zeros_like(centroids).index_add_(0, assign, data)
            counts = torch.bincount(assign, minlength=size).float()[:, None]
            empty = counts[:, 0] == 0
            centroids = torch.where(empty[:, None], data[torch.randint(len(data), (size,), generator=generator)],
                                    sums / counts.clamp_min(1))
        return cls(centroids.numpy().astype(np.float64))

    def encode(self, params: dict[str, np.ndarray]) -> np.ndarray:
        """[F, 3] codes: envelope, F0 (0 unvoiced, else 1 + level), gain."""
        import torch

        envelope = torch.cdist(torch.from_numpy(params["lar"]).float(),
                               torch.from_numpy(self.centroids).float()).argmin(dim=1).numpy()
        f0 = params["f0"]
        f0_code = np.where(f0 > 0, 1 + _uniform(np.log(np.maximum(f0, 1e-3)), LOG_F0, F0_LEVELS), 0)
        gain_code = _uniform(np.log(params["gain"]), LOG_GAIN, GAIN_LEVELS)
        return np.stack([envelope, f0_code, gain_code], axis=1)

    def decode(self, codes: np.ndarray) -> dict[str, np.ndarray]:
        f0 = np.where(codes[:, 1] > 0, np.exp(_level(np.maximum(codes[:, 1] - 1, 0), LOG_F0, F0_LEVELS)), 0.0)
        return {"lar": self.centroids[codes[:, 0]], "f0": f0,
                "gain": np.exp(_level(codes[:, 2], LOG_GAIN, GAIN_LEVELS))}


def main(argv: list[str] | None = None) -> int:
    import tempfile

    from recipes.builtin_voice.corpus import held_out, sentences
    from recipes.builtin_voice.espeak import ESpeak
    from recipes.builtin_voice.evaluate import evaluate

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--evaluate", action="store_true")
    parser.add_argument("--write", help="write one round-trip example WAV here")
    parser.add_argument("--quantize", type=int, default=0, metavar="N",
                        help="fit the envelope codebook on N training sentences and round-trip through codes")
    args = parser.parse_args(argv)
    engine = ESpeak()
    quantizer = None
    if args.quantize:
        lars = np.concatenate([analyse(u.samples, u.sample_rate)["lar"] for u in
                               (engine.synthesize(t) for t in sentences(args.quantize, seed=7))])
        quantizer = Quantizer.fit(lars)
        print(f"envelope codebook fitted on {len(lars)} frames")

    def round_trip(text: str):
        u = engine.synthesize(text)
        params = analyse(u.samples, u.sample_rate)
        if quantizer is not None:
            params = quantizer.decode(quantizer.encode(params))
        return Synthesizer()(params), RATE

    if args.write:
        import soundfile as sf

        audio, rate = round_trip("Tomorrow Anna will clean seven noisy guitars.")
        sf.write(args.write, audio, rate)
    if args.evaluate:
        test = held_out(40, train=sentences(6000))
        with tempfile.NamedTemporaryFile(suffix=".jsgf") as grammar:
            result = evaluate(test, round_trip, grammar.name)
        print(f"LPC round trip: closed-set identification {result['identified']}/{result['sentences']} "
              f"({result['accuracy']:.0%}), WER {result['wer']:.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
