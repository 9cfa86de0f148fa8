"""Per-request state: prompt and speech tokens, what is cached and decoded, timings, stop reason."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from audio_pipeline.models.orpheus import OrpheusLayout
from audio_pipeline.sampling import SamplingParams


class StopReason(str, enum.Enum):
    END_OF_SPEECH = "end_of_speech"
    MAX_TOKENS = "max_tokens"
    CANCELLED = "cancelled"
    FAILED = "failed"


@dataclass(eq=False)
class TTSContext:
    """Everything the engine keeps about one request while it runs."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    layout: OrpheusLayout
    voice: str | None = None
    #: Generated speech-token ids (end-of-speech not included).
    generated: list[int] = field(default_factory=list)
    #: Tokens (prompt, then generated) whose keys and values are in the KV cache.
    processed: int = 0
    #: Generated tokens already turned into audio.
    decoded_index: int = 0
    #: Audio chunks decoded so far.
    chunks_decoded: int = 0
    stop_reason: StopReason | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_audio_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        self.generator = self.sampling.make_generator()
        frame = self.layout.tokens_per_frame
        # Count of each code so far, per frame slot: what repetition penalties look at.
        self._slot_counts = torch.zeros(frame, self.layout.codebook_size)
        # The largest whole-frame count within max_tokens: generation never stops mid-frame.
        self.token_budget = self.sampling.max_tokens - self.sampling.max_tokens % frame

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt_ids + self.generated

    @property
    def total_length(self) -> int:
        return len(self.prompt_ids) + len(self.generated)

    @property
    def max_length(self) -> int:
        """Tokens this request may ever hold in the KV cache."""
        return len(self.prompt_ids) + self.token_budget

    @property
    def is_done(self) -> bool:
        return self.stop_reason is not None

    def unprocessed_tokens(self) -> list[int]:
        return self.all_tokens[self.processed:]

    def candidate_ids(self) -> torch.Tensor:
        """The ids the next token is chosen from: the next frame slot's codebook, then end-of-speech."""
        start, end = self.layout.token_range(len(self.generated))
        return torch.cat([torch.arange(start, end), torch.tensor([self.layout.end_of_speech])])

    def candidate_mask(self) -> torch.Tensor:
        """Which candidates are allowed now: end-of-speech only on a frame boundary after min_tokens."""
        position = len(self.generated)
        mask = torch.ones(self.layout.codebook_size + 1, dtype=torch.bool)
        mask[-1] = (position % self.layout.tokens_per_frame == 0 and position > 0
                    and position >= self.sampling.min_tokens)
        return mask

    def candidate_counts(self) -> torch.Tensor:
        """How often each candidate was generated before (what repetition penalties look at)."""
        counts = self._slot_counts[len(self.generated) % self.layout.tokens_per_frame]
        return torch.cat([counts, torch.zeros(1)])

    def append_token(self, token_id: int) -> None:
        """Records a sampled token and stops the request on end-of-speech or when out of budget."""
        if token_id == self.layout.end_of_speech:
            self.stop_reason = StopReason.END_OF_SPEECH
            return
        position = len(self.generated)
        code = self.layout.token_to_code(token_id, position)
        self._slot_counts[position % self.layout.tokens_per_frame, code] += 1
        self.generated.append(token_id)
        if len(self.generated) >= self.token_budget:
            self.stop_reason = StopReason.MAX_TOKENS

    def speech_codes(self, start: int, end: int) -> torch.Tensor:
        """Audio codes of generated tokens [start, end) (start on a frame boundary)."""
        return self.layout.tokens_to_codes(self.generated[start:end], first_position=start)
