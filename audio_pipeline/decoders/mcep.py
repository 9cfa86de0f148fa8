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
its noise response. A block's frames are synthesised together: each frame's pulse train and noise
become spectra, multiplied by the spectra of its responses (made once at load), and back (3.5x
faster than pulse by pulse in Python). Responses run past the frame's end: that tail, the pulse phase, the previous
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
    #: frame's own response) measured as intelligible as 2 or 4 and costs 1.8 ms per second of
    #: audio on one core instead of 4.1 or 6.1 (40-frame blocks, best of 3).
    "interpolation_steps": 1,
    "order": 40,
    "alpha": 0.42,
    "aperiodicity_bands": [0, 1000, 2000, 4000, 8000],
    "f0_levels": 31,
    "gain_levels": 32,
    "log_f0_range": [4.39, 5.80],  # log(80 Hz), log(330 Hz)
    "gain_range": [-10.4, -3.6],  # c0, natural log amplitude
    "noise_seed": 0,
    #: Added to every entry's c1..c_order before synthesis ([] for none): a fixed equalisation, e.g.
    #: the rolloff toward 8 kHz that a codec fitted on the teacher's own parameters lacks against
    #: the teacher's audio (recipes/builtin_voice/teacher_parameters.py equalize).
    "envelope_offset": [],
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

    #: Samples of the frames so far that sound on past the last frame's end (each sample holds
    #: its contributions summed oldest frame first, the order synthesis adds them in).
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
        offset = np.asarray(config.get("envelope_offset") or np.zeros(self.order), dtype=np.float64)
        if offset.shape != (self.order,):
            raise ValueError(f"mcep decoder config: envelope_offset has {offset.size} values, order is {self.order}")
        envelope = (self.codebook[:, :self.order] + offset) @ mcep_basis(bins, self.order, float(config["alpha"]))[:, 1:].T
        aperiodicity_db = self.codebook[:, self.order:] @ band_interpolation(bins, self.sample_rate, bands).T
        share = np.clip(10 ** (aperiodicity_db / 20), 1e-4, 1.0)
        self._fft = fft
        self.interpolation_steps = max(1, int(config["interpolation_steps"]))
        #: A frame's excitation (pulses, noise) through its responses is one frame's worth of
        #: samples convolved with responses of response_length: this many samples long, computed
        #: as products of spectra of ``_conv_size`` points (no wrap-around).
        self._ring = self.samples_per_frame + self.response_length - 1
        self._conv_size = 1 << (self._ring - 1).bit_length()
        #: Frames whose output a frame's ring reaches (its own and the ones after it).
        self._reach = -(-self._ring // self.samples_per_frame)
        self._ramp = np.arange(1, self.samples_per_frame + 1) / self.samples_per_frame
        #: Log amplitude of each entry's periodic part (gliding pulse responses are made from these).
        self._periodic_log = envelope + 0.5 * np.log(np.maximum(1 - share ** 2, 1e-4))
        # The spectra of each entry's responses, made once: the periodic part (pulses), the
        # whole envelope (noise in unvoiced frames) and the aperiodic part (noise in voiced ones).
        # Kept in single precision (the audio is float32; at most one float32 step from double
        # precision, and the tables take 12.6 MiB instead of 25 for 1,024 entries).
        self._periodic = self._spectrum(minimum_phase(self._periodic_log, fft, self.response_length)).astype(np.complex64)
        #: Rows 0..size-1: the whole envelope (unvoiced); size..2 size-1: the aperiodic part (voiced).
        self._noise_responses = self._spectrum(minimum_phase(
            np.concatenate([envelope, envelope + np.log(share)]), fft, self.response_length)).astype(np.complex64)

    def _spectrum(self, signal: np.ndarray) -> np.ndarray:
        return np.fft.rfft(signal, self._conv_size, axis=-1)

    def init_state(self) -> MCEPState:
        return MCEPState(np.zeros((self._reach - 1) * self.samples_per_frame),
                         rng=np.random.default_rng(int(self.config["noise_seed"])))

    def _synthesize(self, frames: np.ndarray, state: MCEPState) -> np.ndarray:
        """All the block's frames at once: each frame's excitation through its responses as
        products of spectra, then overlap-added in frame order. Every frame's ring depends on that
        frame and the state before it alone, and every sample sums its frames' rings oldest first
        whatever the blocks are, so block after block equals one block exactly."""
        hop, length, rate = self.samples_per_frame, self.response_length, self.sample_rate
        count = len(frames)
        entries = frames[:, 2]
        f0_codes, gain_codes = self.prosody(frames)
        gains = np.exp(level_value(gain_codes, tuple(self.config["gain_range"]), self.gain_levels))
        f0s = np.where(f0_codes > 0, np.exp(level_value(np.maximum(f0_codes - 1, 0),
                                                        tuple(self.config["log_f0_range"]), self.f0_levels)), 0.0)
        voiced = f0s > 0
        before = state.previous if state.previous is not None else (0, 1.0, 0.0)
        previous_f0 = np.concatenate([[before[2]], f0s[:-1]])

        # Pitch glides from the previous voiced frame's; the pulse phase carries on through a
        # voiced run (a scalar recurrence: one step per frame) and restarts after silence.
        start_f0 = np.where(previous_f0 > 0, previous_f0, f0s)
        pitch = start_f0[:, None] + (f0s - start_f0)[:, None] * self._ramp
        advance = np.cumsum(pitch / rate, axis=1)
        phase_at_start = np.zeros(count)
        phase = state.phase
        for index in range(count):
            if voiced[index]:
                phase_at_start[index] = phase
                phase = float((phase + advance[index, -1]) % 1.0)
            else:
                phase = 0.0
        state.phase = phase
        cycles = np.floor(np.concatenate([phase_at_start[:, None], phase_at_start[:, None] + advance], axis=1))
        rows, positions = np.nonzero((cycles[:, 1:] != cycles[:, :-1]) & voiced[:, None])

        # Pulse trains (one per interpolation step when the spectrum glides) and white noise, each
        # through its responses; the gain scales both.
        steps = self.interpolation_steps
        gliding = voiced & (previous_f0 > 0) if steps > 1 else np.zeros(count, dtype=bool)
        channels = steps if gliding.any() else 1
        step_of = np.where(gliding[rows], positions * steps // hop, 0)
        trains = np.zeros((count, channels, self._conv_size))
        trains[rows, step_of, positions] = np.sqrt(rate / pitch[rows, positions])
        noise = state.rng.standard_normal((count, hop))
        spectra = self._spectrum(noise) * self._noise_responses[entries + voiced * self.codebook_size]
        pulses = np.fft.rfft(trains, axis=-1)
        if channels == 1:
            spectra += pulses[:, 0] * self._periodic[entries]
        else:
            # The gliding frames' pulses go through responses of the spectrum moving from the
            # previous frame's to this one's (the gain factored out: it scales all at the end).
            glide = np.nonzero(gliding)[0]
            previous_entries = np.concatenate([[before[0]], entries[:-1]])[glide]
            previous_gains = np.concatenate([[before[1]], gains[:-1]])[glide]
            start = self._periodic_log[previous_entries] + np.log(previous_gains / gains[glide])[:, None]
            end = self._periodic_log[entries[glide]]
            weights = (np.arange(steps) + 0.5)[:, None] / steps
            shapes = np.zeros(pulses.shape, dtype=complex)
            shapes[:, 0] = self._periodic[entries]
            shapes[glide] = self._spectrum(minimum_phase(start[:, None] + weights * (end - start)[:, None],
                                                         self._fft, length))
            spectra += np.einsum("fsb,fsb->fb", pulses, shapes)
        rings = np.fft.irfft(spectra * gains[:, None], self._conv_size, axis=-1)[:, :self._ring]

        # Overlap-add: each sample gets its frames' rings oldest frame first (the tail holds the
        # earlier blocks' frames), so block boundaries never change a sum's order.
        reach = self._reach
        pieces = np.zeros((count, reach * hop))
        pieces[:, :self._ring] = rings
        pieces = pieces.reshape(count, reach, hop)
        out = np.zeros((count + reach - 1, hop))
        out[:reach - 1] = state.tail.reshape(reach - 1, hop)
        for lag in reversed(range(reach)):
            out[lag:lag + count] += pieces[:, lag]
        last = count - 1
        state.previous = (int(entries[last]), float(gains[last]), float(f0s[last]))
        state.tail = out[count:].reshape(-1).copy()
        return np.clip(out[:count].reshape(-1), -1.0, 1.0).astype(np.float32)


register_audio_decoder(MCEPDecoder)


def save_mcep_decoder(path: str | Path, codebook: np.ndarray, **overrides: Any) -> Path:
    """Writes an mcep decoder directory (config.json + envelope_codebook.npy)."""
    return save_codebook_vocoder(path, codebook, {**DEFAULT_CONFIG, **overrides})
