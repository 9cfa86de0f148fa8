"""Where the second-generation built-in voice pauses between words and how long each unit lasts:
two small models learned from the teacher's timings (recipes/builtin_voice/prosody.py) and shipped
with the voice as ``prosody.json``.

- **Phrase breaks**: the teacher pauses at punctuation (but after a few one-word openings such
  as "Wow," it runs on: ``comma_unpaused_words``), and between words where a phrase ends
  (before "and", "in", "when"... once a few words have gone by). A logistic model over the next
  word, the words since the last pause and the words left before the next punctuation decides
  where a pause goes.
- **Durations**: a unit's frames (50 per second) from a one-hidden-layer network over one-hot
  features: the unit, its neighbours, its place in its word, the word's length and place in its
  phrase, and for a pause what caused it.

Both run in numpy: a sentence costs well under a millisecond.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

PAUSE = "pau"
#: What a pause follows: the start or end of the text, a punctuation mark, or a predicted break.
PAUSE_KINDS = ["start", "end", ",", ";", ":", ".", "!", "?", "break"]
CAP = 8  # counts (words since a pause, units in a word...) are capped here


@dataclass
class Unit:
    """One unit of a text: a phone (vowels with stress) or a pause, and where it stands."""

    name: str
    #: The word it belongs to (index in the text's words), or -1 for a pause.
    word: int
    #: For a pause: what caused it (PAUSE_KINDS).
    kind: str = ""


def break_features(next_word: str, since: int, remaining: int, vocabulary: dict[str, int]) -> list[int]:
    """Active feature indices of the boundary before ``next_word``."""
    words = len(vocabulary) + 1
    return [vocabulary.get(next_word.lower(), len(vocabulary)), words + min(since, CAP) - 1,
            words + CAP + min(remaining, CAP) - 1]


def duration_features(units: Sequence[Unit], index: int, inventory: dict[str, int]) -> list[int]:
    """Active feature indices of ``units[index]`` (the layout of the duration network's input)."""
    size = len(inventory) + 1  # + unknown
    unit = units[index]

    def name(i: int) -> int:
        if 0 <= i < len(units):
            return inventory.get(units[i].name, len(inventory))
        return len(inventory)

    features = [name(index), size + name(index - 1), 2 * size + name(index + 1)]
    base = 3 * size
    if unit.word < 0:
        features.append(base + PAUSE_KINDS.index(unit.kind or "break"))
        return features
    base += len(PAUSE_KINDS)
    members = [i for i in range(max(0, index - 2 * CAP), min(len(units), index + 2 * CAP)) if units[i].word == unit.word]
    first, last = members[0], members[-1]
    place = 0 if first == last else 1 if index == first else 3 if index == last else 2
    features.append(base + place)
    base += 4
    features.append(base + min(len(members), CAP) - 1)
    base += CAP
    # The word's place in its phrase (words since the pause before, words until the pause after).
    before = sum(1 for w in {u.word for u in _phrase_left(units, first)} if w >= 0)
    after = sum(1 for w in {u.word for u in _phrase_right(units, last)} if w >= 0)
    features.append(base + min(before, CAP))
    base += CAP + 1
    features.append(base + min(after, CAP))
    return features


def _phrase_left(units: Sequence[Unit], index: int) -> list[Unit]:
    out = []
    for i in range(index - 1, -1, -1):
        if units[i].word < 0:
            break
        out.append(units[i])
    return out


def _phrase_right(units: Sequence[Unit], index: int) -> list[Unit]:
    out = []
    for i in range(index + 1, len(units)):
        if units[i].word < 0:
            break
        out.append(units[i])
    return out


def duration_input_size(inventory_size: int) -> int:
    return 3 * (inventory_size + 1) + len(PAUSE_KINDS) + 4 + CAP + 2 * (CAP + 1)


class ProsodyModel:
    """The shipped models (``prosody.json``): break weights and the duration network."""

    def __init__(self, data: dict):
        self.vocabulary = {w: i for i, w in enumerate(data["break_words"])}
        self.break_weights = np.asarray(data["break_weights"], dtype=np.float64)
        self.break_bias = float(data["break_bias"])
        self.inventory = {u: i for i, u in enumerate(data["inventory"])}
        self.w1 = np.asarray(data["w1"], dtype=np.float64)  # [inputs, hidden]
        self.b1 = np.asarray(data["b1"], dtype=np.float64)
        self.w2 = np.asarray(data["w2"], dtype=np.float64)  # [hidden]
        self.b2 = float(data["b2"])
        #: One-word phrases the teacher runs on from, comma or not ("Wow, ..." and "Yes, ...": 0 of
        #: 98 and 1 of 92 paused in its training speech, while "No, ..." paused 93 of 93). Absent
        #: from older voices' prosody.json: there every comma pauses.
        self.comma_unpaused = frozenset(data.get("comma_unpaused_words", ()))

    @classmethod
    def load(cls, path: str | Path) -> "ProsodyModel":
        return cls(json.loads(Path(path).read_text()))

    def is_break(self, next_word: str, since: int, remaining: int) -> bool:
        active = break_features(next_word, since, remaining, self.vocabulary)
        return float(self.break_weights[active].sum() + self.break_bias) > 0.0

    def pauses_at_comma(self, word: str, since: int) -> bool:
        """Whether a comma after ``word`` pauses, ``since`` words after the last pause (1: the
        word alone)."""
        return not (since == 1 and word.lower() in self.comma_unpaused)

    def frames(self, units: Sequence[Unit]) -> list[int]:
        """Frames of each unit (at least 1)."""
        if not units:
            return []
        hidden = np.stack([self.w1[duration_features(units, i, self.inventory)].sum(0) for i in range(len(units))])
        log_frames = np.maximum(hidden + self.b1, 0.0) @ self.w2 + self.b2
        return [max(1, int(round(float(np.exp(v))))) for v in log_frames]
