"""Word timings: which words of the request's text sound when in its audio.

A layout with a known alignment (the built-in voice's phoneme-lpc) says which frames each spoken
word takes (:class:`audio_pipeline.text.espeak.WordFrames`, offsets into the normalized text).
:func:`word_timings` turns those into :class:`WordTiming`s of the text the client sent: the
normalizer's spans map each spoken word back to what was written, and spoken words that read one
written piece ("five dollars" of "$5") become one timing, so a caption shows the words as written.
Layouts without an alignment get one timing per segment (:data:`SEGMENT`), made where the
segment's audio ends.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from audio_pipeline.text.espeak import WordFrames
from audio_pipeline.text.normalize import NormalizedText

#: The timing's start and end come from the model's alignment of that very word.
WORD = "word"
#: The timing covers a whole segment (a sentence or clause): the layout has no word alignment.
SEGMENT = "segment"


@dataclass(frozen=True)
class WordTiming:
    """``text`` (``original[text_start:text_end]``) sounds in samples [start_sample, end_sample)."""

    text: str
    text_start: int
    text_end: int
    start_sample: int
    end_sample: int
    #: The words the audio says for it ("five dollars" for "$5").
    spoken: str
    precision: str = WORD

    def shifted(self, chars: int, samples: int) -> "WordTiming":
        """The same timing with its text offsets moved by ``chars`` and its samples by ``samples``."""
        return dataclasses.replace(self, text_start=self.text_start + chars, text_end=self.text_end + chars,
                                   start_sample=self.start_sample + samples, end_sample=self.end_sample + samples)

    def resampled(self, from_rate: int, to_rate: int) -> "WordTiming":
        """The same timing on a ``to_rate`` sample clock."""
        if from_rate == to_rate:
            return self
        return dataclasses.replace(self, start_sample=self.start_sample * to_rate // from_rate,
                                   end_sample=self.end_sample * to_rate // from_rate)


def word_timings(text: NormalizedText, words: Sequence[WordFrames], samples_per_frame: int) -> list[WordTiming]:
    """The timings of ``text.original`` from spoken ``words`` (offsets into ``text.spoken``), in
    order; spoken words whose written sources overlap are merged into one."""
    out: list[WordTiming] = []
    for word in words:
        source_start, source_end = text.source_of(word.start, word.end)
        spoken = text.spoken[word.start:word.end]
        start, end = word.first_frame * samples_per_frame, word.end_frame * samples_per_frame
        if out and source_start < out[-1].text_end:  # another word of the same written piece
            last = out[-1]
            source_end = max(source_end, last.text_end)
            out[-1] = dataclasses.replace(last, text=text.original[last.text_start:source_end], text_end=source_end,
                                          end_sample=max(end, last.end_sample), spoken=f"{last.spoken} {spoken}")
            continue
        out.append(WordTiming(text.original[source_start:source_end], source_start, source_end, start, end, spoken))
    return out


def segment_timing(text: str, samples: int) -> WordTiming:
    """One timing for a whole segment ``text`` of ``samples`` samples (no word alignment)."""
    stripped = text.strip()
    start = text.find(stripped) if stripped else 0
    return WordTiming(stripped, start, start + len(stripped), 0, samples, stripped, SEGMENT)
