"""Text normalization: written forms read out as words, before any model family's layout sees them.

Numbers (cardinal, ordinal, decimal, negative), money, percentages, dates, times, years, phone
numbers, units, abbreviations and titles, URLs and e-mail addresses, and symbols become the words a
US English reader would say ("$5.50" -> "five dollars and fifty cents"). Number words come from
``num2words``; the rules that decide which reading a written form gets are this module's.

:func:`normalize` also keeps, for every replaced piece, where it came from in the original text
(:attr:`NormalizedText.spans`), so word timings can point a caption at "$5" while the audio says
"five dollars".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from num2words import num2words

MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December"]
MONTH_ABBREVIATIONS = {m[:3].lower(): m for m in MONTHS} | {"sept": "September"}
CURRENCIES = {"$": ("dollar", "dollars", "cent", "cents"), "€": ("euro", "euros", "cent", "cents"),
              "£": ("pound", "pounds", "penny", "pence"), "¥": ("yen", "yen", "", "")}
SCALES = {"thousand", "million", "billion", "trillion"}
#: Unit symbols after a number: (singular, plural).
UNITS = {
    "km": ("kilometer", "kilometers"), "m": ("meter", "meters"), "cm": ("centimeter", "centimeters"),
    "mm": ("millimeter", "millimeters"), "kg": ("kilogram", "kilograms"), "g": ("gram", "grams"),
    "mg": ("milligram", "milligrams"), "lb": ("pound", "pounds"), "lbs": ("pound", "pounds"),
    "oz": ("ounce", "ounces"), "ft": ("foot", "feet"), "mi": ("mile", "miles"), "mph": ("mile per hour", "miles per hour"),
    "km/h": ("kilometer per hour", "kilometers per hour"), "kph": ("kilometer per hour", "kilometers per hour"),
    "l": ("liter", "liters"), "ml": ("milliliter", "milliliters"), "°c": ("degree Celsius", "degrees Celsius"),
    "°f": ("degree Fahrenheit", "degrees Fahrenheit"), "°": ("degree", "degrees"), "kb": ("kilobyte", "kilobytes"),
    "mb": ("megabyte", "megabytes"), "gb": ("gigabyte", "gigabytes"), "tb": ("terabyte", "terabytes"),
    "hz": ("hertz", "hertz"), "khz": ("kilohertz", "kilohertz"), "mhz": ("megahertz", "megahertz"),
    "ghz": ("gigahertz", "gigahertz"), "kw": ("kilowatt", "kilowatts"), "kwh": ("kilowatt hour", "kilowatt hours"),
    "w": ("watt", "watts"), "v": ("volt", "volts"), "ms": ("millisecond", "milliseconds"),
    "s": ("second", "seconds"), "sec": ("second", "seconds"), "min": ("minute", "minutes"),
    "h": ("hour", "hours"), "hr": ("hour", "hours"), "hrs": ("hour", "hours"),
}
# The usual capitalized spellings (matching stays case-sensitive: "5G" is not five grams).
UNITS |= {"°C": UNITS["°c"], "°F": UNITS["°f"], "KB": UNITS["kb"], "MB": UNITS["mb"], "GB": UNITS["gb"],
          "TB": UNITS["tb"], "Hz": UNITS["hz"], "kHz": UNITS["khz"], "MHz": UNITS["mhz"], "GHz": UNITS["ghz"],
          "kW": UNITS["kw"], "kWh": UNITS["kwh"], "W": UNITS["w"], "V": UNITS["v"], "L": UNITS["l"],
          "mL": UNITS["ml"]}
#: Abbreviations read as words (matched case-sensitively, with their period).
ABBREVIATIONS = {
    "Mr.": "mister", "Mrs.": "missus", "Ms.": "miz", "Dr.": "doctor", "Prof.": "professor", "Jr.": "junior",
    "Sr.": "senior", "Mt.": "mount", "Ave.": "avenue", "Rd.": "road", "Blvd.": "boulevard", "Inc.": "incorporated",
    "Ltd.": "limited", "Co.": "company", "Corp.": "corporation", "Dept.": "department", "Gov.": "governor",
    "Sen.": "senator", "Rep.": "representative", "Gen.": "general", "Capt.": "captain", "Lt.": "lieutenant",
    "vs.": "versus", "etc.": "et cetera", "e.g.": "for example", "i.e.": "that is", "approx.": "approximately",
    "a.m.": "a m", "p.m.": "p m", "Fig.": "figure", "fig.": "figure", "Vol.": "volume", "vol.": "volume",
}
SYMBOLS = {"&": "and", "%": "percent", "+": "plus", "=": "equals", "@": "at", "×": "times", "#": "number",
           "°": "degrees", "~": "about", "½": "one half", "¼": "one quarter", "¾": "three quarters"}


@dataclass(frozen=True)
class Span:
    """``spoken[start:end]`` reads ``original[source_start:source_end]``."""

    start: int
    end: int
    source_start: int
    source_end: int


@dataclass
class NormalizedText:
    original: str
    spoken: str
    #: One entry per replaced piece (text left as it was maps to itself).
    spans: list[Span] = field(default_factory=list)

    def source_of(self, start: int, end: int) -> tuple[int, int]:
        """The original span behind ``spoken[start:end]`` (a replaced piece maps to all of its source)."""
        begin, finish = self._to_source(start, True), self._to_source(end, False)
        return begin, max(begin, finish)

    def _to_source(self, position: int, at_start: bool) -> int:
        shift = 0
        for span in self.spans:
            if position < span.start or (not at_start and position == span.start):
                break
            if position < span.end or (not at_start and position == span.end):
                return span.source_start if at_start else span.source_end
            shift = span.source_end - span.end
        return position + shift


def cardinal(value: int) -> str:
    """US reading: no "and", no commas ("one thousand two hundred thirty-four")."""
    words = num2words(value)
    return words.replace(",", "").replace(" and ", " ")


def ordinal(value: int) -> str:
    return num2words(value, to="ordinal").replace(",", "").replace(" and ", " ")


def digits(text: str) -> str:
    names = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    return " ".join(names[int(d)] for d in text if d.isdigit())


def decimal(text: str) -> str:
    """"3.14" -> "three point one four"; "0.5" -> "zero point five"."""
    whole, _, fraction = text.partition(".")
    spoken = cardinal(int(whole.replace(",", "") or "0"))
    return f"{spoken} point {digits(fraction)}" if fraction else spoken


def number(text: str) -> str:
    """A written number (commas, decimals, a sign) as words."""
    negative = text.startswith(("-", "−"))
    text = text.lstrip("-−+")
    spoken = decimal(text) if "." in text else cardinal(int(text.replace(",", "")))
    return f"minus {spoken}" if negative else spoken


def year(value: int) -> str:
    """"1999" -> "nineteen ninety-nine", "2005" -> "two thousand five", "1905" -> "nineteen oh five"."""
    if 2000 <= value < 2010 or value % 1000 == 0:
        return cardinal(value)
    high, low = divmod(value, 100)
    if low == 0:
        return f"{cardinal(high)} hundred"
    return f"{cardinal(high)} {'oh ' + cardinal(low) if low < 10 else cardinal(low)}"


def money(symbol: str, amount: str, scale: str | None) -> str:
    one, many, cent, cents = CURRENCIES[symbol]
    amount = amount.replace(",", "")
    if scale:  # "$1.5 million" -> "one point five million dollars"
        return f"{number(amount)} {scale.lower()} {many}"
    whole, _, fraction = amount.partition(".")
    units = int(whole or "0")
    spoken = f"{cardinal(units)} {one if units == 1 else many}"
    if fraction and cent:
        hundredths = int((fraction + "0")[:2])
        if hundredths:
            part = f"{cardinal(hundredths)} {cent if hundredths == 1 else cents}"
            spoken = part if units == 0 else f"{spoken} and {part}"
    return spoken


def clock(hours: int, minutes: int, suffix: str | None) -> str:
    """"9:15" -> "nine fifteen", "9:00" -> "nine o'clock", "9:05 pm" -> "nine oh five p m"."""
    spoken = cardinal(hours)
    if minutes == 0:
        spoken += "" if suffix else " o'clock"
    elif minutes < 10:
        spoken += f" oh {cardinal(minutes)}"
    else:
        spoken += f" {cardinal(minutes)}"
    if suffix:
        spoken += " " + " ".join(suffix.lower().replace(".", ""))
    return spoken


def date(month: int, day: int, year_value: int | None) -> str:
    spoken = f"{MONTHS[month - 1]} {ordinal(day)}"
    return f"{spoken}, {year(year_value)}" if year_value is not None else spoken


def web_address(text: str) -> str:
    """URLs and e-mail addresses as read aloud: "www.example.com/docs" -> "w w w dot example dot com slash docs"."""
    text = re.sub(r"^https?://", "", text)
    out = []
    for piece in re.split(r"([./@:_-])", text):
        if piece in {".", "/", "@", ":", "_", "-"}:
            out.append({".": "dot", "/": "slash", "@": "at", ":": "colon", "_": "underscore", "-": "dash"}[piece])
        elif piece.lower() == "www":
            out.append("w w w")
        elif piece.isdigit():
            out.append(digits(piece))
        elif piece:
            out.append(piece)
    return " ".join(out)


def phone(text: str) -> str:
    """Digits read one by one, in the written groups: "(555) 123-4567" -> "five five five, one two three, ..."."""
    groups = re.findall(r"\d+", text)
    spoken = ", ".join(digits(g) for g in groups)
    return ("plus " + spoken) if text.lstrip().startswith("+") else spoken


def unit(amount: str, symbol: str) -> str:
    singular, plural = UNITS[symbol]
    value = amount.replace(",", "").lstrip("-−")
    return f"{number(amount)} {singular if value in {'1', '1.0'} else plural}"


#: A month as written before its day: its name, its first three letters, "Sept".
_MONTH_FORMS = (*MONTHS, *(m[:3] for m in MONTHS), "Sept")
_MONTH_NAMES = "|".join(_MONTH_FORMS)
#: The words before a four-digit number that make it a year ("in 1847": "in eighteen forty-seven").
YEAR_CUES = ("in", "In", "since", "Since", "by", "from", "From", "until", "of", "year", "around", "before", "after")
_UNIT_NAMES = "|".join(sorted((re.escape(u) for u in UNITS), key=len, reverse=True))
_ABBREVIATIONS = "|".join(sorted((re.escape(a) for a in ABBREVIATIONS), key=len, reverse=True))
_NUMBER = r"[-−]?\d{1,3}(?:,\d{3})+(?:\.\d+)?|[-−]?\d+(?:\.\d+)?"
_RULES = [
    ("url", r"\bhttps?://[^\s<>\"]+[^\s<>\".,;:!?)]|\bwww\.[^\s<>\"]+[^\s<>\".,;:!?)]"),
    ("email", r"\b[\w.+-]+@[\w-]+(?:\.[\w-]+)+\b"),
    # Ten digits in the usual groups, or a seven-digit local number ("555-1234").
    ("phone", r"(?<![\w.])(?:(?:\+\d{1,3}[\s.-])?(?:\(\d{3}\)\s?|\d{3}[\s.-])\d{3}[\s.-]\d{4}|\d{3}-\d{4})\b(?![-.]\d)"),
    ("money", r"(?P<cur>[$€£¥])\s?(?P<amount>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?)"
              r"(?:\s(?P<scale>thousand|million|billion|trillion)\b)?"),
    ("percent", rf"(?P<pct>{_NUMBER})\s?%"),
    ("time", r"\b(?P<h>[01]?\d|2[0-3]):(?P<m>[0-5]\d)(?:\s?(?P<ampm>[aApP]\.?[mM]\.?))?(?![\d:])"),
    ("iso_date", r"\b(?P<iy>\d{4})-(?P<im>0[1-9]|1[0-2])-(?P<id>0[1-9]|[12]\d|3[01])\b"),
    ("us_date", r"\b(?P<um>0?[1-9]|1[0-2])/(?P<ud>0?[1-9]|[12]\d|3[01])/(?P<uy>\d{4}|\d{2})\b"),
    ("month_day", rf"\b(?P<mn>{_MONTH_NAMES})\.?\s(?P<md>[0-3]?\d)(?:st|nd|rd|th)?\b(?:,?\s(?P<my>\d{{4}})\b)?"),
    ("ordinal", r"\b(?P<ord>\d+)(?:st|nd|rd|th)\b"),
    ("year", rf"(?P<yp>\b(?:{'|'.join(YEAR_CUES)}) )"
             r"(?P<yr>1[1-9]\d\d|2[01]\d\d)\b(?!,\d)"),
    ("decade", r"\b(?P<dec>1[1-9]\d0|20\d0)s\b"),
    ("unit", rf"(?P<ua>{_NUMBER})\s?(?P<us>{_UNIT_NAMES})(?![\w/])"),
    ("abbreviation", rf"(?<![\w.])(?P<ab>{_ABBREVIATIONS})(?!\w)"),
    ("number_sign", r"#(?P<ns>\d+)\b"),
    ("number", rf"(?<![\w.])(?:{_NUMBER})(?![\w])"),
    ("symbol", r"[&%+=@×#°~½¼¾]"),
]
_PATTERN = re.compile("|".join(f"(?P<{name}>{pattern})" for name, pattern in _RULES))


_MONTH_WORDS = frozenset(_MONTH_FORMS)


def reads_with_next(word: str) -> bool:
    """Whether the written ``word`` may be read differently with the word after it, or make that
    word read differently: a number (its unit, scale or "am" follows: "120 m", "$5 million", "7:30
    am"), a year's cue ("in 1847"), a month (its day), a currency sign ("$ 5"). Live text holds
    such a word until the next one has come, so that the two are normalized together."""
    bare = word.strip().rstrip(".")
    return (any(c.isdigit() for c in word) or bare in YEAR_CUES or bare in _MONTH_WORDS
            or bare in CURRENCIES)


def _spoken(match: re.Match) -> str:
    kind = match.lastgroup
    text = match.group(0)
    g = match.group
    if kind in ("url", "email"):
        return web_address(text)
    if kind == "phone":
        return phone(text)
    if kind == "money":
        return money(g("cur"), g("amount"), g("scale"))
    if kind == "percent":
        return f"{number(g('pct'))} percent"
    if kind == "time":
        return clock(int(g("h")), int(g("m")), g("ampm"))
    if kind == "iso_date":
        return date(int(g("im")), int(g("id")), int(g("iy")))
    if kind == "us_date":
        y = int(g("uy"))
        return date(int(g("um")), int(g("ud")), y + 2000 if y < 100 else y)
    if kind == "month_day":
        month = MONTH_ABBREVIATIONS[g("mn")[:4].lower() if g("mn").lower().startswith("sept") else g("mn")[:3].lower()]
        return date(MONTHS.index(month) + 1, int(g("md")), int(g("my")) if g("my") else None)
    if kind == "ordinal":
        return ordinal(int(g("ord")))
    if kind == "year":  # the word that makes it a year stays as it was
        return g("yp") + year(int(g("yr")))
    if kind == "decade":  # "1990s" -> "nineteen nineties"
        spoken = year(int(g("dec")))
        return spoken[:-1] + "ies" if spoken.endswith("y") else spoken + "s"
    if kind == "unit":
        return unit(g("ua"), g("us"))
    if kind == "abbreviation":
        return ABBREVIATIONS[g("ab")]
    if kind == "number_sign":
        return f"number {cardinal(int(g('ns')))}"
    if kind == "number":
        return number(text)
    return SYMBOLS[text]


def normalize(text: str) -> NormalizedText:
    """``text`` with every written form it recognizes replaced by its spoken words."""
    pieces: list[str] = []
    spans: list[Span] = []
    position = out = 0
    for match in _PATTERN.finditer(text):
        start, end = match.span()
        pieces.append(text[position:start])
        out += start - position
        spoken = _spoken(match)
        # Keep words apart from what touches them ("5%off" -> "five percent off", "2+2" -> "two plus two").
        before = next((p for p in reversed(pieces) if p), "")
        if before[-1:].isalnum():
            spoken = " " + spoken
        if end < len(text) and text[end].isalnum():
            spoken += " "
        spans.append(Span(out, out + len(spoken), start, end))
        pieces.append(spoken)
        out += len(spoken)
        position = end
    pieces.append(text[position:])
    return NormalizedText(text, "".join(pieces), spans)
