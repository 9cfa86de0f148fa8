"""Word timings as files: JSON for programs, WebVTT for captions (``tts-client --timings``)."""

from __future__ import annotations

import json
from collections.abc import Sequence

from audio_pipeline_client.types import WordTiming


def timings_json(words: Sequence[WordTiming]) -> str:
    """A JSON document: ``{"sample_rate": ..., "words": [{text, spoken, start, end, start_sample,
    end_sample, text_start, text_end, precision}, ...]}`` (times in seconds)."""
    rate = words[0].sample_rate if words else 0
    return json.dumps({"sample_rate": rate, "words": [
        {"text": w.text, "spoken": w.spoken, "start": round(w.start_seconds, 4), "end": round(w.end_seconds, 4),
         "start_sample": w.start_sample, "end_sample": w.end_sample, "text_start": w.text_start,
         "text_end": w.text_end, "precision": w.precision} for w in words]}, indent=1, ensure_ascii=False) + "\n"


def _vtt_time(seconds: float) -> str:
    millis = int(round(seconds * 1000))
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    return f"{hours:02d}:{minutes:02d}:{millis // 1000:02d}.{millis % 1000:03d}"


def timings_webvtt(words: Sequence[WordTiming]) -> str:
    """A WebVTT document with one cue per word (or segment), showing the text as written."""
    lines = ["WEBVTT", ""]
    for number, word in enumerate(words, 1):
        # A cue's text may not hold an empty line or "-->"; the written word never needs either.
        text = " ".join(word.text.split()).replace("-->", "->")
        lines += [str(number), f"{_vtt_time(word.start_seconds)} --> {_vtt_time(max(word.end_seconds, word.start_seconds))}",
                  text, ""]
    return "\n".join(lines)


def timings_document(words: Sequence[WordTiming], path: str) -> str:
    """WebVTT when ``path`` ends in .vtt, JSON otherwise."""
    return timings_webvtt(words) if str(path).lower().endswith(".vtt") else timings_json(words)
