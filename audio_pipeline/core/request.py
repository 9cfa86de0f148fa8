"""Per-request state: prompt and speech tokens, what is cached and decoded, timings, stop reason."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from audio_pipeline.core.sampling_params import SamplingParams
from audio_pipeline.core.stop import StopReason
from audio_pipeline.layouts.base import Layout


#: Uniform draws a request takes from its generator at once (see TTSContext.uniforms).
UNIFORM_BLOCK = 64


@dataclass(eq=False)
class TTSContext:
    """Everything the engine keeps about one request while it runs."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    layout: Layout
    voice: str | None = None
    #: The client request this context speaks a piece of (a long text is several contexts, one
    #: after the other); None: the context is the request.
    stream_id: str | None = None
    #: A later piece of its client request (one before it has run): while it waits, the request
    #: counts as running, not queued.
    continuation: bool = False
    #: Speech codes of the voice prompt (a cloned voice's reference), for the decoder's prepend modes.
    prompt_speech_codes: torch.Tensor | None = None
    #: The forced tokens of layouts with an explicit alignment (phoneme-lpc: fixed by the prompt
    #: alone, the sampler may only pick those there); the request's preparation computes it.
    alignment: Any = None
    #: A second input track beside the tokens (a text id per position, raw vectors: core/tracks.py),
    #: for layouts that have one.
    text_track: Any = None
    #: A text stream's rule (the layout's ``text_rule``): the model runner hands it each text id the
    #: backbone samples and feeds back the token it returns; its end says when the speech ends.
    text_rule: Any = None
    #: Word timings of the request's text (offsets into the text it was made from, samples of its
    #: own audio), where the layout knows its alignment; None otherwise.
    words: list | None = None
    #: Generated speech-token ids (end-of-speech not included).
    generated: list[int] = field(default_factory=list)
    #: Layouts whose positions carry whole frames (``codes_per_token`` > 1): the frame of each
    #: generated position, and the prompt's frames ([prompt, codes] with -1 rows for text positions;
    #: None when the prompt has none).
    frames: list[list[int]] = field(default_factory=list)
    prompt_frames: torch.Tensor | None = None
    #: Tokens (prompt, then generated) whose keys and values are in the KV cache.
    processed: int = 0
    #: Generated tokens already turned into audio.
    decoded_index: int = 0
    #: Why it ended; written by the scheduler alone (its update and finish).
    stop_reason: StopReason | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    #: Written by the engine before each scheduling round (deadline scheduling, core/scheduler.py):
    #: when the request's listener runs out of audio (None: not due before an earlier request of its
    #: stream ends), whether it has been heard, and the decode passes to its next audio chunk.
    deadline: float | None = None
    heard: bool = False
    passes_to_chunk: int = 0
    first_token_time: float | None = None
    first_audio_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        self.stream_id = self.stream_id or self.request_id
        # The request's own random generator: its output does not depend on its batch mates.
        seed = self.sampling.seed if self.sampling.seed is not None else secrets.randbits(63)
        self.generator = torch.Generator().manual_seed(seed)
        # Uniform draws made ahead, handed out in order by uniforms().
        self._uniforms: list[float] = []
        self._uniform_next = 0
        frame = self.layout.tokens_per_frame
        # The largest whole-frame count within max_tokens: generation never stops mid-frame.
        self.token_budget = self.sampling.max_tokens - self.sampling.max_tokens % frame
        # What identifies each position's keys and values for the prefix cache: its token id, or
        # where the position is a frame, the frame (many frames share one token id).
        self.cache_prompt: list = self.prompt_ids
        self.cache_generated: list = self.generated
        if self.prompt_frames is not None:
            self.cache_prompt = [tuple(row) if max(row) >= 0 else token
                                 for token, row in zip(self.prompt_ids, self.prompt_frames.tolist())]
        if self.text_rule is not None:  # a position reads the text fed back and the frame's codes
            self.cache_generated = [(token, tuple(frame)) for token, frame in zip(self.generated, self.frames)]
        elif self.layout.codes_per_token > 1:
            self.cache_generated = [tuple(frame) for frame in self.frames]
        if self.text_track is not None:  # the text id (and any vector) is part of each position's input
            self.cache_prompt = [self.text_track.cache_key(i, key) for i, key in enumerate(self.cache_prompt)]
        # Where the alignment forces only the end of speech (a frame layout's), the one position it
        # ends at: no forced run ever follows a sample, and nothing need ask the alignment row by
        # row, step by step (-1: no such alignment).
        lone = self.alignment.lone_forced() if self.alignment is not None else None
        self._end_at = lone[0] if lone is not None and lone[1] == self.layout.end_of_speech else -1

    @property
    def edge_pause_frames(self) -> tuple[int, int]:
        """Frames of pause the speech opens and ends with, where the layout's alignment knows them
        (the built-in voices'); else (0, 0)."""
        return self.alignment.edge_pause_frames if self.alignment is not None else (0, 0)

    @property
    def all_tokens(self) -> list[int]:
        return self.prompt_ids + self.generated

    @property
    def cache_keys(self) -> list:
        """Prompt then generated positions as the prefix cache compares them (see __post_init__)."""
        return self.cache_prompt + self.cache_generated

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

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Ids that end the speech: the layout's end-of-speech, then the request's extra stop ids."""
        # Kept for the settings they came from (every step stages every row's).
        cached = self.__dict__.get("_stop_ids")
        if cached is not None and cached[0] is self.sampling and cached[1] is self.layout:
            return cached[2]
        if not self.layout.stops_by_token:  # the frame ends the speech: no id is a stop candidate
            ids = (self.layout.end_of_speech,)
        else:
            extra = tuple(t for t in self.sampling.stop_token_ids if t != self.layout.end_of_speech)
            ids = (self.layout.end_of_speech, *extra)
        self.__dict__["_stop_ids"] = (self.sampling, self.layout, ids)
        return ids

    def candidate_ids(self, width: int | None = None) -> torch.Tensor:
        """The ids the next token is chosen from: the next frame slot's codebook, then the stop ids
        (padded to ``width`` candidates with end-of-speech, masked off by candidate_mask)."""
        start, end = self.layout.token_range(len(self.generated))
        stops = list(self.stop_ids)
        width = width or self.layout.codebook_size + len(stops)
        stops += [self.layout.end_of_speech] * (width - self.layout.codebook_size - len(stops))
        return torch.cat([torch.arange(start, end), torch.tensor(stops, dtype=torch.long)])

    def candidate_mask(self, width: int | None = None) -> torch.Tensor:
        """Which candidates are allowed now: the layout's forced token where its alignment names
        one, else the slot's codebook, and stop ids only on a frame boundary after min_tokens."""
        position = len(self.generated)
        if self.alignment is not None:
            forced = self.alignment.forced(position)
            if forced is not None:
                return self.candidate_ids(width) == forced
        stops = len(self.stop_ids)
        width = width or self.layout.codebook_size + stops
        mask = torch.zeros(width, dtype=torch.bool)
        mask[: self.layout.codebook_size] = True
        mask[self.layout.codebook_size: self.layout.codebook_size + stops] = (
            self.layout.stops_by_token and self.may_stop(position))
        return mask

    def uniforms(self, count: int) -> list[float]:
        """The next ``count`` uniform draws of this request's generator. They are drawn UNIFORM_BLOCK
        at a time (one call instead of one per step: at hundreds of rows a step the calls were most
        of the host's staging time), which gives the very numbers one draw at a time gives, so a
        seed still means the same speech."""
        if self._uniform_next + count > len(self._uniforms):
            rest = self._uniforms[self._uniform_next:]
            # Drawn into a numpy buffer: a host value that no host-sync check mistakes for a device read.
            fresh = np.empty(max(UNIFORM_BLOCK, count - len(rest)), dtype=np.float32)
            torch.rand(fresh.shape, generator=self.generator, out=torch.from_numpy(fresh))
            self._uniforms, self._uniform_next = rest + fresh.tolist(), 0
        start = self._uniform_next
        self._uniform_next += count
        return self._uniforms[start:start + count]

    def give_back_uniforms(self, values: Sequence[float]) -> None:
        """Draws taken by :meth:`uniforms` but not used (the row table's, when the request leaves
        it): the next draws are these first, so the generator's order holds."""
        self._uniforms, self._uniform_next = list(values) + self._uniforms[self._uniform_next:], 0

    def may_stop(self, position: int) -> bool:
        """Whether the speech may end at generated ``position``: on a frame boundary, after
        min_tokens."""
        return position % self.layout.tokens_per_frame == 0 and position > 0 and position >= self.sampling.min_tokens

    def append_token(self, token_id: int, frame: list[int] | None = None) -> StopReason | None:
        """Records a sampled token (with its frame, for layouts whose positions carry frames);
        returns the stop condition it meets (a stop id or a stop frame, which are not recorded, or
        the end of the budget), None while generation goes on. Ending the request is the
        scheduler's (its update)."""
        position = len(self.generated)
        layout = self.layout
        if self.text_rule is not None:
            return self._append_text_stream(token_id, frame, position)
        # may_stop's test inline, and the stop ids read only where the speech may end: every row of
        # every step passes here.
        may_stop = position % layout.tokens_per_frame == 0 and position > 0 and position >= self.sampling.min_tokens
        if layout.stops_by_token:
            if token_id == layout.end_of_speech or (may_stop and token_id in self.stop_ids):
                return StopReason.END_OF_SPEECH
        elif may_stop and frame is not None and layout.ends_speech(frame):
            return StopReason.END_OF_SPEECH
        code = layout.token_to_code(token_id, position)  # ValueError for an id that is no code of this slot
        if layout.codes_per_token > 1:
            column = layout.token_column
            if frame is None or len(frame) != layout.codes_per_token or frame[column] != code:
                raise ValueError(f"position {position}: a {layout.codes_per_token}-code frame with token {token_id}'s "
                                 f"code in column {column} was expected, got {frame!r}")
            self.frames.append(list(frame))
            key = tuple(frame)
            if self.text_track is not None:
                key = self.text_track.cache_key(len(self.prompt_ids) + position, key)
            self.cache_generated.append(key)
        self.generated.append(token_id)
        return StopReason.MAX_TOKENS if len(self.generated) >= self.token_budget else None

    def forced_run(self, position: int) -> tuple[list[int], bool]:
        """The layout's one rule for forced tokens: the ids its alignment fixes from generated
        position ``position`` on, up to the next slot the model chooses, and whether an end of
        speech comes right after them. ([], False) for layouts without an alignment."""
        run: list[int] = []
        if self.alignment is None:
            return run, False
        while (forced := self.alignment.forced(position + len(run))) is not None:
            if forced == self.layout.end_of_speech:
                return run, True
            run.append(forced)
        return run, False

    @property
    def samples_alone(self) -> bool:
        """Whether every sample comes alone (no forced run follows any: :meth:`tokens_per_sample` is 1)."""
        return self.alignment is None or self._end_at >= 0

    def tokens_per_sample(self, total_position: int) -> int:
        """Tokens known once the token at ``total_position`` (prompt included) is sampled: that
        one, plus the forced run right after it (:meth:`forced_run`), which :meth:`append_sample`
        appends at once so it takes no model step of its own; never past the token budget."""
        if self.alignment is None or self._end_at >= 0:
            return 1
        position = total_position - len(self.prompt_ids)
        return 1 + min(len(self.forced_run(position + 1)[0]), max(0, self.token_budget - position - 1))

    def append_sample(self, token_id: int, frame: list[int] | None = None) -> StopReason | None:
        """Records a sampled token (and its frame), then the forced run that follows it, up to the
        first stop condition met (a forced end of speech is one), which it returns."""
        if self.alignment is None:  # nothing is forced: the sample alone
            return self.append_token(token_id, frame)
        if stop := self.append_token(token_id, frame):
            return stop
        if self._end_at >= 0:  # no run: the speech ends where the alignment ends it
            return StopReason.END_OF_SPEECH if len(self.generated) == self._end_at else None
        run, ends = self.forced_run(len(self.generated))
        for forced in run:
            if stop := self.append_token(forced):
                return stop
        return StopReason.END_OF_SPEECH if ends else None

    def _append_text_stream(self, token_id: int, frame: list[int] | None, position: int) -> StopReason | None:
        """append_token of a text stream's position: the text fed back and the frame's codes; the
        speech ends once the frames its audio needs after the rule's end are sampled."""
        layout = self.layout
        if frame is None or len(frame) != layout.codes_per_token:
            raise ValueError(f"position {position}: a frame of {layout.codes_per_token} codes was expected, got {frame!r}")
        self.frames.append(list(frame))
        key = (token_id, tuple(frame))
        if self.text_track is not None:
            key = self.text_track.cache_key(len(self.prompt_ids) + position, key)
        self.cache_generated.append(key)
        self.generated.append(token_id)
        end = self.text_rule.end_step
        if end is not None and len(self.generated) >= end + layout.frames_after_end:
            return StopReason.END_OF_SPEECH
        return StopReason.MAX_TOKENS if len(self.generated) >= self.token_budget else None

    @property
    def speech_code_count(self) -> int:
        """Audio codes generated so far (the decoder's unit: codes_per_token per position)."""
        if self.text_rule is not None:
            return self.layout.audio_frame_count(len(self.frames), self.text_rule.end_step) * self.layout.codes_per_token
        return len(self.generated) * self.layout.codes_per_token

    def speech_codes(self, start: int, end: int) -> torch.Tensor:
        """Audio codes [start, end) of the generated speech, frame-major (start on a frame boundary)."""
        per_token = self.layout.codes_per_token
        if self.text_rule is not None:
            return self.layout.audio_codes(self.frames, start // per_token, end // per_token)
        if per_token > 1:
            frames = self.frames[start // per_token:end // per_token]
            return torch.tensor(frames, dtype=torch.long).reshape(-1)
        return self.layout.tokens_to_codes(self.generated[start:end], first_position=start)
