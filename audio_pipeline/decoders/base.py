"""The AudioDecoder interface: speech codes in, waveform out, with the traits the chunker needs."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch


class AudioDecoder(ABC):
    """Turns speech codes into audio.

    Codes are the decoder's own integers (not LM token ids): a 1-D tensor, frame-major,
    ``tokens_per_frame`` codes per frame. The model family maps LM token ids to codes.

    Class-level traits are readable without loading weights, so configuration can be
    validated before anything heavy happens.
    """

    #: Registry name (``audio_decoder`` in the configuration).
    name: ClassVar[str]
    #: Codes that make one frame, the smallest decodable unit.
    tokens_per_frame: ClassVar[int]
    #: Whether the decoder can run with ``block_causal=True``.
    supports_block_causal: ClassVar[bool] = False

    #: Output sample rate in Hz.
    sample_rate: int
    #: Audio samples produced per frame.
    samples_per_frame: int
    #: Frames on each side of a frame that influence its audio (the decoder's receptive field).
    receptive_field_frames: int

    @property
    def samples_per_token(self) -> float:
        """``sample_rate * frame_duration / tokens_per_frame``; may be fractional."""
        return self.samples_per_frame / self.tokens_per_frame

    @classmethod
    @abstractmethod
    def load(cls, weights: str, config: dict[str, Any] | None = None, *,
             device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> "AudioDecoder":
        """Builds the decoder from ``weights`` (a local directory or file) and extra settings."""

    @abstractmethod
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Decodes a 1-D tensor of whole frames into a 1-D float waveform in [-1, 1].

        The result has exactly ``len(codes) // tokens_per_frame * samples_per_frame`` samples.
        """

    def decode_batch(self, batch: list[torch.Tensor]) -> list[torch.Tensor]:
        """Decodes several independent code sequences; decoders override this to batch."""
        return [self.decode(codes) for codes in batch]

    def check_codes(self, codes: torch.Tensor) -> None:
        """Raises ValueError unless ``codes`` is 1-D, whole frames and non-empty."""
        if codes.dim() != 1:
            raise ValueError(f"codes must be 1-D, got shape {tuple(codes.shape)}")
        if codes.numel() == 0 or codes.numel() % self.tokens_per_frame:
            raise ValueError(
                f"codes must be a non-empty whole number of {self.tokens_per_frame}-code frames, "
                f"got {codes.numel()} codes")
