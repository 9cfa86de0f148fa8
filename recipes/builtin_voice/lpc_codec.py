"""Analysis side of the built-in voice's codec, a source-filter (LPC) vocoder at 50 frames per second
(the synthesis side is the engine's ``lpc`` decoder, audio_pipeline/decoders/lpc.py).

Analysis of a 16 kHz waveform, per 20 ms frame (40 ms Hann window):
- spectral envelope: order-16 LPC by autocorrelation and Levinson-Durbin, kept as log-area ratios
  (stable under averaging and vector quantisation);
- gain: the prediction error energy;
- F0: normalised autocorrelation peak between 60 and 300 Hz; 0 when unvoiced.
Quantisation (:class:`Quantizer`): a 1024-entry k-means codebook of LAR vectors, and one prosody
code per frame (F0 level x gain level).

    python -m recipes.builtin_voice.lpc_codec --evaluate      # round-trip intelligibility vs eSpeak NG
"""

from __future__ import annotations

import argparse

import numpy as np

from audio_pipeline.decoders.lpc import DEFAULT_CONFIG as DECODER_CONFIG

RATE = 16000
HOP = 320
WINDOW = 640
ORDER = 16
F0_MIN, F0_MAX = 60.0, 300.0  # the pitch search range (eSpeak's en-us voice stays within it)


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


def analyse(samples: np.ndarray, rate: int, frames: int | None = None) -> dict[str, np.ndarray]:
    """Per-frame parameters: 'lar' [F, ORDER], 'gain' [F], 'f0' [F] (0 = unvoiced); F is ``frames``
    (the audio is cut or padded with silence to fit) or as many whole frames as there are."""
    if rate != RATE:
        import soxr

        samples = soxr.resample(samples.astype(np.float32), rate, RATE)
    # Frame f's window is centred on the middle of its output interval [f * HOP, (f + 1) * HOP).
    x = np.concatenate([np.zeros(WINDOW // 2 - HOP // 2), samples.astype(np.float64), np.zeros(WINDOW)])
    x = np.append(x[0], x[1:] - 0.9 * x[:-1])  # pre-emphasis
    frames = len(samples) // HOP if frames is None else frames
    if frames * HOP > len(samples):
        x = np.concatenate([x, np.zeros(frames * HOP - len(samples))])
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


def _uniform(values: np.ndarray, bounds: tuple[float, float], levels: int) -> np.ndarray:
    lo, hi = bounds
    return np.clip(np.round((values - lo) / (hi - lo) * (levels - 1)), 0, levels - 1).astype(np.int64)


class Quantizer:
    """Frame parameters -> the lpc decoder's two codes per frame: envelope (k-means over LAR
    vectors) and prosody (F0 level, 0 = unvoiced, times the gain levels, plus the gain level)."""

    def __init__(self, centroids: np.ndarray):
        self.centroids = centroids
        self.f0_levels = DECODER_CONFIG["f0_levels"]
        self.gain_levels = DECODER_CONFIG["gain_levels"]

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
        """[F, 2] codes: envelope, prosody."""
        import torch

        envelope = torch.cdist(torch.from_numpy(params["lar"]).float(),
                               torch.from_numpy(self.centroids).float()).argmin(dim=1).numpy()
        f0 = params["f0"]
        f0_code = np.where(f0 > 0, 1 + _uniform(np.log(np.maximum(f0, 1e-3)), tuple(DECODER_CONFIG["log_f0_range"]),
                                                 self.f0_levels), 0)
        gain_code = _uniform(np.log(params["gain"]), tuple(DECODER_CONFIG["log_gain_range"]), self.gain_levels)
        return np.stack([envelope, f0_code * self.gain_levels + gain_code], axis=1)


def decoder_for(centroids: np.ndarray, directory):
    """The engine's lpc decoder with this codebook (written to ``directory``)."""
    from audio_pipeline.decoders import load_audio_decoder
    from audio_pipeline.decoders.lpc import save_lpc_decoder

    return load_audio_decoder("lpc", str(save_lpc_decoder(directory, centroids)))


def synthesize(decoder, codes: np.ndarray) -> np.ndarray:
    """Audio of [F, 2] (envelope, prosody) codes through the lpc decoder (alignment slots zero)."""
    import torch

    frames = np.zeros((len(codes), 4), dtype=np.int64)
    frames[:, 2:] = codes
    return decoder.decode(torch.from_numpy(frames.reshape(-1))).numpy()


def main(argv: list[str] | None = None) -> int:
    import tempfile

    from recipes.builtin_voice.corpus import held_out, sentences
    from recipes.builtin_voice.espeak import ESpeak
    from recipes.builtin_voice.evaluate import evaluate

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--evaluate", action="store_true", help="intelligibility of the round trip, 40 held-out")
    parser.add_argument("--write", help="write one round-trip example WAV here")
    parser.add_argument("--fit", type=int, default=600, metavar="N",
                        help="fit the envelope codebook on N training sentences")
    args = parser.parse_args(argv)
    engine = ESpeak()
    lars = np.concatenate([analyse(u.samples, u.sample_rate)["lar"] for u in
                           (engine.synthesize(t) for t in sentences(args.fit, seed=7))])
    quantizer = Quantizer.fit(lars)
    print(f"envelope codebook fitted on {len(lars)} frames")
    scratch = tempfile.mkdtemp(prefix="lpc-")
    decoder = decoder_for(quantizer.centroids, scratch)

    def round_trip(text: str):
        u = engine.synthesize(text)
        return synthesize(decoder, quantizer.encode(analyse(u.samples, u.sample_rate))), RATE

    if args.write:
        import soundfile as sf

        audio, rate = round_trip("Tomorrow Anna will clean seven noisy guitars.")
        sf.write(args.write, audio, rate)
    if args.evaluate:
        test = held_out(40, train=sentences(6000))
        with tempfile.NamedTemporaryFile(suffix=".jsgf") as grammar:
            result = evaluate(test, round_trip, grammar.name)
        print(f"LPC round trip through codes: closed-set identification {result['identified']}/"
              f"{result['sentences']} ({result['accuracy']:.0%}), WER {result['wer']:.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
