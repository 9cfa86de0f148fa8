"""The project's own LPC vocoder decoder ("lpc"), the codec of the first-generation built-in voice (lpc-en).

A frame (20 ms at 16 kHz, 320 samples) is four codes: the phoneme index and countdown (ignored
here: the language model's alignment, see audio_pipeline/layouts/phoneme_lpc.py), the spectral
envelope (index into a codebook of log-area-ratio vectors) and the prosody code
``f0 * gain_levels + gain``: f0 is 0 for unvoiced, else one of ``f0_levels`` log-spaced levels;
gain one of ``gain_levels`` log-spaced levels of the prediction-error energy. Synthesis: a pulse train with continuous phase (voiced) or
white noise (unvoiced) through the all-pole filter, then de-emphasis. Everything that carries over
(filter memory, pulse phase, noise generator, de-emphasis memory) is the stream's state, so the
decoder is causal and block-causal streaming equals one-shot decoding exactly.

Weights: a directory with ``config.json`` and ``envelope_codebook.npy`` ([codebook_size, order]).
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
    "order": 16,
    "f0_levels": 31,
    "gain_levels": 32,
    "log_f0_range": [4.248495242049359, 5.521460917862246],  # log(70 Hz), log(250 Hz)
    "log_gain_range": [-23.0, -4.0],
    "pre_emphasis": 0.9,
    "noise_seed": 0,
}


def lar_to_reflection(values: np.ndarray) -> np.ndarray:
    """Log-area ratios -> reflection coefficients (always in (-1, 1): a stable filter)."""
    return np.tanh(values / 2)


def reflection_to_lpc(k: np.ndarray) -> np.ndarray:
    """Reflection coefficients -> the LPC polynomial a[0..order], a[0] = 1 (step-up recursion)."""
    a = np.zeros(len(k) + 1)
    a[0] = 1.0
    for i, ki in enumerate(k, 1):
        a[1:i] = a[1:i] + ki * a[i - 1:0:-1]
        a[i] = ki
    return a



@dataclass
class LPCState:
    """What one stream carries from block to block."""

    filter_memory: np.ndarray
    phase: float = 0.0
    deemphasis: float = 0.0
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))


class LPCDecoder(CodebookVocoder):
    name = "lpc"
    DEFAULT_CONFIG = DEFAULT_CONFIG

    def __init__(self, config: dict[str, Any], codebook: np.ndarray):
        from scipy.signal import lfilter

        super().__init__(config, codebook, int(config["order"]), "")
        self._lfilter = lfilter
        self._filters = [reflection_to_lpc(lar_to_reflection(v)) for v in self.codebook]

    def init_state(self) -> LPCState:
        return LPCState(np.zeros(self.order), rng=np.random.default_rng(int(self.config["noise_seed"])))

    def _synthesize(self, frames: np.ndarray, state: LPCState) -> np.ndarray:
        hop = self.samples_per_frame
        f0_range = tuple(self.config["log_f0_range"])
        f0_codes, gain_codes = self.prosody(frames)
        gains = np.exp(level_value(gain_codes, tuple(self.config["log_gain_range"]), self.gain_levels))
        pieces = []
        for envelope, f0_code, gain in zip(frames[:, 2], f0_codes, gains):
            if f0_code > 0:
                period = self.sample_rate / np.exp(level_value(np.array(f0_code - 1), f0_range, self.f0_levels))
                phases = state.phase + np.arange(1, hop + 1) / period
                excitation = np.zeros(hop)
                excitation[np.nonzero(np.diff(np.floor(np.concatenate([[state.phase], phases]))))[0]] = np.sqrt(period)
                state.phase = float(phases[-1] % 1.0)
            else:
                excitation = state.rng.standard_normal(hop)
            y, state.filter_memory = self._lfilter([np.sqrt(gain)], self._filters[envelope], excitation,
                                                   zi=state.filter_memory)
            pieces.append(y)
        y = np.concatenate(pieces)
        y, (state.deemphasis,) = self._lfilter([1.0], [1.0, -float(self.config["pre_emphasis"])], y,
                                               zi=[state.deemphasis])
        return np.clip(y, -1.0, 1.0).astype(np.float32)


register_audio_decoder(LPCDecoder)


def save_lpc_decoder(path: str | Path, codebook: np.ndarray, **overrides: Any) -> Path:
    """Writes an lpc decoder directory (config.json + envelope_codebook.npy)."""
    return save_codebook_vocoder(path, codebook, {**DEFAULT_CONFIG, **overrides}, dtype=np.float64)
