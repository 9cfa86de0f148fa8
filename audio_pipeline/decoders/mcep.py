"""The project's mel-cepstral vocoder decoder ("mcep"): a causal source-filter codec with mixed
excitation, the built-in voice's second-generation codec.

A frame (20 ms at 16 kHz, 320 samples) is four codes: the phoneme index and countdown (ignored
here: the language model's alignment, see audio_pipeline/layouts/phoneme_lpc.py), the spectral
envelope (an index into a codebook of mel-cepstra with band aperiodicities) and the prosody code
``f0 * gain_levels + gain``: f0 is 0 for unvoiced, else one of ``f0_levels`` log-spaced levels;
gain one of ``gain_levels`` levels of the cepstrum's 0th coefficient (log amplitude).

Each codebook entry holds the mel-cepstrum c1..c_order of a log amplitude spectrum (all-pass
frequency warping with ``alpha``) and the aperiodicity of ``aperiodicity_bands`` in dB (the share of
noise in each band, interpolated across frequency). At load, every entry becomes three
minimum-phase impulse responses: the periodic part (pulses), the aperiodic part (noise in voiced
frames) and the whole envelope (noise in unvoiced frames).

Synthesis: a voiced frame places pulses at its pitch periods (the phase carries on from frame to
frame, the pitch glides from the previous frame's); each pulse adds its response, crossfaded from
the previous frame's envelope to this one's across the frame. Every frame adds white noise through
its noise response. Responses run past the frame's end: that tail, the pulse phase, the previous
frame and the noise generator are the stream's state, so the decoder is causal, and streaming
equals one-shot decoding exactly (``causal_state``).

Weights: a directory with ``config.json`` and ``envelope_codebook.npy`` ([codebook_size, order +
bands]). The recipe fits them (recipes/builtin_voice/mcep_codec.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from audio_pipeline.decoders.codebook_vocoder import CodebookVocoder, level_value, save_codebook_vocoder
from audio_pipeline.decoders.registry import register_audio_decoder

DEFAULT_CONFIG: dict[str, Any] = {
    "sample_rate": 16000,
    "hop": 320,
    "fft_size": 1024,
    #: Samples of each impulse response kept (they decay within a few milliseconds).
    "response_length": 512,
    #: Pulse responses per voiced frame, each from the log spectrum interpolated between the
    #: previous frame's and this one's (formants glide instead of jumping at frame edges). 1 (each
    #: frame's own response) measured as intelligible as 2 or 4 and costs 4.4 ms per second of
    #: audio instead of 8.7 or 11.3.
    "interpolation_steps": 1,
    "order": 40,
    "alpha": 0.42,
    "aperiodicity_bands": [0, 1000, 2000, 4000, 8000],
    "f0_levels": 31,
    "gain_levels": 32,
    "log_f0_range": [4.39, 5.80],  # log(80 Hz), log(330 Hz)
    "gain_range": [-10.4, -3.6],  # c0, natural log amplitude
    "noise_seed": 0,
}


def warped_frequencies(bins: int, alpha: float) -> np.ndarray:
    """The all-pass warped frequency of each of ``bins`` bins from 0 to pi."""
    w = np.linspace(0, np.pi, bins)
    return w + 2 * np.arctan(alpha * np.sin(w) / (1 - alpha * np.cos(w)))


def mcep_basis(bins: int, order: int, alpha: float) -> np.ndarray:
    """[bins, order + 1]: log amplitude = basis @ mel-cepstrum (c0..c_order)."""
    return np.cos(np.outer(warped_frequencies(bins, alpha), np.arange(order + 1)))


def band_interpolation(bins: int, sample_rate: int, bands: list[float]) -> np.ndarray:
    """[bins, len(bands) - 1]: per-bin weights that interpolate band values linearly between band
    centres (held flat beyond the first and last centre)."""
    freqs = np.linspace(0, sample_rate / 2, bins)
    centres = np.array([(a + b) / 2 for a, b in zip(bands, bands[1:])])
    weights = np.zeros((bins, len(centres)))
    for k in range(len(centres)):
        unit = np.zeros(len(centres))
        unit[k] = 1.0
        weights[:, k] = np.interp(freqs, centres, unit)
    return weights


def minimum_phase(log_amplitude: np.ndarray, fft_size: int, length: int) -> np.ndarray:
    """The minimum-phase impulse response of a log amplitude spectrum ([..., fft_size // 2 + 1]),
    first ``length`` samples (the folded real cepstrum)."""
    cepstrum = np.fft.irfft(log_amplitude, fft_size, axis=-1)
    half = fft_size // 2
    folded = np.zeros_like(cepstrum)
    folded[..., 0] = cepstrum[..., 0]
    folded[..., 1:half] = 2 * cepstrum[..., 1:half]
    folded[..., half] = cepstrum[..., half]
    return np.fft.irfft(np.exp(np.fft.rfft(folded, axis=-1)), fft_size, axis=-1)[..., :length]



@dataclass
class MCEPState:
    """What one stream carries from block to block."""

    tail: np.ndarray
    phase: float = 0.0
    #: The previous frame's (envelope code, gain, f0 in Hz); None before the first frame.
    previous: tuple[int, float, float] | None = None
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))


class MCEPDecoder(CodebookVocoder):
    name = "mcep"
    DEFAULT_CONFIG = DEFAULT_CONFIG

    def __init__(self, config: dict[str, Any], codebook: np.ndarray):
        order = int(config["order"])
        bands = [float(b) for b in config["aperiodicity_bands"]]
        super().__init__(config, codebook, order + len(bands) - 1, f" (order {order} + {len(bands) - 1} bands)")
        self.response_length = int(config["response_length"])
        fft = int(config["fft_size"])
        bins = fft // 2 + 1
        # Log amplitude of each entry without its gain (c0 = 0), and its aperiodicity per bin.
        envelope = self.codebook[:, :self.order] @ mcep_basis(bins, self.order, float(config["alpha"]))[:, 1:].T
        aperiodicity_db = self.codebook[:, self.order:] @ band_interpolation(bins, self.sample_rate, bands).T
        share = np.clip(10 ** (aperiodicity_db / 20), 1e-4, 1.0)
        self._fft = fft
        self.interpolation_steps = max(1, int(config["interpolation_steps"]))
        #: Log amplitude of each entry's periodic part (pulse responses are made from these at run time).
        self._periodic_log = envelope + 0.5 * np.log(np.maximum(1 - share ** 2, 1e-4))
        self._periodic = minimum_phase(self._periodic_log, fft, self.response_length)
        self._aperiodic = minimum_phase(envelope + np.log(share), fft, self.response_length)
        self._unvoiced = minimum_phase(envelope, fft, self.response_length)

    def init_state(self) -> MCEPState:
        return MCEPState(np.zeros(self.response_length + self.samples_per_frame),
                         rng=np.random.default_rng(int(self.config["noise_seed"])))

    def _synthesize(self, frames: np.ndarray, state: MCEPState) -> np.ndarray:
        hop, length, rate = self.samples_per_frame, self.response_length, self.sample_rate
        f0_codes, gain_codes = self.prosody(frames)
        gains = np.exp(level_value(gain_codes, tuple(self.config["gain_range"]), self.gain_levels))
        f0s = np.where(f0_codes > 0, np.exp(level_value(np.maximum(f0_codes - 1, 0),
                                                        tuple(self.config["log_f0_range"]), self.f0_levels)), 0.0)
        ramp = np.arange(1, hop + 1) / hop
        out = np.empty(len(frames) * hop)
        buffer = np.zeros(hop + length)
        for index, (entry, gain, f0) in enumerate(zip(frames[:, 2], gains, f0s)):
            buffer[:] = 0.0
            buffer[:state.tail.shape[0]] += state.tail[:hop + length]
            noise = state.rng.standard_normal(hop)
            response = self._aperiodic[entry] if f0 > 0 else self._unvoiced[entry]
            buffer[:hop + length - 1] += np.convolve(noise, response * gain)
            previous = state.previous
            if f0 > 0:
                start_f0 = previous[2] if previous is not None and previous[2] > 0 else f0
                pitch = start_f0 + (f0 - start_f0) * ramp
                phases = state.phase + np.cumsum(pitch / rate)
                pulses = np.nonzero(np.diff(np.floor(np.concatenate([[state.phase], phases]))))[0]
                state.phase = float(phases[-1] % 1.0)
                steps = self.interpolation_steps
                voiced_before = previous is not None and previous[2] > 0
                if voiced_before and steps > 1 and pulses.size:
                    # Responses of the spectrum gliding from the previous frame's to this one's.
                    before = self._periodic_log[previous[0]] + np.log(previous[1])
                    current = self._periodic_log[entry] + np.log(gain)
                    weights = (np.arange(steps) + 0.5)[:, None] / steps
                    shapes = minimum_phase(before + weights * (current - before), self._fft, length)
                    step_of = pulses * steps // hop
                else:
                    shapes = (self._periodic[entry] * gain)[None]
                    step_of = np.zeros(pulses.size, dtype=np.int64)
                for position, step in zip(pulses, step_of):
                    buffer[position:position + length] += shapes[step] * np.sqrt(rate / pitch[position])
            else:
                state.phase = 0.0
            state.previous = (int(entry), float(gain), float(f0))
            out[index * hop:(index + 1) * hop] = buffer[:hop]
            state.tail = np.concatenate([buffer[hop:], np.zeros(hop)])
        return np.clip(out, -1.0, 1.0).astype(np.float32)


register_audio_decoder(MCEPDecoder)


def save_mcep_decoder(path: str | Path, codebook: np.ndarray, **overrides: Any) -> Path:
    """Writes an mcep decoder directory (config.json + envelope_codebook.npy)."""
    return save_codebook_vocoder(path, codebook, {**DEFAULT_CONFIG, **overrides})
