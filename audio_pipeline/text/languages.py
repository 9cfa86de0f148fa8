"""Languages a request may name, in any usual spelling, and the ones a model speaks.

A request's ``language`` may be a language's English name (any case: ``English``, ``english``),
its ISO 639-1 code (``en``), an ISO 639-3 or 639-2 code (``eng``; ``ger`` as well as ``deu``), a
BCP 47 tag or a locale name, of which the primary language subtag counts (``en-US``, ``en_GB``,
``zh-Hans-CN``), or ``auto`` (any case): the model's own choice. A model declares the languages it
speaks (its family's record, a checkpoint that lists its own, or its manifest's ``languages``:
:class:`SpokenLanguages`); a request that names another is refused naming the field and listing
them. Spellings outside the table below still match a model's own entries as written (Qwen3-TTS's
``beijing_dialect``), case-insensitively.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from audio_pipeline.errors import InvalidArgument, echo

#: The model's own choice (for a model that is told the language: the language it names in its
#: prompt otherwise; the others speak their language whatever is asked).
AUTO = "auto"


@dataclass(frozen=True)
class Language:
    """A language: its English name, its shortest code (ISO 639-1 where it has one) and its other
    codes (ISO 639-3, 639-2/B) and names."""

    name: str
    code: str
    codes: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()


#: The languages a request may name by name or code (the ones speech models speak most).
LANGUAGES = (
    Language("English", "en", ("eng",)),
    Language("Chinese", "zh", ("zho", "chi", "cmn"), ("mandarin",)),
    Language("Cantonese", "yue"),
    Language("German", "de", ("deu", "ger")),
    Language("French", "fr", ("fra", "fre")),
    Language("Spanish", "es", ("spa",), ("castilian",)),
    Language("Italian", "it", ("ita",)),
    Language("Portuguese", "pt", ("por",)),
    Language("Japanese", "ja", ("jpn",)),
    Language("Korean", "ko", ("kor",)),
    Language("Russian", "ru", ("rus",)),
    Language("Dutch", "nl", ("nld", "dut"), ("flemish",)),
    Language("Arabic", "ar", ("ara",)),
    Language("Hindi", "hi", ("hin",)),
    Language("Bengali", "bn", ("ben",), ("bangla",)),
    Language("Urdu", "ur", ("urd",)),
    Language("Persian", "fa", ("fas", "per"), ("farsi",)),
    Language("Turkish", "tr", ("tur",)),
    Language("Polish", "pl", ("pol",)),
    Language("Czech", "cs", ("ces", "cze")),
    Language("Slovak", "sk", ("slk", "slo")),
    Language("Hungarian", "hu", ("hun",)),
    Language("Romanian", "ro", ("ron", "rum")),
    Language("Bulgarian", "bg", ("bul",)),
    Language("Croatian", "hr", ("hrv",)),
    Language("Serbian", "sr", ("srp",)),
    Language("Ukrainian", "uk", ("ukr",)),
    Language("Greek", "el", ("ell", "gre")),
    Language("Hebrew", "he", ("heb", "iw")),
    Language("Swedish", "sv", ("swe",)),
    Language("Norwegian", "no", ("nor", "nb", "nob", "nn", "nno"), ("norwegian bokmal", "norwegian nynorsk")),
    Language("Danish", "da", ("dan",)),
    Language("Finnish", "fi", ("fin",)),
    Language("Catalan", "ca", ("cat",)),
    Language("Vietnamese", "vi", ("vie",)),
    Language("Thai", "th", ("tha",)),
    Language("Indonesian", "id", ("ind",)),
    Language("Malay", "ms", ("msa", "may")),
    Language("Tagalog", "tl", ("tgl", "fil"), ("filipino",)),
    Language("Swahili", "sw", ("swa",)),
    Language("Tamil", "ta", ("tam",)),
)
_BY_CODE = {code: language for language in LANGUAGES for code in (language.code, *language.codes)}
_BY_NAME = {name: language for language in LANGUAGES for name in (language.name.lower(), *language.aliases)}
#: A BCP 47 tag's or a locale name's primary language subtag, and the rest.
_TAG = re.compile(r"([a-z]{2,3})(?:[-_][a-z0-9]{1,8})*")


def language_of(spelling: str) -> Language | None:
    """The language ``spelling`` names (a name, an ISO 639 code, a BCP 47 tag), or None."""
    key = spelling.strip().lower()
    if key in _BY_NAME:
        return _BY_NAME[key]
    tag = _TAG.fullmatch(key)
    return _BY_CODE.get(tag.group(1)) if tag else None


def describe(entry: str) -> str:
    """A declared language as an error or a listing shows it: ``English (en-US)``, ``German (de)``;
    an entry outside the table as written."""
    language = language_of(entry)
    if language is None:
        return entry
    shown = entry.strip() if _TAG.fullmatch(entry.strip().lower()) else language.code
    return f"{language.name} ({shown})"


@dataclass(frozen=True)
class SpokenLanguages:
    """The languages one model speaks, as declared (``entries``: names, codes or tags, or a
    checkpoint's own names such as Qwen3-TTS's ``english``, ``beijing_dialect``)."""

    entries: tuple[str, ...]

    def resolve(self, requested: str) -> str:
        """The declared entry ``requested`` names in any usual spelling, or AUTO (``auto`` in any
        case); InvalidArgument naming ``language`` and listing the supported ones otherwise."""
        key = requested.strip().lower()
        if key == AUTO:
            return AUTO
        for entry in self.entries:  # as the model writes it (a dialect's name)
            if entry.strip().lower() == key:
                return entry
        language = language_of(requested)
        if language is not None:
            for entry in self.entries:
                if language_of(entry) == language:
                    return entry
        named = f" ({language.name})" if language is not None and language.name.lower() != key else ""
        raise InvalidArgument(f"{echo(requested)}{named} is not a language this model speaks; supported: "
                              f"{self.listing()}", field="language")

    def listing(self) -> str:
        """The supported values, for an error: ``English (en-US), or auto``."""
        if not self.entries:
            return f"only {AUTO}"
        return ", ".join(describe(entry) for entry in self.entries) + f", or {AUTO}"

    def check(self, where: str) -> None:
        """ValueError naming ``where`` (a manifest's field) unless there are entries and each is a
        language a request can name (a name, an ISO 639 code or a BCP 47 tag of the table above)."""
        if not self.entries:
            raise ValueError(f"{where}: empty; name the languages the model speaks (English, en, en-US, ...)")
        for entry in self.entries:
            if not isinstance(entry, str) or language_of(entry) is None:
                raise ValueError(f"{where}: {entry!r} is not a language (a name such as English, an ISO 639 code "
                                 "such as en or eng, or a BCP 47 tag such as en-US)")
