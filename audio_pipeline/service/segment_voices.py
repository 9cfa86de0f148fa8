"""The voices of a request's segments: an SSML document's ``<voice name="...">`` elements.

Where each segment is its own generation, a ``<voice>``'s segments are spoken with that voice's
settings (the request's otherwise: its sampling, speed, language and pronunciations, the voice's
own lexicon), each checked up front, before any audio: an unknown voice is refused naming the
element. Where the layout has ``speaker_turns`` (Kyutai TTS), the document is one dialogue: the
request's voice is the main speaker, the one other voice its ``<voice>`` elements name is the other
speaker, and each segment says whose turn it is. A model that reads all of a request's text in
one generation and knows one speaker (a text stream without speaker turns) speaks the request's
voice only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from audio_pipeline.errors import InvalidArgument, RequestError, echo
from audio_pipeline.service.prepare import RequestSettings
from audio_pipeline.text.segment import Segment


@dataclass(frozen=True)
class SegmentVoices:
    """What each segment is spoken with."""

    #: The request's settings (a dialogue's with its ``other_voice``).
    settings: RequestSettings
    #: The settings of each voice a ``<voice>`` names (models that speak a voice per generation).
    by_voice: Mapping[str, RequestSettings] = field(default_factory=dict)
    #: A dialogue: the names that mean its other speaker.
    others: frozenset[str] = frozenset()

    def settings_of(self, segment: Segment) -> RequestSettings:
        return self.by_voice.get(segment.voice, self.settings)  # (None, the request's voice, is no key)

    def speaker(self, segment: Segment) -> int:
        """Whose turn a segment is in a dialogue: 0 the request's voice, 1 the other."""
        return 1 if segment.voice in self.others else 0


def segment_voices(settings: RequestSettings, segments: Sequence[Segment], layout,
                   resolve: Callable[[str], RequestSettings]) -> SegmentVoices:
    """The voices of ``segments`` given the request's ``settings``; ``resolve(name)`` checks a
    named voice's settings (raising the RequestError that refuses it). Raises a RequestError naming
    ``text`` and the element for a voice that cannot be spoken."""
    named = list(dict.fromkeys(segment.voice for segment in segments if segment.voice is not None))
    if not named:
        return SegmentVoices(settings)
    resolved: dict[str, RequestSettings] = {}
    for name in named:
        try:
            resolved[name] = resolve(name)
        except RequestError as error:
            raise type(error)(f"SSML <voice name={echo(name)}>: {error.detail}", field="text") from None
    others = [name for name in named if resolved[name].voice != settings.voice]
    if not layout.text_stream:
        return SegmentVoices(settings, by_voice=resolved)
    if not others:
        return SegmentVoices(settings)
    if not layout.speaker_turns:
        raise InvalidArgument(f"SSML <voice name={echo(others[0])}>: this model speaks one voice a request "
                              f"(the request's, {echo(settings.voice or '')})", field="text")
    distinct = list(dict.fromkeys(resolved[name].voice for name in others))
    if len(distinct) > 1:
        raise InvalidArgument(f"SSML <voice>: this model speaks a dialogue of two voices, the request's "
                              f"({echo(settings.voice or '')}) and one other; the document names "
                              f"{echo(distinct[0])} and {echo(distinct[1])}", field="text")
    return SegmentVoices(dataclasses.replace(settings, other_voice=distinct[0]), others=frozenset(others))
