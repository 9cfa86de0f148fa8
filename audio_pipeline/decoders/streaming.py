"""Per-stream decoding state, and batched decoding of many streams' chunks.

:class:`~audio_pipeline.decoders.chunker.ChunkSchedule` says which tokens a chunk's decoder call gets
(prompt context, generated context, new tokens); this module makes the calls. Three kinds of work,
each one batched decoder call for all the streams that need it:

- plain: ``prompt tail + generated context + new`` decoded as one window (``decode_batch``);
- block-causal (``block_causal``): the new tokens alone, on the stream's state (``decode_blocks``),
  which holds the cached activations of everything decoded before; the prompt, when prepended, is
  decoded first as a block of its own that primes the state;
- ``prepend_causal`` alone: the prompt is decoded once as its own block; chunks that get prompt
  context decode ``generated context + new`` on that prompt state, so the prompt never sees the
  chunk, while generated context is recomputed as usual. (ROLLING hands such a chunk the prompt's
  tail; the state it continues from is that of the whole prompt, which is the same thing as far
  as the decoder's receptive field reaches.)

The audio of every context token is dropped, so each chunk yields exactly the samples of its new
tokens and the chunks of a stream add up to the one-shot decode's length.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from audio_pipeline.decoders.base import AudioDecoder
from audio_pipeline.decoders.chunker import ChunkSchedule, DecodeWindow

if TYPE_CHECKING:
    from audio_pipeline.config import PrependPromptSpeechTokens


class DecoderStream:
    """One request's decoding state (chunk index, decoded_index, block-causal caches)."""

    def __init__(self, decoder: AudioDecoder, *, chunk_size: list[int] | None, buffer: int = 0,
                 block_causal: bool = False, prepend: PrependPromptSpeechTokens | str = "never",
                 prepend_causal: bool = False, prompt_codes: torch.Tensor | None = None):
        frame = decoder.tokens_per_frame
        if (block_causal or prepend_causal) and not decoder.supports_block_causal:
            field = "block_causal" if block_causal else "prepend_prompt_speech_tokens_causal"
            raise ValueError(f"{field}: the audio decoder {decoder.name!r} does not support block-causal decoding")
        for name, count in (("buffer", buffer), *(("chunk_size", size) for size in chunk_size or ())):
            if count % frame:
                raise ValueError(f"{name}: {count} is not a multiple of the decoder's {frame} tokens per frame")
        if prompt_codes is not None and (prompt_codes.dim() != 1 or prompt_codes.numel() % frame):
            raise ValueError(f"prompt codes must be a 1-D tensor of whole {frame}-code frames, "
                             f"got shape {tuple(prompt_codes.shape)}")
        # A decoder whose state carries everything decodes each chunk on it, block_causal or not.
        block_causal = block_causal or decoder.causal_state
        self.decoder = decoder
        self.prompt_codes = (prompt_codes.detach().long().cpu() if prompt_codes is not None
                             else torch.zeros(0, dtype=torch.long))
        self.schedule = ChunkSchedule(chunk_size, buffer, block_causal=block_causal, prepend=prepend,
                                      prompt_tokens=self.prompt_codes.numel())
        self.block_causal = block_causal
        self.prepend_causal = prepend_causal
        #: Generated codes already turned into audio.
        self.decoded_index = 0
        self.chunks_decoded = 0
        #: Decoder state after everything decoded so far (block_causal).
        self.state: Any = decoder.init_state() if block_causal else None
        #: Decoder state after the prompt alone (prepend_causal without block_causal).
        self.prompt_state: Any = None
        self.closed = False
        #: Generated codes at which the next chunk falls due while the stream runs (next_window
        #: returns one from there; a finished stream's final chunk may come sooner).
        self.due_at = self._due_at()

    @property
    def prompt_frames(self) -> int:
        """Frames of prompt in front of generated frame 0 when the prompt is decoded at all."""
        if self.schedule.prepend == "never":
            return 0
        return self.prompt_codes.numel() // self.decoder.tokens_per_frame

    def next_window(self, generated: int, finished: bool) -> DecodeWindow | None:
        """The next chunk to decode for a stream with ``generated`` codes, or None (no state change)."""
        if self.closed:
            return None
        return self.schedule.next_window(generated, self.decoded_index, self.chunks_decoded, finished)

    def close(self) -> None:
        """Frees the stream's state (idempotent)."""
        self.state = None
        self.prompt_state = None
        self.closed = True
        self.due_at = math.inf

    def _due_at(self) -> float:
        length = self.schedule.chunk_length(self.chunks_decoded)
        return math.inf if length is None or self.closed else self.decoded_index + length

    def _prompt_tail(self, window: DecodeWindow) -> torch.Tensor:
        return self.prompt_codes[self.prompt_codes.numel() - window.prompt_tokens:]

    def _prompt_is_a_block(self, window: DecodeWindow) -> bool:
        return window.prompt_tokens > 0 and (self.block_causal or self.prepend_causal)

    def _advance(self, window: DecodeWindow) -> None:
        self.decoded_index = window.end
        self.chunks_decoded += 1
        self.due_at = self._due_at()
        if self.schedule.prompt_context(self.chunks_decoded, min(self.schedule.buffer, self.decoded_index)) == 0:
            self.prompt_state = None  # no later chunk gets prompt context


def _with_offsets(decoder: AudioDecoder, offsets: list[int]) -> dict[str, Any]:
    """``frame_offsets`` for a decoder that declares it takes them (see AudioDecoder), else nothing."""
    return {"frame_offsets": offsets} if decoder.takes_frame_offsets else {}


def _decode_blocks(decoder: AudioDecoder, blocks: list[torch.Tensor], states: list[Any],
                   offsets: list[int]) -> list[tuple[torch.Tensor, Any]]:
    return decoder.decode_blocks(blocks, states, **_with_offsets(decoder, offsets))


def _decode_batch(decoder: AudioDecoder, batch: list[torch.Tensor], offsets: list[int]) -> list[torch.Tensor]:
    return decoder.decode_batch(batch, **_with_offsets(decoder, offsets))


def decode_windows(decoder: AudioDecoder, jobs: list[tuple[DecoderStream, DecodeWindow, torch.Tensor]]
                   ) -> list[torch.Tensor]:
    """Decodes every job's chunk in as few batched decoder calls as possible and advances each stream.

    jobs: (stream, window from stream.next_window, the stream's GENERATED codes [window.start:
    window.end] as a 1-D tensor). Returns each job's new audio: exactly (new codes /
    tokens_per_frame) * samples_per_frame samples, 1-D float32 on the CPU.
    """
    frame, samples_per_frame = decoder.tokens_per_frame, decoder.samples_per_frame
    for stream, window, codes in jobs:
        if stream.closed:
            raise ValueError("decode_windows: the stream was closed")
        if stream.decoder is not decoder:
            raise ValueError("decode_windows: a stream belongs to another decoder")
        if window.start + window.context_tokens != stream.decoded_index:
            raise ValueError(f"decode_windows: the window's new codes start at {window.start + window.context_tokens}, "
                             f"the stream has decoded {stream.decoded_index}")
        if codes.dim() != 1 or codes.numel() != window.end - window.start:
            raise ValueError(f"decode_windows: expected {window.end - window.start} codes for the window, "
                             f"got shape {tuple(codes.shape)}")
    if len({id(stream) for stream, _, _ in jobs}) != len(jobs):
        raise ValueError("decode_windows: one chunk per stream per call")

    # 1. Prompts that are blocks of their own prime their stream's state.
    priming = [(stream, window) for stream, window, _ in jobs
               if stream._prompt_is_a_block(window) and (stream.block_causal or stream.prompt_state is None)]
    if priming:
        primed = _decode_blocks(decoder, [stream._prompt_tail(window) for stream, window in priming],
                                [decoder.init_state() for _ in priming],
                                [stream.prompt_frames - window.prompt_tokens // frame for stream, window in priming])
        for (stream, _), (_, state) in zip(priming, primed):
            if stream.block_causal:
                stream.state = state
            else:
                stream.prompt_state = state

    # 2. Everything else: stateful blocks in one call, plain windows in another.
    results: list[torch.Tensor | None] = [None] * len(jobs)
    new_states: dict[int, Any] = {}
    stateful: list[tuple[int, torch.Tensor, Any, int, int]] = []  # job, codes, state, offset, dropped
    plain: list[tuple[int, torch.Tensor, int, int]] = []  # job, codes, offset, dropped
    for index, (stream, window, codes) in enumerate(jobs):
        codes = codes.detach().long().cpu()
        first_frame = stream.prompt_frames + window.start // frame
        dropped = window.context_tokens // frame * samples_per_frame
        if stream.block_causal:
            stateful.append((index, codes, stream.state, first_frame, 0))
        elif stream._prompt_is_a_block(window):
            stateful.append((index, codes, stream.prompt_state, first_frame, dropped))
        else:
            prompt = stream._prompt_tail(window)
            plain.append((index, torch.cat([prompt, codes]), first_frame - prompt.numel() // frame,
                          dropped + prompt.numel() // frame * samples_per_frame))
    if stateful:
        decoded = _decode_blocks(decoder, [codes for _, codes, _, _, _ in stateful],
                                 [state for _, _, state, _, _ in stateful], [offset for *_, offset, _ in stateful])
        for (index, _, _, _, dropped), (wave, state) in zip(stateful, decoded):
            results[index] = wave[dropped:]
            new_states[index] = state
    if plain:
        waves = _decode_batch(decoder, [codes for _, codes, _, _ in plain], [offset for _, _, offset, _ in plain])
        for (index, _, _, dropped), wave in zip(plain, waves):
            results[index] = wave[dropped:]

    for (_, window, _), wave in zip(jobs, results):
        expected = window.new_tokens // frame * samples_per_frame
        if wave is None or wave.dim() != 1 or wave.numel() != expected:
            raise RuntimeError(f"audio decoder {decoder.name!r} returned {None if wave is None else tuple(wave.shape)} "
                               f"samples for {window.new_tokens} new codes, expected {expected}")
    for index, (stream, window, _) in enumerate(jobs):
        if stream.block_causal:
            stream.state = new_states[index]
        stream._advance(window)
    return [wave.detach().to("cpu", torch.float32) for wave in results]  # type: ignore[union-attr]
