"""Pronunciation lexicons: a word said as given phonemes, or as another spelling.

A lexicon comes with a request (a list of ``{"word", "phonemes"}`` or ``{"word", "respelling"}``
entries) or with a voice (the server's ``pronunciations`` file: JSON, or a W3C PLS lexicon as
voice platforms take them); a request's entry wins over its voice's for the same word. Words
match whole and case-insensitively. How an entry is applied depends on the model:

- a voice that speaks phonemes (the built-in voices with a lexicon front end): ``phonemes`` (IPA)
  replace the word's pronunciation in the front end; a respelling is read instead of the word;
- every other model reads text: a respelling replaces the word in the text the model reads; an
  entry with phonemes alone is left out (the model has no phonemes to take), and the word is
  read as written.

Word timings still point at the word as the client wrote it.
"""

from __future__ import annotations

import json
import re
import xml.parsers.expat
from dataclasses import dataclass
from pathlib import Path

from audio_pipeline.errors import InvalidArgument
from audio_pipeline.text.ipa import ipa_units
from audio_pipeline.text.normalize import NormalizedText, Span

#: Entries in one lexicon, and characters in a word, its phonemes or its respelling.
MAX_ENTRIES = 1000
MAX_ENTRY_CHARS = 200
_WORD = re.compile(r"[\w'’-]+")


@dataclass(frozen=True)
class Pronunciation:
    word: str
    #: IPA (for voices that speak phonemes).
    phonemes: str | None = None
    #: Another spelling to read instead (for every model).
    respelling: str | None = None


@dataclass(frozen=True)
class Lexicon:
    """Entries by their word, lower-cased (hashable: a front end caches by it)."""

    entries: tuple[Pronunciation, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.entries)

    def merged(self, over: "Lexicon") -> "Lexicon":
        """This lexicon with ``over``'s entries winning for the words they share."""
        if not over:
            return self
        words = {e.word.lower() for e in over.entries}
        return Lexicon(tuple(e for e in self.entries if e.word.lower() not in words) + over.entries)

    def respellings(self) -> dict[str, str]:
        return {e.word.lower(): e.respelling for e in self.entries if e.respelling}

    def phoneme_units(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """(word, the voice's units) of every entry with phonemes and no respelling."""
        return tuple((e.word.lower(), ipa_units(e.phonemes)) for e in self.entries
                     if e.phonemes and not e.respelling)


def check_entry(word, phonemes, respelling, field: str) -> Pronunciation:
    """One entry, checked; InvalidArgument naming ``field`` otherwise."""
    if not isinstance(word, str) or not _WORD.fullmatch(word.strip() or "-"):
        raise InvalidArgument(f"word {word!r} must be one word (letters, digits, ' and -)", field=field)
    if (phonemes is None) == (respelling is None):
        raise InvalidArgument(f"{word!r} needs one of phonemes (IPA) or respelling", field=field)
    for name, value in (("word", word), ("phonemes", phonemes), ("respelling", respelling)):
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise InvalidArgument(f"{word!r}: {name} must be non-empty text", field=field)
        if value is not None and len(value) > MAX_ENTRY_CHARS:
            raise InvalidArgument(f"{word!r}: {name} is over {MAX_ENTRY_CHARS} characters", field=field)
    if phonemes is not None:
        ipa_units(phonemes, field=field)  # refused now, not when a voice first says it
    return Pronunciation(word.strip(), phonemes.strip() if phonemes else None,
                         respelling.strip() if respelling else None)


def from_entries(entries, field: str = "pronunciations") -> Lexicon:
    """A lexicon from a list of ``{"word", "phonemes" | "respelling"}`` objects (a request's)."""
    if entries is None:
        return Lexicon()
    if not isinstance(entries, list):
        raise InvalidArgument("must be a list of {word, phonemes} or {word, respelling} objects", field=field)
    if len(entries) > MAX_ENTRIES:
        raise InvalidArgument(f"{len(entries)} entries, over the limit of {MAX_ENTRIES}", field=field)
    out = []
    for index, entry in enumerate(entries):
        where = f"{field}[{index}]"
        if not isinstance(entry, dict) or set(entry) - {"word", "phonemes", "respelling"}:
            raise InvalidArgument("must be an object with word and phonemes or respelling", field=where)
        out.append(check_entry(entry.get("word"), entry.get("phonemes"), entry.get("respelling"), where))
    return Lexicon(tuple(out))


def from_pls(text: str, field: str = "pronunciations") -> Lexicon:
    """A W3C Pronunciation Lexicon (PLS 1.0): each ``<lexeme>``'s ``<grapheme>``s said as its first
    ``<phoneme>`` (alphabet ipa) or ``<alias>``."""
    lexemes: list[dict] = []
    path: list[str] = []
    alphabet = ["ipa"]

    def start(name, attrs):
        local = name.rsplit(" ", 1)[-1].rsplit(":", 1)[-1]
        path.append(local)
        if local == "lexicon":
            alphabet[0] = attrs.get("alphabet", "ipa")
        elif local == "lexeme":
            lexemes.append({"grapheme": [], "phoneme": [], "alias": []})
        elif local in ("grapheme", "phoneme", "alias") and lexemes:
            lexemes[-1][local].append("")

    def data(chars):
        if path and path[-1] in ("grapheme", "phoneme", "alias") and lexemes and lexemes[-1][path[-1]]:
            lexemes[-1][path[-1]][-1] += chars

    def refuse(*_args):
        raise InvalidArgument("a PLS lexicon may not declare a document type", field=field)

    parser = xml.parsers.expat.ParserCreate(namespace_separator=" ")
    parser.StartElementHandler, parser.EndElementHandler = start, lambda name: path.pop()
    parser.CharacterDataHandler = data
    parser.StartDoctypeDeclHandler = parser.EntityDeclHandler = refuse
    try:
        parser.Parse(text, True)
    except xml.parsers.expat.ExpatError as error:
        raise InvalidArgument(f"not a well-formed PLS lexicon: {error}", field=field) from None
    if alphabet[0].lower() != "ipa":
        raise InvalidArgument(f"alphabet {alphabet[0]!r} is not supported (ipa)", field=field)
    entries = []
    for lexeme in lexemes:
        phonemes = lexeme["phoneme"][0] if lexeme["phoneme"] else None
        alias = lexeme["alias"][0] if lexeme["alias"] and not phonemes else None
        for grapheme in lexeme["grapheme"]:
            entries.append({"word": grapheme.strip(), **({"phonemes": phonemes} if phonemes else {}),
                            **({"respelling": alias} if alias else {})})
    return from_entries(entries, field)


def load_voice_lexicons(path: str | Path) -> dict[str, Lexicon]:
    """The server's pronunciations file: a PLS lexicon (every voice), or JSON: a list of entries
    (every voice) or an object of voice name ("*": every voice) -> list of entries."""
    text = Path(path).read_text(encoding="utf-8")
    field = f"pronunciations ({path})"
    if text.lstrip().startswith("<"):
        return {"*": from_pls(text, field)}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise InvalidArgument(f"neither JSON nor a PLS lexicon: {error}", field=field) from None
    if isinstance(value, list):
        return {"*": from_entries(value, field)}
    if not isinstance(value, dict):
        raise InvalidArgument("must be a list of entries or an object of voice -> entries", field=field)
    return {voice: from_entries(entries, f"{field}[{voice}]") for voice, entries in value.items()}


def respell(text: NormalizedText, respellings: dict[str, str],
            marks: tuple[tuple[int, int, str], ...] = ()) -> tuple[NormalizedText, tuple[tuple[int, int, str], ...]]:
    """``text`` with every word that has a respelling read as it (words inside ``marks``, SSML
    <phoneme> spans, keep theirs), and the marks moved with the text. The new words map back to
    whatever the replaced word came from, so timings point at the word as written."""
    if not respellings:
        return text, marks
    spoken, replaced = [], []
    position = out = 0
    for match in _WORD.finditer(text.spoken):
        replacement = respellings.get(match.group().lower())
        start, end = match.span()
        if replacement is None or any(a <= start < b for a, b, _ in marks):
            continue
        spoken.append(text.spoken[position:start])
        out += start - position
        source_start, source_end = text.source_of(start, end)
        replaced.append((start, end, out, out + len(replacement), source_start, source_end))
        spoken.append(replacement)
        out += len(replacement)
        position = end
    if not replaced:
        return text, marks
    spoken.append(text.spoken[position:])

    def moved(offset: int) -> int:
        return offset + sum(new_end - new_start - (end - start)
                            for start, end, new_start, new_end, _, _ in replaced if end <= offset)

    # Spans of the normalized text outside the replaced words keep their place, moved.
    spans = [Span(moved(span.start), moved(span.end), span.source_start, span.source_end) for span in text.spans
             if not any(start < span.end and span.start < end for start, end, *_ in replaced)]
    spans += [Span(new_start, new_end, source_start, source_end)
              for _, _, new_start, new_end, source_start, source_end in replaced]
    spans.sort(key=lambda span: span.start)
    return (NormalizedText(text.original, "".join(spoken), spans),
            tuple((moved(a), moved(b), ipa) for a, b, ipa in marks))
