"""Sentence segmentation: a text of any length as the pieces one generation each speaks.

Sentences come from ``pysbd`` (rule-based; it keeps "Mr.", "e.g.", "3.14", initials, quotes and
ellipses inside their sentence). A sentence longer than ``max_chars`` is split at its clause
boundaries (; : , and dashes), and a clause still too long at the last space before the limit.
Every segment keeps its span in the text, and the pause a reader makes after it.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass

from audio_pipeline.text.normalize import NormalizedText

#: Seconds of silence after a segment, by how it ends.
PAUSES = {"sentence": 0.35, "ellipsis": 0.5, "clause": 0.2, "comma": 0.12, "cut": 0.0}

_lock = threading.Lock()
_segmenter_instance = None


@dataclass(frozen=True)
class Segment:
    text: str
    #: Where the segment is in the original text.
    start: int
    end: int
    #: Seconds of silence after it (see PAUSES).
    pause: float
    #: The words already read out, with spans into ``text``'s source (an SSML segment's: its
    #: markup read); None: the segment's text is normalized when it is prepared.
    normalized: NormalizedText | None = None
    #: Speaking rate, a multiple of the request's speed (SSML <prosody rate>).
    rate: float = 1.0
    #: (start, end, IPA) of SSML <phoneme>s in ``normalized.spoken``.
    phonemes: tuple[tuple[int, int, str], ...] = ()
    #: The pause after it is an SSML <break>'s (not its punctuation's or a boundary's).
    break_after: bool = False
    #: The voice it is spoken in (SSML <voice name>); None: the request's.
    voice: str | None = None


def _split(text: str) -> list[tuple[int, int]]:
    """pysbd's sentence spans. One segmenter for the process, used under a lock (it keeps state
    between calls); its first use loads pysbd's rules, about 50 ms, so servers warm it up."""
    global _segmenter_instance
    with _lock:
        if _segmenter_instance is None:
            import pysbd

            _segmenter_instance = pysbd.Segmenter(language="en", clean=False, char_span=True)
        return [(s.start, s.end) for s in _segmenter_instance.segment(text)]


def _pause(text: str, last: bool) -> float:
    stripped = text.rstrip(" \t\n\"'”’)]")
    if stripped.endswith(("...", "…")):
        return PAUSES["ellipsis"]
    if stripped.endswith((".", "!", "?")) or last:
        return PAUSES["sentence"]
    if stripped.endswith((";", ":", "—", "–", "-")):
        return PAUSES["clause"]
    if stripped.endswith(","):
        return PAUSES["comma"]
    return PAUSES["cut"]


def ending_pause(text: str) -> float:
    """The pause after ``text`` where more of its sentence follows: its punctuation's (0 if none)."""
    return _pause(text, last=False)


def _pieces(text: str, start: int, end: int, max_chars: int) -> list[tuple[int, int]]:
    """[start, end) of ``text`` cut into spans of at most ``max_chars`` (clause boundaries first)."""
    if end - start <= max_chars:
        return [(start, end)]
    window = text[start:start + max_chars]
    cuts = [m.end() for m in re.finditer(r"[;:,—–]\s|\s[-—–]\s", window)]
    cut = cuts[-1] if cuts else 0
    if cut < max_chars // 4:  # no clause boundary worth using: the last space
        space = window.rfind(" ")
        cut = space + 1 if space > 0 else max_chars
    return [(start, start + cut)] + _pieces(text, start + cut, end, max_chars)


def segments(text: str, max_chars: int = 400) -> list[Segment]:
    """The text's sentences (long ones cut into clauses), in order, blank ones left out."""
    out: list[Segment] = []
    spans = _split(text) or [(0, len(text))]
    for sentence_start, sentence_end in spans:
        for start, end in _pieces(text, sentence_start, sentence_end, max_chars):
            piece = text[start:end]
            if not piece.strip():
                continue
            lead = len(piece) - len(piece.lstrip())
            trail = len(piece) - len(piece.rstrip())
            out.append(Segment(piece.strip(), start + lead, end - trail, 0.0))
    return [Segment(s.text, s.start, s.end, _pause(s.text, i == len(out) - 1)) for i, s in enumerate(out)]
