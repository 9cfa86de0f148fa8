"""A varied English sentence set for the built-in voice, generated from templates and word lists.

Deterministic for a seed. ``held_out`` sentences are built from a separate template set and never
occur in the training set, so intelligibility is measured on text the model has not seen.

    python -m recipes.builtin_voice.corpus --count 6000 --out data/sentences.txt
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

NAMES = ["Anna", "Ben", "Carla", "David", "Elena", "Frank", "Grace", "Henry", "Irene", "Jack", "Karen", "Leo",
         "Maria", "Nick", "Olivia", "Peter", "Quinn", "Rosa", "Sam", "Tina", "Victor", "Wendy", "Yvonne", "Zoe"]
NOUNS = ["apple", "river", "window", "garden", "letter", "bridge", "doctor", "kitchen", "mountain", "teacher",
         "bicycle", "camera", "forest", "island", "ticket", "station", "market", "painting", "engine", "blanket",
         "village", "concert", "pocket", "candle", "harbor", "lesson", "museum", "orange", "pencil", "rabbit",
         "school", "tower", "umbrella", "valley", "wallet", "yellow bus", "zebra", "basket", "cloud", "desert",
         "feather", "guitar", "hammer", "jacket", "kettle", "ladder", "needle", "ocean", "puzzle", "rocket",
         "saddle", "tunnel", "violin", "whistle", "button", "carpet", "dragon", "engine room", "glove", "carrot"]
ADJECTIVES = ["small", "bright", "quiet", "heavy", "ancient", "empty", "golden", "narrow", "gentle", "broken",
              "famous", "frozen", "hidden", "lovely", "modern", "noisy", "purple", "rapid", "silver", "tiny",
              "warm", "wooden", "curious", "distant", "fragile", "honest", "little", "muddy", "polite", "strange"]
VERBS_PAST = ["found", "painted", "carried", "opened", "cleaned", "visited", "watched", "borrowed", "fixed",
              "followed", "lost", "moved", "ordered", "packed", "repaired", "sold", "touched", "wanted", "built",
              "dropped"]
VERBS_BASE = ["find", "paint", "carry", "open", "clean", "visit", "watch", "borrow", "fix", "follow", "move",
              "order", "pack", "repair", "sell", "touch", "build", "drop", "share", "check"]
PLACES = ["in the morning", "after lunch", "near the station", "on Sunday", "before dinner", "at the market",
          "under the bridge", "by the river", "in the old town", "at midnight", "during the storm",
          "next to the school", "on the second floor", "behind the museum", "in the garden"]
NUMBERS = ["two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve", "twenty",
           "thirty", "forty", "fifty", "a hundred"]
COLORS = ["red", "blue", "green", "black", "white", "brown", "gray", "pink", "orange", "purple"]

TRAIN_TEMPLATES = [
    "{name} {vpast} the {adj} {noun} {place}.",
    "The {adj} {noun} was {place}.",
    "Did {name} {vbase} the {noun} {place}?",
    "We saw {num} {color} {noun}s {place}.",
    "Please {vbase} the {adj} {noun} for {name}.",
    "{name} and {name2} {vpast} a {adj} {noun}.",
    "There are {num} {noun}s in the {adj} {noun2}.",
    "My {noun} is {adj}, but the {noun2} is {adj2}.",
    "Why did the {noun} look so {adj} {place}?",
    "{name} said that the {noun} was {color}.",
    "I will {vbase} your {noun} {place}.",
    "Nobody {vpast} the {color} {noun} {place}.",
]
HELD_OUT_TEMPLATES = [
    "Tomorrow {name} will {vbase} {num} {adj} {noun}s.",
    "Where is the {color} {noun} that {name} {vpast}?",
    "The {noun} and the {noun2} are both {adj}.",
    "{name} {vpast} my {adj} {noun} {place}.",
]


def _fill(template: str, rng: random.Random) -> str:
    name, name2 = rng.sample(NAMES, 2)
    noun, noun2 = rng.sample(NOUNS, 2)
    adj, adj2 = rng.sample(ADJECTIVES, 2)
    text = template.format(name=name, name2=name2, noun=noun, noun2=noun2, adj=adj, adj2=adj2,
                           vpast=rng.choice(VERBS_PAST), vbase=rng.choice(VERBS_BASE), place=rng.choice(PLACES),
                           num=rng.choice(NUMBERS), color=rng.choice(COLORS))
    return text[0].upper() + text[1:]


def sentences(count: int, *, seed: int = 0, templates: list[str] = TRAIN_TEMPLATES,
              exclude: set[str] = frozenset()) -> list[str]:
    """``count`` distinct sentences (fewer only if the templates run out)."""
    rng = random.Random(seed)
    out: list[str] = []
    seen = set(exclude)
    attempts = 0
    while len(out) < count and attempts < count * 50:
        attempts += 1
        text = _fill(rng.choice(templates), rng)
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out


def held_out(count: int = 40, *, seed: int = 1234, train: list[str] | None = None) -> list[str]:
    """Sentences from templates the training set never uses (and not in ``train``)."""
    return sentences(count, seed=seed, templates=HELD_OUT_TEMPLATES, exclude=set(train or []))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=6000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--held-out", type=Path, help="also write 40 held-out sentences here")
    args = parser.parse_args(argv)
    train = sentences(args.count, seed=args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(train) + "\n")
    if args.held_out:
        args.held_out.write_text("\n".join(held_out(train=train)) + "\n")
    print(f"wrote {len(train)} sentences to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
