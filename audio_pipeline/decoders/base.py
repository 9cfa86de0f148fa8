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

    Block-causal decoding (``supports_block_causal``): the decoder keeps a per-stream state (for a
    convolutional decoder, the cached activations of what it decoded before) and decodes each new
    block on top of it with :meth:`decode_blocks`; the past is never recomputed and never sees the
    block, and the block never sees the future.

    A decoder whose audio depends on a frame's index in its stream (SNAC's positional noise) says
    so (``takes_frame_offsets``) and takes a ``frame_offsets`` keyword in ``decode_batch`` and
    ``decode_blocks``: the index in its stream of each input's first frame. Streaming passes it to
    the decoders that declare it.

    Traits are declared here, with their defaults, and read as declared: nothing probes a decoder
    for a method or an attribute.
    """

    #: Registry name (``audio_decoder`` in the configuration).
    name: ClassVar[str]
    #: Codes that make one frame, the smallest decodable unit.
    tokens_per_frame: ClassVar[int]
    #: Whether the decoder can run with ``block_causal=True`` (implements init_state / decode_blocks).
    #: A checkpoint-dependent decoder may say False on an instance (see check_streaming_settings).
    supports_block_causal: ClassVar[bool] = False
    #: A causal decoder whose block state carries everything its audio depends on (filter memory,
    #: excitation phase, noise generator): decoding block after block on it gives exactly the
    #: one-shot audio. Streams then always decode on that state, whatever ``block_causal`` says (for
    #: such a decoder the two modes mean the same audio; only the state path has no restarts).
    causal_state: ClassVar[bool] = False
    #: Whether the decoder turns a recording into codes (``encode``): what voice cloning needs.
    supports_encoding: ClassVar[bool] = False
    #: Whether ``decode_batch`` and ``decode_blocks`` take ``frame_offsets`` (see above).
    takes_frame_offsets: ClassVar[bool] = False
    #: Captured CUDA graphs of the batched decode, where the decoder has them (SNAC on CUDA with
    #: cuda_graphs: decoders/snac_graphs.py; the engine prepares their shapes); None otherwise.
    graphs: Any = None

    #: The device the decoder runs on (its weights and its outputs before they come back).
    device: torch.device
    #: Output sample rate in Hz.
    sample_rate: int
    #: Audio samples produced per frame.
    samples_per_frame: int
    #: Frames on each side of a frame that influence its audio (the decoder's receptive field).
    receptive_field_frames: int
    #: Codes per codebook (codes run from 0), where every position of a frame has the same
    #: codebook; a decoder without one overrides ``code_limits``.
    codebook_size: int

    @property
    def samples_per_token(self) -> float:
        """``sample_rate * frame_duration / tokens_per_frame``; may be fractional."""
        return self.samples_per_frame / self.tokens_per_frame

    @classmethod
    @abstractmethod
    def load(cls, weights: str, config: dict[str, Any] | None = None, *,
             device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> "AudioDecoder":
        """Builds the decoder from ``weights`` (a local directory or file) and extra settings."""

    @classmethod
    def check_streaming_settings(cls, *, block_causal: bool = False, prepend_causal: bool = False,
                                 weights: str | None = None) -> None:
        """Raises ValueError naming each streaming setting this decoder cannot honour.

        Called when the configuration is resolved, before anything loads; ``weights`` (when known)
        lets a decoder whose abilities depend on the checkpoint read its configuration.
        """
        problems = [f"{field}=true is not supported by audio_decoder {cls.name!r} (it cannot decode "
                    "block-causally)"
                    for field, wanted in (("block_causal", block_causal),
                                          ("prepend_prompt_speech_tokens_causal", prepend_causal))
                    if wanted and not cls.supports_block_causal]
        if problems:
            raise ValueError("; ".join(problems))

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # decode and decode_batch are each other's default: a decoder writes at least one.
        if cls.decode is AudioDecoder.decode and cls.decode_batch is AudioDecoder.decode_batch:
            raise TypeError(f"audio decoder {cls.__name__} must define decode or decode_batch")

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Decodes a 1-D tensor of whole frames into a 1-D float waveform in [-1, 1].

        The result has exactly ``len(codes) // tokens_per_frame * samples_per_frame`` samples. By
        default the batch of one (decoders that batch write ``decode_batch``).
        """
        return self.decode_batch([codes])[0]

    def decode_batch(self, batch: list[torch.Tensor]) -> list[torch.Tensor]:
        """Decodes several independent code sequences; decoders override this to batch (by
        default each on its own with ``decode``)."""
        return [self.decode(codes) for codes in batch]

    def encode(self, waveform: torch.Tensor) -> torch.Tensor:
        """A recording (mono float at ``sample_rate``) as codes, frame-major: decoders that declare
        ``supports_encoding`` implement it."""
        raise NotImplementedError(f"audio decoder {self.name!r} cannot encode audio")

    def init_state(self) -> Any:
        """A stream's block-causal state before its first block (as at the start of ``decode``)."""
        raise NotImplementedError(f"block_causal: audio decoder {self.name!r} cannot decode block-causally")

    def decode_blocks(self, blocks: list[torch.Tensor], states: list[Any]) -> list[tuple[torch.Tensor, Any]]:
        """Decodes each stream's next block on top of its state: ``(audio of the block, new state)``.

        States given are not modified. Decoding a whole sequence as one block from ``init_state()``
        equals ``decode``; decoding it block by block gives the same samples exactly when the
        decoder is causal.
        """
        raise NotImplementedError(f"block_causal: audio decoder {self.name!r} cannot decode block-causally")

    def check_states(self, blocks: list, states: list, state_type: type) -> None:
        """ValueError unless there is one ``state_type`` state (from init_state or decode_blocks)
        per block: what every causal decoder's decode_blocks checks first."""
        if len(states) != len(blocks):
            raise ValueError(f"need one state per block: {len(blocks)} blocks, {len(states)} states")
        for state in states:
            if not isinstance(state, state_type):
                raise ValueError(f"a {self.name} stream state must come from init_state or decode_blocks, "
                                 f"got {type(state).__name__}")

    def code_limits(self) -> list[int]:
        """For each position in a frame, the exclusive upper bound of its codes (codes start at
        0): what a benchmark or fuzzer may draw. Every decoder here has one ``codebook_size``
        unless it says otherwise."""
        return [int(self.codebook_size)] * self.tokens_per_frame

    def codes_on_device(self, codes: torch.Tensor, where=None) -> torch.Tensor:
        """``codes`` checked against the decoder's ``codebook_size`` (check_code_values; ``where``
        names a bad code's place) as a long tensor on the decoder's device."""
        self.check_code_values(codes, self.codebook_size, where)
        return codes.to(device=self.device, dtype=torch.long)

    @staticmethod
    def check_waveform(waveform: torch.Tensor) -> None:
        """ValueError unless ``waveform`` is what ``encode`` takes: a non-empty 1-D floating-point tensor."""
        if not isinstance(waveform, torch.Tensor) or waveform.dim() != 1 or waveform.numel() == 0:
            raise ValueError("waveform must be a non-empty 1-D tensor")
        if not waveform.is_floating_point():
            raise ValueError(f"waveform must be floating point, got {waveform.dtype}")

    def check_code_values(self, codes: torch.Tensor, codebook_size: int, where=None) -> None:
        """Raises ValueError unless ``codes`` is an integer tensor of whole frames (check_codes)
        with every code in [0, codebook_size); ``where(position)`` names a bad code's place."""
        if not isinstance(codes, torch.Tensor):
            raise ValueError(f"codes must be a tensor, got {type(codes).__name__}")
        self.check_codes(codes)
        if codes.dtype == torch.bool or codes.is_floating_point() or codes.is_complex():
            raise ValueError(f"codes must be an integer tensor, got {codes.dtype}")
        bad = (codes < 0) | (codes >= codebook_size)
        if bool(bad.any()):
            position = int(bad.nonzero()[0, 0])
            place = where(position) if where is not None else f"frame {position // self.tokens_per_frame}"
            raise ValueError(f"code {int(codes[position])} at position {position} ({place}) is outside "
                             f"[0, {codebook_size})")

    def check_codes(self, codes: torch.Tensor) -> None:
        """Raises ValueError unless ``codes`` is 1-D, whole frames and non-empty."""
        if codes.dim() != 1:
            raise ValueError(f"codes must be 1-D, got shape {tuple(codes.shape)}")
        if codes.numel() == 0 or codes.numel() % self.tokens_per_frame:
            raise ValueError(
                f"codes must be a non-empty whole number of {self.tokens_per_frame}-code frames, "
                f"got {codes.numel()} codes")
