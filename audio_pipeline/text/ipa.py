"""IPA (as SSML's ``<phoneme alphabet="ipa">`` and pronunciation lexicons write it) -> the CMU
phones of the voices that speak phonemes (audio_pipeline/text/lexicon.py's units: vowels carry
their syllable's stress, 0 or 1).

US English IPA as dictionaries write it: stress marks (ˈ primary, ˌ secondary: both stressed, as
the lexicon has only 0 and 1) go before their syllable; length marks, syllable dots, ties and
diacritics are ignored; diphthongs and affricates are read longest first ("tʃ" before "t").
"""

from __future__ import annotations

import functools
import unicodedata

from audio_pipeline.errors import InvalidArgument
from audio_pipeline.text.lexicon import VOWELS, unit

#: IPA -> CMU phone (longest symbols are matched first).
SYMBOLS = {
    # vowels and diphthongs
    "i": "iy", "ɪ": "ih", "e": "ey", "eɪ": "ey", "ɛ": "eh", "æ": "ae", "a": "aa", "ɑ": "aa", "ɒ": "aa",
    "ɔ": "ao", "o": "ow", "oʊ": "ow", "əʊ": "ow", "ʊ": "uh", "u": "uw", "ʌ": "ah", "ə": "ax", "ɐ": "ax",
    "ɨ": "ih", "ɚ": "er", "ɝ": "er", "ɜ": "er", "ɜɹ": "er", "ɜr": "er", "əɹ": "er", "ər": "er", "aɪ": "ay",
    "aʊ": "aw", "ɔɪ": "oy", "ɪə": "iy ax", "eə": "eh r", "ʊə": "uh r", "ᵻ": "ih",
    # consonants
    "p": "p", "b": "b", "t": "t", "d": "d", "k": "k", "g": "g", "ɡ": "g", "f": "f", "v": "v", "θ": "th",
    "ð": "dh", "s": "s", "z": "z", "ʃ": "sh", "ʒ": "zh", "h": "hh", "m": "m", "n": "n", "ŋ": "ng", "l": "l",
    "ɫ": "l", "ɹ": "r", "r": "r", "ɾ": "t", "w": "w", "ʍ": "w", "j": "y", "tʃ": "ch", "ʧ": "ch", "dʒ": "jh",
    "ʤ": "jh", "x": "k", "ʔ": "", "n̩": "n", "l̩": "l", "m̩": "m",
}
STRESS = {"ˈ": 1, "ˌ": 1, "'": 1}
#: Marks read past: length, syllable breaks, ties, and the slashes or brackets around a transcription.
IGNORED = set("ːˑ.‿͜͡/[] ")
_LONGEST = max(len(s) for s in SYMBOLS)


@functools.lru_cache(maxsize=8192)  # a voice's lexicon is read again for every request
def ipa_units(ipa: str, field: str = "phonemes") -> tuple[str, ...]:
    """The voice's units for an IPA transcription; InvalidArgument naming ``field`` and the first
    symbol it cannot read."""
    # Length marks and ties go first, so that "ɜːr" reads as the one vowel "ɜr".
    text = "".join(c for c in unicodedata.normalize("NFD", ipa.strip()) if c not in "ːˑ‿͜͡")
    phones: list[tuple[str, int]] = []
    stressed = 0
    i = 0
    while i < len(text):
        char = text[i]
        if char in STRESS:
            stressed = STRESS[char]
            i += 1
            continue
        if char in IGNORED or unicodedata.combining(char):
            i += 1
            continue
        for size in range(_LONGEST, 0, -1):
            symbol = unicodedata.normalize("NFC", text[i:i + size])
            if symbol in SYMBOLS:
                break
        else:
            raise InvalidArgument(f"{ipa!r}: IPA symbol {char!r} (U+{ord(char):04X}) is not one this voice "
                                  "speaks (US English phonemes)", field=field)
        for phone in SYMBOLS[symbol].split():
            if phone in VOWELS:
                phones.append((phone, stressed))
                stressed = 0
            else:
                phones.append((phone, 0))
        i += size
    if not phones:
        raise InvalidArgument(f"{ipa!r} has no phonemes", field=field)
    return tuple(unit(p, s) for p, s in phones)
