"""SSML: the subset voice platforms share, read into the segments a request speaks.

Elements: ``<speak>`` (the root), ``<p>`` and ``<s>`` (a paragraph or sentence: its own segment),
``<break time="500ms"|strength="...">`` (silence), ``<prosody rate="...">`` (speaking rate, within
the speed range), ``<say-as interpret-as="characters|spell-out|cardinal|ordinal|digits|date|time|
telephone">``, ``<sub alias="...">``, ``<phoneme alphabet="ipa" ph="...">``, ``<emphasis>``
(accepted; spoken as it is) and ``<voice name="...">`` (its content in another voice: a segment's
``voice``; the service says what that means for the model). Anything else, an unknown attribute, or malformed XML is refused
with an :class:`InvalidArgument` naming the element and where it is (line, column); markup is
never spoken as words.

Every segment carries a :class:`NormalizedText` whose ``original`` is the document's characters
from its first spoken word to its last, and whose spans map every spoken word back to where it
was written, so word timings point into the document the client sent (a ``<sub>``'s words to the
text it replaces, a ``<say-as>``'s to its content). A document type declaration (and so any
entity of the client's making) is refused: the parser expands nothing but XML's own five
entities and character references.
"""

from __future__ import annotations

import bisect
import itertools
import re
import xml.parsers.expat
from dataclasses import dataclass, field, replace

from audio_pipeline.errors import InvalidArgument
from audio_pipeline.text import normalize as spoken_forms
from audio_pipeline.text.normalize import NormalizedText, Span, normalize
from audio_pipeline.text.segment import PAUSES, Segment, ending_pause, segments

#: Silence a ``<break>`` strength stands for (seconds); "medium" is a sentence's pause.
BREAK_STRENGTHS = {"none": 0.0, "x-weak": 0.1, "weak": 0.2, "medium": PAUSES["sentence"], "strong": 0.6,
                   "x-strong": 1.0}
#: The longest ``<break>`` (the platforms' usual limit), and the most silence one document's breaks
#: may add up to (so a document cannot ask for hours of silence, one 10 s break at a time).
MAX_BREAK_SECONDS = 10.0
MAX_TOTAL_BREAK_SECONDS = 120.0
#: The pause after a ``<p>`` (a ``<s>`` ends with a sentence's).
PARAGRAPH_PAUSE = 0.6
#: ``<prosody rate>`` keywords, as multiples of the request's speed.
#: The range of a rate (the speed range's: a request's speed times the rate is checked again).
MIN_RATE, MAX_RATE = 0.25, 4.0
RATES = {"x-slow": 0.5, "slow": 0.75, "medium": 1.0, "default": 1.0, "fast": 1.5, "x-fast": 2.0}
SAY_AS = ("characters", "spell-out", "cardinal", "number", "ordinal", "digits", "date", "time", "telephone")
#: Attributes each element takes (xml:lang and xmlns are accepted on <speak> and ignored).
ATTRIBUTES = {
    "speak": {"version", "xml:lang", "xmlns", "xmlns:xsi", "xsi:schemaLocation", "xmlns:mstts"},
    "p": set(), "s": set(), "break": {"time", "strength"}, "prosody": {"rate"},
    "say-as": {"interpret-as", "format", "detail"}, "sub": {"alias"}, "phoneme": {"alphabet", "ph"},
    "emphasis": {"level"}, "voice": {"name"},
}
#: Elements whose content is text alone (what they stand for replaces it as one piece).
TEXT_ONLY = {"say-as", "sub", "phoneme"}
MAX_DEPTH = 32
LETTERS = {"a": "ay", "b": "bee", "c": "see", "d": "dee", "e": "ee", "f": "eff", "g": "gee", "h": "aitch",
           "i": "eye", "j": "jay", "k": "kay", "l": "el", "m": "em", "n": "en", "o": "oh", "p": "pee", "q": "cue",
           "r": "ar", "s": "ess", "t": "tee", "u": "you", "v": "vee", "w": "double you", "x": "ex", "y": "why",
           "z": "zee"}


def is_ssml(text: str) -> bool:
    """Whether a request's text is an SSML document (it starts with ``<speak``)."""
    return text.lstrip().startswith("<speak")


@dataclass
class _Text:
    """Written text and where each of its characters came from in the document."""

    written: str
    starts: list[int]
    ends: list[int]
    rate: float
    #: Already the words to say (a <sub> alias or a <say-as> reading): not normalized again.
    fixed: bool = False
    #: A <phoneme>'s IPA for these words.
    ipa: str | None = None
    #: The <voice> it is in (None: the request's).
    voice: str | None = None


@dataclass
class _Stop:
    """A segment boundary: ``pause`` seconds of silence (None: the punctuation's). An ``explicit``
    one (a <break>) sets the silence there; another one's is replaced by a <break> that follows."""

    pause: float | None
    explicit: bool = False


@dataclass
class _Open:
    name: str
    attrs: dict
    where: str
    offset: int
    rate: float
    voice: str | None = None
    text: list[str] = field(default_factory=list)
    #: Where each character of ``text`` is in the document (its start, its end).
    starts: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)


class _Reader:
    def __init__(self, source: str, max_break: float):
        self.source = source
        self.max_break = max_break
        encoded = [len(c.encode("utf-8")) for c in source]
        self.byte_starts = list(itertools.accumulate(encoded, initial=0))
        self.items: list[_Text | _Stop] = []
        self.stack: list[_Open] = []
        self.pending: tuple[str, int] | None = None  # character data waiting for where it ends
        self.silence = 0.0  # seconds of <break> so far
        self.parser = xml.parsers.expat.ParserCreate()
        p = self.parser
        p.StartElementHandler, p.EndElementHandler = self.start, self.end
        p.CharacterDataHandler = self.data
        p.StartDoctypeDeclHandler = self.doctype
        p.EntityDeclHandler = self.doctype
        p.ProcessingInstructionHandler = self.instruction
        p.StartCdataSectionHandler = self.cdata
        p.buffer_text = False

    # --- positions ---------------------------------------------------------------------------------

    def offset(self) -> int:
        return bisect.bisect_left(self.byte_starts, self.parser.CurrentByteIndex)

    def where(self, offset: int | None = None) -> str:
        offset = self.offset() if offset is None else offset
        line = self.source.count("\n", 0, offset) + 1
        column = offset - (self.source.rfind("\n", 0, offset) + 1) + 1
        return f"line {line}, column {column}"

    def fail(self, message: str, offset: int | None = None) -> InvalidArgument:
        return InvalidArgument(f"SSML: {message} (at {self.where(offset)})", field="text")

    # --- handlers ----------------------------------------------------------------------------------

    def flush(self) -> None:
        """The pending character data ends where the parser is now."""
        if self.pending is None:
            return
        data, begin = self.pending
        self.pending = None
        finish = self.offset()
        if finish - begin == len(data):
            if ">" in data:  # XML allows it in text, but here it is a tag's broken remains
                raise self.fail("a '>' outside a tag (write &gt; for the character)", begin + data.index(">"))
            starts = list(range(begin, finish))
            ends = [s + 1 for s in starts]
        else:  # an entity or character reference: every character is the whole of it
            starts, ends = [begin] * len(data), [finish] * len(data)
        if self.stack and self.stack[-1].name in TEXT_ONLY:
            element = self.stack[-1]
            element.text.append(data)
            element.starts += starts
            element.ends += ends
            return
        if not self.stack:
            if data.strip():
                raise self.fail(f"text outside <speak>: {data.strip()[:20]!r}", begin)
            return
        self.items.append(_Text(data, starts, ends, self.stack[-1].rate, voice=self.stack[-1].voice))

    def data(self, data: str) -> None:
        self.flush()
        self.pending = (data, self.offset())

    def doctype(self, *_args) -> None:
        raise self.fail("a document type declaration is not allowed")

    def cdata(self) -> None:
        raise self.fail("a CDATA section is not allowed (escape the text: &lt; &amp;)")

    def instruction(self, target, _data) -> None:
        raise self.fail(f"processing instruction <?{target}?> is not allowed")

    def start(self, name: str, attrs: dict) -> None:
        self.flush()
        offset = self.offset()
        where = self.where(offset)
        if not self.stack and name != "speak":
            raise self.fail(f"the document must be a <speak> element, not <{name}>", offset)
        if self.stack and name == "speak":
            raise self.fail("<speak> inside <speak>", offset)
        if name not in ATTRIBUTES:
            raise self.fail(f"<{name}> is not supported (supported: {', '.join(f'<{n}>' for n in ATTRIBUTES)})",
                            offset)
        if self.stack and self.stack[-1].name in TEXT_ONLY:
            raise self.fail(f"<{self.stack[-1].name}> takes text only, not <{name}>", offset)
        if len(self.stack) >= MAX_DEPTH:
            raise self.fail(f"elements nested deeper than {MAX_DEPTH}", offset)
        unknown = sorted(set(attrs) - ATTRIBUTES[name])
        if unknown:
            allowed = ", ".join(sorted(a for a in ATTRIBUTES[name] if ":" not in a and a != "xmlns")) or "none"
            raise self.fail(f"<{name}> attribute {unknown[0]!r} is not supported (supported: {allowed})", offset)
        rate = self.stack[-1].rate if self.stack else 1.0
        voice = self.stack[-1].voice if self.stack else None
        if name == "voice":
            voice = attrs.get("name", "").strip()
            if not voice:
                raise self.fail("<voice> needs a name", offset)
        if name == "prosody" and "rate" in attrs:
            rate *= self._rate(attrs["rate"], offset)
            if not MIN_RATE <= rate <= MAX_RATE:
                raise self.fail(f"<prosody> rate={attrs['rate']!r} makes the rate {rate:g}, out of range: "
                                f"{MIN_RATE:g} to {MAX_RATE:g} times the request's speed", offset)
        if name in ("p", "s"):
            self.items.append(_Stop(None))
        elif name == "break":
            self.items.append(_Stop(self._break(attrs, offset), explicit=True))
        elif name == "say-as" and attrs.get("interpret-as") not in SAY_AS:
            raise self.fail(f"<say-as> interpret-as={attrs.get('interpret-as', '')!r} is not supported "
                            f"(supported: {', '.join(SAY_AS)})", offset)
        elif name == "sub" and not attrs.get("alias", "").strip():
            raise self.fail("<sub> needs an alias", offset)
        elif name == "phoneme":
            if attrs.get("alphabet", "ipa") != "ipa":
                raise self.fail(f"<phoneme> alphabet={attrs['alphabet']!r} is not supported (supported: ipa)", offset)
            if not attrs.get("ph", "").strip():
                raise self.fail("<phoneme> needs ph", offset)
        elif name == "emphasis" and attrs.get("level", "moderate") not in ("strong", "moderate", "none", "reduced"):
            raise self.fail(f"<emphasis> level={attrs['level']!r} is not one of strong, moderate, none, reduced",
                            offset)
        self.stack.append(_Open(name, attrs, where, offset, rate, voice))

    def end(self, name: str) -> None:
        self.flush()
        element = self.stack.pop()
        if name in TEXT_ONLY:
            self._replacement(element)
        elif name == "p":
            self.items.append(_Stop(PARAGRAPH_PAUSE))
        elif name == "s":
            self.items.append(_Stop(None))

    # --- element values ----------------------------------------------------------------------------

    def _rate(self, value: str, offset: int) -> float:
        text = value.strip().lower()
        try:
            if text in RATES:
                return RATES[text]
            if text.endswith("%"):
                number = float(text[:-1])
                # "+20%"/"-20%": relative to the current rate; "120%": a multiple of it.
                return 1 + number / 100 if text[0] in "+-" else number / 100
            return float(text)
        except ValueError:
            raise self.fail(f"<prosody> rate={value!r} is not a rate (x-slow, slow, medium, fast, x-fast, "
                            "a percentage like 80% or +20%, or a multiple like 1.5)", offset) from None

    def _break(self, attrs: dict, offset: int) -> float:
        if "time" in attrs:
            match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s)\s*", attrs["time"])
            if not match:
                raise self.fail(f"<break> time={attrs['time']!r} is not a duration like 500ms or 1.5s", offset)
            seconds = float(match.group(1)) / (1000 if match.group(2) == "ms" else 1)
            if seconds > self.max_break:
                raise self.fail(f"<break> time={attrs['time']!r} is over the longest break, {self.max_break:g} s",
                                offset)
            return self._counted(seconds, offset)
        strength = attrs.get("strength", "medium")
        if strength not in BREAK_STRENGTHS:
            raise self.fail(f"<break> strength={strength!r} is not one of {', '.join(BREAK_STRENGTHS)}", offset)
        return self._counted(BREAK_STRENGTHS[strength], offset)

    def _counted(self, seconds: float, offset: int) -> float:
        self.silence += seconds
        if self.silence > MAX_TOTAL_BREAK_SECONDS:
            raise self.fail(f"the document's breaks add up to over {MAX_TOTAL_BREAK_SECONDS:g} s of silence", offset)
        return seconds

    def _replacement(self, element: _Open) -> None:
        """A <say-as>, <sub> or <phoneme>: its words, standing for its whole content."""
        content = "".join(element.text)
        inner = content.strip()
        if not inner:
            raise self.fail(f"<{element.name}> is empty", element.offset)
        # The content's place in the document, blanks around it left out.
        lead = len(content) - len(content.lstrip())
        begin, finish = element.starts[lead], element.ends[lead + len(inner) - 1]
        if element.name == "phoneme":
            spoken, fixed, ipa = inner, False, element.attrs["ph"].strip()
        elif element.name == "sub":
            spoken, fixed, ipa = element.attrs["alias"].strip(), False, None
        else:
            spoken, fixed, ipa = self._say_as(element, inner), True, None
        self.items.append(_Text(spoken, [begin] * len(spoken), [finish] * len(spoken), element.rate, fixed, ipa,
                                element.voice))

    def _say_as(self, element: _Open, text: str) -> str:
        kind = element.attrs["interpret-as"]

        def refuse(what: str) -> InvalidArgument:
            return self.fail(f"<say-as interpret-as={kind!r}>: {text[:40]!r} is not {what}", element.offset)

        if kind in ("characters", "spell-out"):
            said = [LETTERS.get(c.lower()) or spoken_forms.digits(c) for c in text if c.isalnum()]
            if not all(said):
                raise refuse("spelled in letters and digits")
            return " ".join(said)
        if kind == "digits":
            if not re.fullmatch(r"[\d\s-]+", text):
                raise refuse("digits")
            return spoken_forms.digits(text)
        if kind in ("cardinal", "number"):
            if not re.fullmatch(r"[-−+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?|[-−+]?\d+(?:\.\d+)?", text):
                raise refuse("a number")
            return spoken_forms.number(text)
        if kind == "ordinal":
            match = re.fullmatch(r"(\d+)(?:st|nd|rd|th)?", text.replace(",", ""))
            if not match:
                raise refuse("an ordinal number")
            return spoken_forms.ordinal(int(match.group(1)))
        if kind == "telephone":
            groups = re.findall(r"\d+", text)
            if not groups or re.search(r"[^\d\s()+.-]", text):
                raise refuse("a telephone number")
            return ", ".join(spoken_forms.digits(g) for g in groups)
        if kind == "time":
            match = re.fullmatch(r"(\d{1,2})(?::(\d{2}))?\s*([aApP]\.?[mM]\.?)?", text)
            if not match or int(match.group(1)) > 23 or int(match.group(2) or 0) > 59:
                raise refuse("a time like 9:15, 14:30 or 7pm")
            return spoken_forms.clock(int(match.group(1)), int(match.group(2) or 0), match.group(3))
        return self._date(element, text, refuse)

    def _date(self, element: _Open, text: str, refuse) -> str:
        order = element.attrs.get("format", "mdy")
        if not re.fullmatch(r"[dmy]{1,3}", order) or len(set(order)) != len(order):
            raise self.fail(f"<say-as interpret-as='date'> format={order!r} is not one of mdy, dmy, ymd, md, dm, "
                            "ym, my, d, m, y", element.offset)
        parts = re.findall(r"\d+", text)
        if len(parts) != len(order) or re.search(r"[^\d\s/.,-]", text):
            raise refuse(f"a date in format {order}")
        value = dict(zip(order, (int(p) for p in parts)))
        if not 1 <= value.get("m", 1) <= 12 or not 1 <= value.get("d", 1) <= 31:
            raise refuse(f"a date in format {order}")
        if "y" in value and len(parts[order.index("y")]) == 2:
            value["y"] += 2000 if value["y"] < 50 else 1900
        words = []
        if "m" in value:
            words.append(spoken_forms.MONTHS[value["m"] - 1])
        if "d" in value:
            words.append(spoken_forms.ordinal(value["d"]) if "m" in value else f"the {spoken_forms.ordinal(value['d'])}")
        if "y" in value:
            if words:
                words[-1] += ","
            words.append(spoken_forms.year(value["y"]))
        return " ".join(words)

    def read(self) -> list[_Text | _Stop]:
        try:
            self.parser.Parse(self.source, True)
        except xml.parsers.expat.ExpatError as error:
            message = xml.parsers.expat.errors.messages.get(error.code, str(error)) if hasattr(error, "code") else str(error)
            line, column = error.lineno, error.offset + 1
            raise InvalidArgument(f"SSML: not well-formed XML: {message} (at line {line}, column {column})",
                                  field="text") from None
        return self.items


_TOKEN = re.compile(r"\w+(?:['’]\w+)*|[^\w\s]")


def _words(item: _Text, normalize_text: bool) -> list[tuple[str, int, int, bool]]:
    """(spoken token, document start, document end, whitespace before it) of one piece of text."""
    spoken = normalize(item.written) if normalize_text and not item.fixed else NormalizedText(item.written,
                                                                                           item.written)
    out = []
    for match in _TOKEN.finditer(spoken.spoken):
        a, b = spoken.source_of(match.start(), match.end())
        a = min(a, len(item.starts) - 1)
        b = min(max(b, a + 1), len(item.ends))
        spaced = spoken.spoken[match.start() - 1].isspace() if match.start() else item.written[:1].isspace()
        out.append((match.group(), item.starts[a], item.ends[b - 1], spaced))
    return out


def _block(items: list[_Text], normalize_text: bool):
    """The spoken text of consecutive pieces, its spans into the document, and its <phoneme>s."""
    spoken, spans, phonemes = "", [], []
    for item in items:
        first = len(spoken)
        for index, (token, start, end, spaced) in enumerate(_words(item, normalize_text)):
            # Words of two pieces never run together ("<sub>...</sub>word"); punctuation keeps its place.
            joined = index == 0 and token[0].isalnum() and spoken[-1:].isalnum()
            if spoken and (spaced or joined):
                spoken += " "
            spans.append(Span(len(spoken), len(spoken) + len(token), start, end))
            spoken += token
        if item.ipa and len(spoken) > first:
            phonemes.append((first + (spoken[first] == " "), len(spoken), item.ipa))
    return spoken, spans, phonemes


def parse(source: str, *, normalize_text: bool = True, max_segment_chars: int = 400,
          max_break: float = MAX_BREAK_SECONDS) -> list[Segment]:
    """The segments an SSML document speaks, in order (text/segment.py's, with their words already
    read out in ``normalized``, whose ``original`` is the document from the segment's first source
    character to its last, ``start`` where that is in the document, the ``rate`` as a multiple of
    the request's speed, and each ``<phoneme>``'s (start, end, IPA) in ``phonemes``);
    InvalidArgument (field ``text``) naming the element and its place for anything malformed or
    unsupported, or a document with nothing to say."""
    items = _Reader(source, max_break).read()
    out: list[Segment] = []
    run: list[_Text] = []
    explicit = False  # the last segment's pause was set by a <break>

    def close(stop: _Stop | None) -> None:
        """Ends the run of text so far: at a <s>/<p> boundary or a <break> (``stop``), or where the
        rate or the voice changes (None: the run's last piece keeps the pause its punctuation gives)."""
        nonlocal explicit
        if not any(item.written.strip() for item in run):
            run.clear()
            if out and stop is not None and stop.pause is not None:
                if stop.explicit:  # breaks in a row add up; a break replaces a boundary's pause
                    out[-1] = replace(out[-1], pause=out[-1].pause + stop.pause if explicit else stop.pause,
                                      break_after=True)
                    explicit = True
                elif not explicit:
                    out[-1] = replace(out[-1], pause=stop.pause)
            return
        spoken, spans, phonemes = _block(run, normalize_text)
        rate, voice = run[0].rate, run[0].voice
        run.clear()
        pieces = segments(spoken, max_segment_chars)
        for number, piece in enumerate(pieces):
            mine = [s for s in spans if piece.start <= s.start and s.end <= piece.end]
            if not mine:
                continue
            start, end = min(s.source_start for s in mine), max(s.source_end for s in mine)
            local = [Span(s.start - piece.start, s.end - piece.start, s.source_start - start, s.source_end - start)
                     for s in mine]
            normalized = NormalizedText(source[start:end], spoken[piece.start:piece.end], local)
            marks = tuple((a - piece.start, b - piece.start, ipa) for a, b, ipa in phonemes
                          if piece.start <= a and b <= piece.end)
            pause = piece.pause
            if number == len(pieces) - 1 and stop is None:  # mid-sentence: the punctuation's pause only
                pause = ending_pause(piece.text)
            out.append(Segment(normalized.spoken, start, end, pause, normalized, rate, marks, voice=voice))
        if stop is not None and stop.pause is not None:
            out[-1] = replace(out[-1], pause=stop.pause, break_after=stop.explicit)
        explicit = stop is not None and stop.explicit

    for item in items:
        if isinstance(item, _Stop):
            close(item)
        elif run and (item.rate, item.voice) != (run[-1].rate, run[-1].voice):
            close(None)
            run.append(item)
        elif run and _plain(run[-1]) and _plain(item):  # one text, normalized as one
            last = run[-1]
            run[-1] = _Text(last.written + item.written, last.starts + item.starts, last.ends + item.ends, last.rate)
        else:
            run.append(item)
    close(_Stop(None))
    if not out:
        raise InvalidArgument("SSML: the document has nothing to speak", field="text")
    return out


def _plain(item: _Text) -> bool:
    return not item.fixed and item.ipa is None
