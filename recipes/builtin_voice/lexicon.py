"""The second-generation voice's pronouncing dictionary, converted from Festival's CMU lexicon (the
teacher's own: Debian ``festlex-cmu``, CMUDICT 0.4 as CSTR distributes it; free to use, modify and
distribute with its notices, which go with the voice) into the run-time format of
audio_pipeline/text/lexicon.py, and how well the run-time front end agrees with the teacher.

    python -m recipes.builtin_voice.lexicon build --out /tmp/bv3/lexicon.txt.gz
    python -m recipes.builtin_voice.lexicon agree --lexicon /tmp/bv3/lexicon.txt.gz --teacher /tmp/bv3/teacher \
        [--prosody /tmp/bv3/prosody.json]

This is a converted (modified) form of the lexicon: one pronunciation per word (where Festival
keeps several by part of speech, the one it uses for a determiner, else an untagged one, else the
first), and the lexicon's additions from cmulex.scm in place of the entries they name.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

FESTIVAL_CMU = Path("/usr/share/festival/dicts/cmu")
#: Which of a word's entries (by Festival's part-of-speech field) the run-time lexicon keeps.
POS_PREFERENCE = ["dt", "nil", "n", "v", "j"]

_ENTRY = re.compile(r'\("((?:[^"\\]|\\.)*)"\s+(\S+)\s+\((.*)\)\)\s*\)?\s*$')
_SYLLABLE = re.compile(r"\(\(([^()]*)\)\s+(\d)\)")


def parse_entry(line: str) -> tuple[str, str, tuple[tuple[tuple[str, ...], int], ...]] | None:
    """``("word" pos (((ph ph) 1) ((ph) 0)))`` -> (word, pos, syllables); None for other lines."""
    match = _ENTRY.search(line.strip())
    if match is None:
        return None
    word, pos, body = match.groups()
    syllables = tuple((tuple(phones.split()), int(stress)) for phones, stress in _SYLLABLE.findall(body))
    return (word, pos, syllables) if syllables else None


def read_festival_lexicon(directory: Path = FESTIVAL_CMU) -> dict[str, tuple]:
    """word (lower case) -> syllables, one pronunciation per word (see POS_PREFERENCE)."""
    candidates: dict[str, dict[str, tuple]] = {}

    def add(word: str, pos: str, syllables: tuple, override: bool) -> None:
        if override:  # an addition is what Festival says for the word
            candidates[word.lower()] = {pos: syllables}
            return
        forms = candidates.setdefault(word.lower(), {})
        forms.setdefault(pos, syllables)

    with open(directory / "cmudict-0.4.out", encoding="latin-1") as lines:
        for line in lines:
            entry = parse_entry(line)
            if entry:
                add(*entry, override=False)
    # The lexicon's additions (lex.add.entry in cmulex.scm) replace the entries they name.
    addenda = (directory / "cmulex.scm").read_text(encoding="latin-1")
    for quoted in re.findall(r"lex\.add\.entry\s+'(\(.*?\)\)\)\))", addenda, flags=re.S):
        entry = parse_entry(" ".join(quoted.split()))
        if entry and (entry[0].islower() or entry[0].lower() not in candidates):
            add(*entry, override=True)
    out = {}
    for word, forms in candidates.items():
        pos = next((p for p in POS_PREFERENCE if p in forms), next(iter(forms)))
        out[word] = forms[pos]
    return out


def teacher_units(record: dict) -> list[str]:
    """The teacher's units of one utterance (index.jsonl record): phones, vowels with stress."""
    from audio_pipeline.text.lexicon import unit

    return [unit(name, int(stress)) if name != "pau" else "pau" for name, _, stress, _ in record["segments"]]


def edit_distance(a: list[str], b: list[str]) -> int:
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        previous, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (x != y))
    return row[-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="write the run-time lexicon")
    build.add_argument("--out", required=True)
    agree = commands.add_parser("agree", help="the front end's units against the teacher's")
    agree.add_argument("--lexicon", required=True)
    agree.add_argument("--teacher", required=True, help="a teacher.py output folder (index.jsonl)")
    agree.add_argument("--prosody", help="prosody.json: place the learned phrase breaks too (default: pauses at "
                                         "punctuation only)")
    agree.add_argument("--count", type=int, default=2000)
    agree.add_argument("--show", type=int, default=10, help="disagreements to print")
    args = parser.parse_args(argv)
    if args.command == "build":
        from audio_pipeline.text.lexicon import Lexicon

        entries = read_festival_lexicon()
        Lexicon.write(args.out, entries)
        print(f"{len(entries)} words -> {args.out}")
        return 0

    from collections import Counter

    from audio_pipeline.text.lexicon import Lexicon, Phonemizer

    phonemizer = Phonemizer(Lexicon.load(args.lexicon))
    if args.prosody:
        from audio_pipeline.text.lexicon import LexiconFrontEnd
        from audio_pipeline.text.prosody import ProsodyModel

        front_end = LexiconFrontEnd(phonemizer.lexicon, ProsodyModel.load(args.prosody))

        def our_units(text):
            return [u.name for u in front_end.units(text)[0]]
    else:
        def our_units(text):
            return [u for u, _ in phonemizer.units(text)]
    same = errors = total = 0
    phone_errors = phone_total = 0  # pauses left out
    shown = 0
    confusions: Counter = Counter()
    records = [json.loads(line) for line in open(Path(args.teacher) / "index.jsonl")][:args.count]
    for record in records:
        ours = our_units(record["text"])
        theirs = teacher_units(record)
        distance = edit_distance(ours, theirs)
        same += distance == 0
        errors += distance
        total += len(theirs)
        ours_phones, theirs_phones = [u for u in ours if u != "pau"], [u for u in theirs if u != "pau"]
        phone_errors += edit_distance(ours_phones, theirs_phones)
        phone_total += len(theirs_phones)
        if distance:
            confusions.update(set(ours) ^ set(theirs))
            if shown < args.show:
                print(f"{record['text']}\n  ours:   {' '.join(ours)}\n  teacher: {' '.join(theirs)}")
                shown += 1
    print(f"{len(records)} utterances: {same} ({100 * same / max(len(records), 1):.1f} %) identical, "
          f"unit error rate {100 * errors / max(total, 1):.2f} % ({100 * phone_errors / max(phone_total, 1):.2f} % "
          f"without the pauses)")
    print("units most often in disagreements:", confusions.most_common(15))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
