"""Per-stream decoding state and batched decoding of many streams' chunks.

The rules are ../shared/design/streaming.md's; in short, for chunk k of a stream whose generated
codes are G, whose voice-prompt codes are P, with ``d`` codes already decoded and ``e`` the end
of this chunk (from :class:`~audio_pipeline.decoders.chunker.ChunkSchedule`):

- ``eff = min(buffer, d)`` generated codes of left context: ``G[d - eff : d]``;
- prompt context, by ``prepend``:
  NEVER: none; ONCE: all of P before chunk 0, none later; ROLLING: all of P before chunk 0, and
  before a later chunk the last ``buffer - eff`` codes of P (the context window is filled with
  generated codes first, the rest from the prompt's tail);
- the decoder gets ``prompt context + generated context + G[d:e]``; the audio of the contexts is
  dropped, so each chunk yields exactly the samples of its new codes.

With ``block_causal`` the decoder keeps per-stream state (cached activations of everything
decoded before) instead: each chunk is decoded as its own block on top of the state, context is
never recomputed and earlier audio never depends on later codes. With the ONCE / ROLLING modes the
prompt is decoded first as its own block, priming the state. ``prepend_causal`` does the same for
the prompt part only, while generated context is recomputed as usual.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from audio_pipeline.decoders.base import AudioDecoder
from audio_pipeline.decoders.chunker import ChunkSchedule, DecodeWindow


def _mode(value: Any) -> str:
    return str(getattr(value, "value", value)).lower()


@dataclass(frozen=True)
class DecoderInput:
    """What one chunk hands the decoder: prompt codes, generated context, new codes."""

    prompt: torch.Tensor
    context: torch.Tensor
    new: torch.Tensor

    @property
    def codes(self) -> torch.Tensor:
        return torch.cat([self.prompt, self.context, self.new])


class DecoderStream:
    """One request's decoding state (chunk index, decoded_index, block-causal caches)."""

    def __init__(self, decoder: AudioDecoder, *, chunk_size: list[int] | None, buffer: int = 0,
                 block_causal: bool = False, prepend: Any = "never", prepend_causal: bool = False,
                 prompt_codes: torch.Tensor | None = None):
        self.decoder = decoder
        self.schedule = ChunkSchedule(chunk_size, buffer)
        self.buffer = buffer
        self.block_causal = block_causal
        self.prepend = _mode(prepend)
        if self.prepend not in ("never", "once", "rolling"):
            raise ValueError(f"prepend must be never, once or rolling, got {prepend!r}")
        self.prepend_causal = prepend_causal
        frame = decoder.tokens_per_frame
        if (block_causal or prepend_causal) and not decoder.supports_block_causal:
            raise ValueError(f"block_causal: the audio decoder {decoder.name!r} does not support block-causal decoding")
        if prompt_codes is not None and prompt_codes.numel() % frame:
            raise ValueError(f"prompt codes must be whole {frame}-code frames, got {prompt_codes.numel()}")
        if prompt_codes is not None and prompt_codes.numel() == 0:
            prompt_codes = None
        self.prompt_codes = prompt_codes.long().cpu() if prompt_codes is not None else None
        self.decoded_index = 0
        self.chunks_decoded = 0
        #: Block-causal state of the decoder for this stream (after everything decoded so far).
        self.state: Any = decoder.init_state() if block_causal else None  # type: ignore[attr-defined]
        self._primed = False
        #: Decoder state after the prompt alone (prepend_causal).
        self.prompt_state: Any = None
        self.closed = False

    @property
    def uses_prompt(self) -> bool:
        return self.prompt_codes is not None and self.prepend != "never"

    def next_window(self, generated: int, finished: bool) -> DecodeWindow | None:
        """The next chunk to decode for a stream with ``generated`` codes, or None (no state change)."""
        window = self.schedule.next_window(generated, self.decoded_index, self.chunks_decoded, finished)
        if window is not None and self.block_causal:  # the state replaces recomputed context
            window = DecodeWindow(window.start + window.context_tokens, window.end, 0, window.chunk_index,
                                  window.final)
        return window

    def prompt_context(self, window: DecodeWindow) -> torch.Tensor:
        """The prompt codes this chunk gets as context, per the prepend mode (not block-causal)."""
        empty = torch.zeros(0, dtype=torch.long)
        if not self.uses_prompt or self.block_causal:
            return empty
        prompt = self.prompt_codes
        if window.chunk_index == 0:
            return prompt
        if self.prepend == "rolling":
            room = self.buffer - window.context_tokens
            return prompt[prompt.numel() - min(room, prompt.numel()):] if room > 0 else empty
        return empty

    def decoder_input(self, window: DecodeWindow, codes: torch.Tensor) -> DecoderInput:
        """Splits ``codes`` (generated codes [window.start, window.end)) into what the decoder gets."""
        codes = codes.long().cpu()
        if codes.numel() != window.end - window.start:
            raise ValueError(f"expected {window.end - window.start} codes for the window, got {codes.numel()}")
        return DecoderInput(self.prompt_context(window), codes[: window.context_tokens], codes[window.context_tokens:])

    def close(self) -> None:
        """Frees the stream's state (idempotent)."""
        self.state = None
        self.prompt_state = None
        self.closed = True


def _decode_blocks(decoder: AudioDecoder, blocks: list[torch.Tensor], states: list[Any],
                   offsets: list[int]) -> list[tuple[torch.Tensor, Any]]:
    method = decoder.decode_blocks  # type: ignore[attr-defined]
    if "frame_offsets" in inspect.signature(method).parameters:
        return method(blocks, states, frame_offsets=offsets)
    return method(blocks, states)


def _base_frame(stream: DecoderStream, frame: int) -> int:
    """Where generated frame 0 sits in the stream: after the prompt's frames when the prompt is used."""
    return stream.prompt_codes.numel() // frame if stream.uses_prompt else 0


def decode_windows(decoder: AudioDecoder, jobs: list[tuple[DecoderStream, DecodeWindow, torch.Tensor]]
                   ) -> list[torch.Tensor]:
    """Decodes every job's chunk in as few batched decoder calls as possible and advances each stream.

    jobs: (stream, window from stream.next_window, the stream's generated codes [window.start:
    window.end]). Returns each job's new audio: exactly (new codes / tokens_per_frame) *
    samples_per_frame samples (1-D float32, CPU).
    """
    frame = decoder.tokens_per_frame
    spf = decoder.samples_per_frame
    results: list[torch.Tensor | None] = [None] * len(jobs)

    # Streams whose prompt must first prime a block-causal state (block_causal, or prepend_causal).
    priming = [s for s, w, _ in jobs if s.uses_prompt and not s._primed and (s.block_causal or s.prepend_causal)]
    if priming:
        primed = _decode_blocks(decoder, [s.prompt_codes for s in priming],
                                [decoder.init_state() for _ in priming], [0] * len(priming))  # type: ignore[attr-defined]
        for stream, (_, state) in zip(priming, primed):
            stream._primed = True
            if stream.block_causal:
                stream.state = state
            else:
                stream.prompt_state = state

    plain: list[int] = []
    stateful: list[int] = []
    inputs: list[DecoderInput] = []
    for index, (stream, window, codes) in enumerate(jobs):
        if stream.closed:
            raise ValueError("decode_windows: the stream was closed")
        item = stream.decoder_input(window, codes)
        inputs.append(item)
        if stream.block_causal or (stream.prepend_causal and item.prompt.numel()):
            stateful.append(index)
        else:
            plain.append(index)

    if plain:
        batch = [inputs[i].codes for i in plain]
        if "frame_offsets" in inspect.signature(decoder.decode_batch).parameters:
            # Position-dependent decoders (SNAC's noise) see each input at its place in the stream:
            # generated frame j sits after the prompt's frames when the prompt is in use.
            offsets = []
            for i in plain:
                stream, window, _ = jobs[i]
                offsets.append(_base_frame(stream, frame) + window.start // frame - inputs[i].prompt.numel() // frame)
            waves = decoder.decode_batch(batch, frame_offsets=offsets)
        else:
            waves = decoder.decode_batch(batch)
        for i, wave in zip(plain, waves):
            item = inputs[i]
            drop = (item.prompt.numel() + item.context.numel()) // frame * spf
            results[i] = wave[drop:drop + item.new.numel() // frame * spf]
    if stateful:
        blocks, states, offsets = [], [], []
        for i in stateful:
            stream, window, item = jobs[i][0], jobs[i][1], inputs[i]
            offsets.append(_base_frame(stream, frame) + window.start // frame)
            if stream.block_causal:
                blocks.append(item.new)
                states.append(stream.state)
            else:  # prepend_causal: the prompt's cached state, then generated context and new codes
                blocks.append(torch.cat([item.context, item.new]))
                states.append(stream.prompt_state)
        decoded = _decode_blocks(decoder, blocks, states, offsets)
        for i, (wave, state) in zip(stateful, decoded):
            stream, item = jobs[i][0], inputs[i]
            if stream.block_causal:
                stream.state = state
                results[i] = wave
            else:
                drop = item.context.numel() // frame * spf
                results[i] = wave[drop:drop + item.new.numel() // frame * spf]

    for (stream, window, _), wave in zip(jobs, results):
        stream.decoded_index = window.end
        stream.chunks_decoded += 1
    return [w.detach().to("cpu", torch.float32) for w in results]  # type: ignore[union-attr]
