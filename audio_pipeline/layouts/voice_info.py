"""A voice a model offers: its name, what it sounds like, its language. Its own module, so that the
manifest (which lists a model's voices) and the family layouts (which name their preset voices)
both import it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VoiceInfo:
    name: str
    description: str = ""
    language: str = "en-US"
