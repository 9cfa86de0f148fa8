"""Analysis side of the second-generation codec (the synthesis side is the engine's ``mcep``
decoder, audio_pipeline/decoders/mcep.py), fitted on the teacher's speech.

Per 20 ms frame of 16 kHz speech, from WORLD's analysis (``pyworld``: Harvest F0, CheapTrick
spectral envelope, D4C aperiodicity, every 5 ms; the frame takes the analysis at its centre):
- the mel-cepstrum c0..c_order of the log amplitude envelope (least squares on the warped axis);
- the aperiodicity of each band in dB;
- F0 (0 when unvoiced).
Quantisation: c1..c_order with the band aperiodicities (weighted) by a k-means codebook of
``codebook_size`` entries, c0 in ``gain_levels`` levels, log F0 in ``f0_levels`` levels.

    python -m recipes.builtin_voice.mcep_codec fit --teacher /tmp/bv2/teacher --count 400 --out /tmp/bv2/mcep
    python -m recipes.builtin_voice.mcep_codec evaluate --decoder /tmp/bv2/mcep     # held-out round trip

Needs ``pyworld`` (recipe only: ``pip install pyworld "setuptools<81"``; pyworld imports
pkg_resources).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time
import warnings
from pathlib import Path
from typing import Sequence

import numpy as np

from audio_pipeline.decoders.mcep import DEFAULT_CONFIG, band_interpolation, mcep_basis

RATE = 16000
HOP = 320
#: WORLD's analysis step: four per frame, the frame takes the one at its centre.
ANALYSIS_MS = 5.0
#: Weight of the band aperiodicities (dB) against the cepstrum in the codebook's distance.
APERIODICITY_WEIGHT = 0.05


def _pyworld():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its pkg_resources import warns
        import pyworld
    return pyworld


class Analyzer:
    """Waveform -> per-frame (mel-cepstrum c0..c_order, band aperiodicity dB, F0 Hz)."""

    def __init__(self, config: dict | None = None):
        self.config = {**DEFAULT_CONFIG, **(config or {})}
        fft = int(self.config["fft_size"])
        bins = fft // 2 + 1
        order = int(self.config["order"])
        basis = mcep_basis(bins, order, float(self.config["alpha"]))
        # Least squares, even on the warped axis (where the cepstrum's cosines are orthogonal).
        w = np.linspace(0, np.pi, bins)
        alpha = float(self.config["alpha"])
        density = np.sqrt(np.gradient(w + 2 * np.arctan(alpha * np.sin(w) / (1 - alpha * np.cos(w)))))[:, None]
        self.projection = np.linalg.pinv(basis * density) * density.T
        bands = [float(b) for b in self.config["aperiodicity_bands"]]
        freqs = np.linspace(0, RATE / 2, bins)
        self.band_of = np.clip(np.searchsorted(bands, freqs, side="right") - 1, 0, len(bands) - 2)
        self.bands = len(bands) - 1
        self.fft = fft

    def analyze(self, samples: np.ndarray, rate: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        import soxr

        pyworld = _pyworld()
        x = samples.astype(np.float64)
        if rate != RATE:
            x = soxr.resample(x, rate, RATE)
        f0, times = pyworld.harvest(x, RATE, frame_period=ANALYSIS_MS, f0_floor=70, f0_ceil=400)
        sp = pyworld.cheaptrick(x, f0, times, RATE, fft_size=self.fft)
        ap = pyworld.d4c(x, f0, times, RATE, fft_size=self.fft)
        per_frame = int(round(HOP / RATE * 1000 / ANALYSIS_MS))
        frames = len(x) // HOP
        index = np.minimum(np.arange(frames) * per_frame + per_frame // 2, len(f0) - 1)
        log_amplitude = 0.5 * np.log(np.maximum(sp[index], 1e-20))
        cepstrum = log_amplitude @ self.projection.T
        ap_db = 20 * np.log10(np.clip(ap[index], 1e-4, 1.0))
        bands = np.stack([ap_db[:, self.band_of == b].mean(1) for b in range(self.bands)], 1)
        return cepstrum, bands, f0[index]


def _analyze_file(path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    import soundfile as sf

    samples, rate = sf.read(path)
    return Analyzer().analyze(samples, rate)


def kmeans(vectors: np.ndarray, k: int, iterations: int = 25, seed: int = 0) -> np.ndarray:
    """Lloyd's k-means (torch for the distances); empty clusters are re-seeded at random points."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    x = torch.from_numpy(vectors).float()
    centres = x[torch.randperm(len(x), generator=generator)[:k]].clone()
    for _ in range(iterations):
        assignment = torch.cdist(x, centres).argmin(1)
        sums = torch.zeros_like(centres).index_add_(0, assignment, x)
        counts = torch.bincount(assignment, minlength=k)
        empty = counts == 0
        centres = sums / counts.clamp(min=1)[:, None]
        if empty.any():
            centres[empty] = x[torch.randint(len(x), (int(empty.sum()),), generator=generator)]
    return centres.numpy()


class Quantizer:
    """Frame parameters <-> the decoder's (envelope, prosody) codes."""

    def __init__(self, codebook: np.ndarray, config: dict):
        self.codebook = codebook  # [size, order + bands], aperiodicity in dB (unweighted)
        self.config = config
        self.order = int(config["order"])

    @classmethod
    def fit(cls, analyses: list[tuple[np.ndarray, np.ndarray, np.ndarray]], size: int = 1024) -> "Quantizer":
        cepstra = np.concatenate([c for c, _, _ in analyses])
        bands = np.concatenate([b for _, b, _ in analyses])
        f0 = np.concatenate([f for _, _, f in analyses])
        vectors = np.concatenate([cepstra[:, 1:], bands * APERIODICITY_WEIGHT], 1)
        centres = kmeans(vectors, size)
        codebook = np.concatenate([centres[:, :-bands.shape[1]], centres[:, -bands.shape[1]:] / APERIODICITY_WEIGHT], 1)
        voiced = np.log(f0[f0 > 0])
        config = {**DEFAULT_CONFIG,
                  "log_f0_range": [float(v) for v in np.percentile(voiced, [0.2, 99.8])],
                  "gain_range": [float(v) for v in np.percentile(cepstra[:, 0], [0.5, 99.9])]}
        return cls(codebook, config)

    def encode(self, cepstrum: np.ndarray, bands: np.ndarray, f0: np.ndarray) -> np.ndarray:
        """[frames, 2]: (envelope code, prosody code) per frame."""
        import torch

        weighted = np.concatenate([self.codebook[:, :self.order], self.codebook[:, self.order:] * APERIODICITY_WEIGHT], 1)
        vectors = np.concatenate([cepstrum[:, 1:], bands * APERIODICITY_WEIGHT], 1)
        envelope = torch.cdist(torch.from_numpy(vectors).float(), torch.from_numpy(weighted).float()).argmin(1).numpy()
        levels, gain_levels = int(self.config["f0_levels"]), int(self.config["gain_levels"])

        def level(values, bounds, count):
            lo, hi = bounds
            return np.clip(np.round((values - lo) / (hi - lo) * (count - 1)), 0, count - 1).astype(np.int64)

        f0_code = np.where(f0 > 0, 1 + level(np.log(np.maximum(f0, 1e-3)), self.config["log_f0_range"], levels), 0)
        gain = level(cepstrum[:, 0], self.config["gain_range"], gain_levels)
        return np.stack([envelope, f0_code * gain_levels + gain], 1)

    def translation(self, other: "Quantizer") -> tuple[np.ndarray, np.ndarray]:
        """(envelope map, prosody map): for each of this codec's envelope and prosody codes, the
        code ``other`` gives the same parameters (its nearest entry, its nearest levels). A model
        that speaks ``other``'s codes starts a student of this codec from its rows in this order
        (train.py --init-codec), so its embeddings mean roughly the same sounds from step 0."""
        import torch

        from audio_pipeline.decoders.codebook_vocoder import level_value

        levels, gain_levels = int(self.config["f0_levels"]), int(self.config["gain_levels"])
        # The nearest envelope by the cepstrum alone: a codec fitted on the teacher's own parameters
        # has one aperiodicity everywhere (the teacher's voiced frames are pulses alone), so the
        # bands would pull every entry toward the other codebook's few least aperiodic ones.
        envelope = torch.cdist(torch.from_numpy(self.codebook[:, :self.order]).float(),
                               torch.from_numpy(other.codebook[:, :other.order]).float()).argmin(1).numpy()
        f0_code, gain = np.divmod(np.arange((levels + 1) * gain_levels), gain_levels)
        f0 = np.where(f0_code > 0, np.exp(level_value(np.maximum(f0_code - 1, 0), self.config["log_f0_range"], levels)), 0.0)
        c0 = level_value(gain, self.config["gain_range"], gain_levels)
        prosody = other.encode(np.concatenate([c0[:, None], np.zeros((len(c0), self.order))], 1),
                               np.zeros((len(c0), self.codebook.shape[1] - self.order)), f0)[:, 1]
        return envelope, prosody

    def save(self, path: str | Path) -> Path:
        from audio_pipeline.decoders.mcep import save_mcep_decoder

        overrides = {k: v for k, v in self.config.items() if k != "noise_seed"}
        return save_mcep_decoder(path, self.codebook, **overrides)

    @classmethod
    def load(cls, path: str | Path) -> "Quantizer":
        path = Path(path)
        config = {**DEFAULT_CONFIG, **json.loads((path / "config.json").read_text())}
        return cls(np.load(path / "envelope_codebook.npy").astype(np.float64), config)


#: What ``--exact`` leaves unquantized, and how (see exact_codec).
EXACT_PARTS = {"none": (), "envelope": ("envelope",), "prosody": ("prosody",), "both": ("envelope", "prosody")}


def exact_codec(quantizer: Quantizer, analysis: tuple[np.ndarray, np.ndarray, np.ndarray], parts: Sequence[str]):
    """(decoder, quantizer) for one utterance that skip the quantization of ``parts``: the
    envelope as analysed (the utterance's own frames are the codebook), the prosody in 1,024 F0
    and gain levels (within the fitted ranges). What each quantization costs the round trip."""
    from audio_pipeline.decoders.mcep import MCEPDecoder

    config, codebook = dict(quantizer.config), quantizer.codebook
    if "prosody" in parts:
        config.update(f0_levels=1024, gain_levels=1024)
    if "envelope" in parts:
        cepstrum, bands, _ = analysis
        codebook = np.concatenate([cepstrum[:, 1:], bands], 1)
    return MCEPDecoder(config, codebook), Quantizer(codebook, config)


def world_resynthesis(samples: np.ndarray, rate: int, hold: int = 1, f0_method: str = "harvest",
                      periodic_voiced: bool = False) -> np.ndarray:
    """The speech through WORLD alone: its 5 ms analysis (as Analyzer's) and its own synthesis,
    with each parameter held over ``hold`` analysis steps (4: one analysis per 20 ms frame, the
    codec's rate). No mel-cepstrum, bands or quantization: what the analysis itself keeps.
    ``f0_method`` "dio": DIO with StoneMask's refinement instead of Harvest; ``periodic_voiced``:
    no noise in voiced frames (the teacher's own excitation is pulses or noise, never both)."""
    import soxr

    pyworld = _pyworld()
    x = samples.astype(np.float64)
    if rate != RATE:
        x = soxr.resample(x, rate, RATE)
    if f0_method == "dio":
        f0, times = pyworld.dio(x, RATE, frame_period=ANALYSIS_MS, f0_floor=70, f0_ceil=400)
        f0 = pyworld.stonemask(x, f0, times, RATE)
    else:
        f0, times = pyworld.harvest(x, RATE, frame_period=ANALYSIS_MS, f0_floor=70, f0_ceil=400)
    sp = pyworld.cheaptrick(x, f0, times, RATE, fft_size=DEFAULT_CONFIG["fft_size"])
    ap = pyworld.d4c(x, f0, times, RATE, fft_size=DEFAULT_CONFIG["fft_size"])
    if periodic_voiced:
        ap[f0 > 0] = 1e-4
    index = np.minimum(np.arange(len(f0)) // hold * hold + hold // 2, len(f0) - 1)
    return pyworld.synthesize(f0[index], np.ascontiguousarray(sp[index]), np.ascontiguousarray(ap[index]),
                              RATE, ANALYSIS_MS).astype(np.float32)


def round_trip(decoder, quantizer: Quantizer, samples: np.ndarray, rate: int,
               analysis: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """Speech through analysis (or the ``analysis`` given), quantization and the decoder."""
    return decoder.decode(coded_frames(quantizer, analysis or Analyzer(quantizer.config).analyze(samples, rate))).numpy()


def coded_frames(quantizer: Quantizer, analysis: tuple[np.ndarray, np.ndarray, np.ndarray]):
    """The decoder's input for frame parameters: 4-code frames (alignment codes 0) as a 1-D tensor."""
    import torch

    codes = quantizer.encode(*analysis)
    frames = np.zeros((len(codes), 4), dtype=np.int64)
    frames[:, 2:] = codes
    return torch.from_numpy(frames.reshape(-1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    fit = commands.add_parser("fit", help="fit the codebook and levels on teacher speech")
    fit.add_argument("--teacher", required=True, help="a teacher.py output folder (NNNNN.wav files)")
    fit.add_argument("--count", type=int, default=400, help="utterances to fit on")
    fit.add_argument("--size", type=int, default=1024, help="codebook entries")
    fit.add_argument("--workers", type=int, default=2)
    fit.add_argument("--out", required=True, help="the decoder directory to write")
    evaluate_command = commands.add_parser("evaluate", help="intelligibility of the teacher and of its round trip through the codec")
    evaluate_command.add_argument("--decoder", required=True, help="a decoder directory written by fit")
    evaluate_command.add_argument("--count", type=int, default=40)
    evaluate_command.add_argument("--split", default="held-out", choices=["held-out", "validation", "test"],
                                  help="which sentences (as in evaluate.py): the first generations' 40 held-out "
                                       "ones, or the fourth generation's validation or test split")
    evaluate_command.add_argument("--work", help="where the teacher's speech goes (default /tmp/bv2/SPLIT)")
    evaluate_command.add_argument("--show-missed", action="store_true",
                                  help="list each sentence the closed set did not identify, with what it heard")
    evaluate_command.add_argument("--exact", action="append", choices=sorted(EXACT_PARTS),
                                  help="a round trip that leaves this part unquantized (repeat for several "
                                       "round trips in one run; default: none, the codec as it is): envelope "
                                       "(each utterance's analysed frames as its codebook), prosody (F0 and gain "
                                       "in 1,024 levels each) or both")
    evaluate_command.add_argument("--world", action="store_true",
                                  help="also WORLD's own resynthesis of the teacher: from its 5 ms analysis, from "
                                       "one analysis per 20 ms frame (the codec's rate), with F0 by DIO and "
                                       "StoneMask, and with no noise in voiced frames")
    args = parser.parse_args(argv)

    if args.command == "fit":
        paths = sorted(str(p) for p in Path(args.teacher).glob("*.wav"))[:args.count]
        if not paths:
            parser.error(f"no WAV files in {args.teacher}")
        started = time.monotonic()
        with multiprocessing.Pool(args.workers) as pool:
            analyses = pool.map(_analyze_file, paths)
        frames = sum(len(f) for _, _, f in analyses)
        quantizer = Quantizer.fit(analyses, args.size)
        quantizer.save(args.out)
        print(f"fitted on {len(paths)} utterances ({frames} frames) in {time.monotonic() - started:.0f} s -> {args.out}")
        return 0

    import tempfile

    import soundfile as sf

    from audio_pipeline.decoders import load_audio_decoder
    from recipes.builtin_voice.corpus import evaluation_texts
    from recipes.builtin_voice.evaluate import evaluate, print_missed
    from recipes.builtin_voice.teacher import synthesize as teacher_speak

    texts = evaluation_texts(args.split, args.count)
    work = Path(args.work or f"/tmp/bv2/{args.split}")
    utterances = {u.text: u for u in teacher_speak(list(enumerate(texts)), work)}
    decoder = load_audio_decoder("mcep", args.decoder)
    quantizer = Quantizer.load(args.decoder)

    def teacher(text):
        samples, rate = sf.read(utterances[text].wav)
        return samples.astype(np.float32), rate

    analyses: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def coded(parts):
        def synthesize(text):
            samples, rate = sf.read(utterances[text].wav)
            if text not in analyses:
                analyses[text] = Analyzer(quantizer.config).analyze(samples, rate)
            codec = exact_codec(quantizer, analyses[text], parts) if parts else (decoder, quantizer)
            return round_trip(*codec, samples, rate, analyses[text]), decoder.sample_rate
        return synthesize

    round_trips = [("codec round trip (analysis, quantization, mcep decoder)"
                    + (f", {' and '.join(EXACT_PARTS[name])} unquantized" if EXACT_PARTS[name] else ""),
                    coded(EXACT_PARTS[name])) for name in args.exact or ["none"]]

    def world(**options):
        def synthesize(text):
            samples, rate = sf.read(utterances[text].wav)
            return world_resynthesis(samples, rate, **options), RATE
        return synthesize

    if args.world:
        round_trips += [("WORLD resynthesis (5 ms analysis)", world()),
                        ("WORLD resynthesis (one analysis per 20 ms frame)",
                         world(hold=int(round(HOP / RATE * 1000 / ANALYSIS_MS)))),
                        ("WORLD resynthesis (5 ms), F0 by DIO and StoneMask", world(f0_method="dio")),
                        ("WORLD resynthesis (5 ms), no noise in voiced frames", world(periodic_voiced=True))]
    for label, synthesize in [("teacher (Festival, cmu_us_slt_arctic_hts)", teacher)] + round_trips:
        with tempfile.NamedTemporaryFile(suffix=".jsgf") as grammar:
            result = evaluate(texts, synthesize, grammar.name)
        print(f"{label}: closed set {result['identified']}/{result['sentences']}, WER {100 * result['wer']:.1f} %",
              flush=True)
        if args.show_missed:
            print_missed(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
