"""A varied English sentence set for the built-in voice, generated from templates and word lists.

Deterministic for a seed. Three kinds of training text: templated sentences (many templates:
statements, questions, exclamations, lists, numbers, times), "word salad" lines of random words
from pocketsphinx's US English dictionary (phonetic coverage beyond the word lists; skipped when
pocketsphinx is not installed) and utterances of two or three sentences (pauses, longer index
ranges). ``held_out`` sentences come from templates the training set never uses, and every
held-out word is in pocketsphinx's dictionary, so a JSGF grammar of them loads.

    python -m recipes.builtin_voice.corpus --count 12000 --out data/sentences.txt
"""

from __future__ import annotations

import argparse
import random
import re
from pathlib import Path

NAMES = ["Anna", "Ben", "Carla", "David", "Elena", "Frank", "Grace", "Henry", "Irene", "Jack", "Karen", "Leo",
         "Maria", "Nick", "Olivia", "Peter", "Quinn", "Rosa", "Sam", "Tina", "Victor", "Wendy", "Yvonne", "Zoe",
         "Alice", "Bob", "Charles", "Diana", "Edward", "Fiona", "George", "Helen", "Ivan", "Julia", "Kevin", "Laura",
         "Martin", "Nora", "Oscar", "Paula", "Robert", "Sarah", "Thomas", "Ursula", "Walter", "Emma", "Lucy", "Mark"]
NOUNS = ["apple", "river", "window", "garden", "letter", "bridge", "doctor", "kitchen", "mountain", "teacher",
         "bicycle", "camera", "forest", "island", "ticket", "station", "market", "painting", "engine", "blanket",
         "village", "concert", "pocket", "candle", "harbor", "lesson", "museum", "orange", "pencil", "rabbit",
         "school", "tower", "umbrella", "valley", "wallet", "zebra", "basket", "cloud", "desert", "feather",
         "guitar", "hammer", "jacket", "kettle", "ladder", "needle", "ocean", "puzzle", "rocket", "saddle",
         "tunnel", "violin", "whistle", "button", "carpet", "dragon", "glove", "carrot", "airport", "bottle",
         "castle", "chair", "clock", "computer", "cookie", "dinner", "dog", "door", "dream", "farmer", "field",
         "flower", "friend", "gate", "horse", "house", "idea", "lamp", "lemon", "library", "machine", "map",
         "mirror", "monkey", "morning", "newspaper", "office", "picture", "pilot", "planet", "potato", "radio",
         "road", "sandwich", "shadow", "ship", "shoe", "singer", "sister", "song", "spoon", "story", "street",
         "student", "table", "telephone", "tiger", "tomato", "train", "tree", "truck", "voice", "water", "wheel",
         "winter", "wolf", "yard", "banana", "battery", "beach", "bird", "book", "box", "brother", "cake", "car",
         "cat", "cheese", "child", "city", "coat", "coffee", "cup", "dentist", "diamond", "drawer", "egg",
         "elephant", "envelope", "factory", "fish", "fork", "fox", "game", "ghost", "gift", "hat", "hotel",
         "island", "jar", "key", "king", "knife", "lake", "lion", "magnet", "meadow", "moon", "mouse", "nurse",
         "owl", "pan", "parrot", "pearl", "pillow", "pizza", "plate", "queen", "rain", "ring", "robot", "roof",
         "sailor", "shirt", "snake", "soup", "star", "stone", "sugar", "sun", "tea", "tent", "thread", "toy",
         "village", "wagon", "whale", "window", "wizard"]
ADJECTIVES = ["small", "bright", "quiet", "heavy", "ancient", "empty", "golden", "narrow", "gentle", "broken",
              "famous", "frozen", "hidden", "lovely", "modern", "noisy", "purple", "rapid", "silver", "tiny",
              "warm", "wooden", "curious", "distant", "fragile", "honest", "little", "muddy", "polite", "strange",
              "big", "old", "new", "young", "happy", "sad", "angry", "brave", "calm", "clean", "clever", "cold",
              "dark", "deep", "dirty", "dry", "early", "easy", "fast", "fresh", "friendly", "funny", "green", "hard",
              "huge", "hungry", "kind", "late", "lazy", "loud", "lucky", "nervous", "perfect", "poor", "proud",
              "red", "rich", "round", "rough", "sharp", "short", "shy", "simple", "slow", "smooth", "soft", "sour",
              "square", "sweet", "tall", "thick", "thin", "tired", "useful", "weak", "wet", "wild", "wise"]
VERBS_PAST = ["found", "painted", "carried", "opened", "cleaned", "visited", "watched", "borrowed", "fixed",
              "followed", "lost", "moved", "ordered", "packed", "repaired", "sold", "touched", "wanted", "built",
              "dropped", "bought", "brought", "caught", "chose", "cooked", "counted", "covered", "described",
              "drew", "explained", "filled", "forgot", "hid", "kept", "liked", "made", "measured", "noticed",
              "pulled", "pushed", "read", "remembered", "saw", "showed", "stole", "threw", "tried", "washed"]
VERBS_BASE = ["find", "paint", "carry", "open", "clean", "visit", "watch", "borrow", "fix", "follow", "move",
              "order", "pack", "repair", "sell", "touch", "build", "drop", "share", "check", "buy", "bring",
              "catch", "choose", "cook", "count", "cover", "describe", "draw", "explain", "fill", "hide", "keep",
              "make", "measure", "notice", "pull", "push", "read", "remember", "see", "show", "throw", "wash"]
VERBS_ING = ["reading", "singing", "cooking", "walking", "running", "painting", "sleeping", "laughing", "waiting",
             "working", "swimming", "writing", "dancing", "talking", "thinking", "driving", "playing", "studying"]
PLACES = ["in the morning", "after lunch", "near the station", "on Sunday", "before dinner", "at the market",
          "under the bridge", "by the river", "in the old town", "at midnight", "during the storm",
          "next to the school", "on the second floor", "behind the museum", "in the garden", "at the airport",
          "in the kitchen", "on the beach", "across the street", "inside the box", "on Monday", "last week",
          "every evening", "at noon", "in the spring", "after the concert", "near the lake", "at home"]
NUMBERS = ["two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve", "twenty",
           "thirty", "forty", "fifty", "a hundred", "thirteen", "fifteen", "sixteen", "eighteen", "sixty", "ninety"]
COLORS = ["red", "blue", "green", "black", "white", "brown", "gray", "pink", "orange", "purple", "yellow"]
ADVERBS = ["quickly", "slowly", "carefully", "quietly", "suddenly", "happily", "finally", "really", "almost",
           "never", "always", "often", "sometimes", "certainly", "probably", "easily"]

TRAIN_TEMPLATES = [
    "{name} {vpast} the {adj} {noun} {place}.",
    "The {adj} {noun} was {place}.",
    "Did {name} {vbase} the {noun} {place}?",
    "We saw {num} {color} {nouns} {place}.",
    "Please {vbase} the {adj} {noun} for {name}.",
    "{name} and {name2} {vpast} a {adj} {noun}.",
    "There are {num} {nouns} in the {adj} {noun2}.",
    "My {noun} is {adj}, but the {noun2} is {adj2}.",
    "Why did the {noun} look so {adj} {place}?",
    "{name} said that the {noun} was {color}.",
    "I will {vbase} your {noun} {place}.",
    "Nobody {vpast} the {color} {noun} {place}.",
    "Hello {name}, how is your {noun}?",
    "Good morning! The {noun} is {adv} {adj} today.",
    "Could you {vbase} the {noun}, please?",
    "{name} was {ving} {place} when the {noun} fell.",
    "Is it true that {name} {vpast} {num} {nouns}?",
    "What a {adj} {noun}!",
    "It is {time}, and the {noun} is still {adj}.",
    "The {noun} costs {price}.",
    "On {day}, {name} will {vbase} a {adj} {noun}.",
    "{name} {adv} {vpast} the {noun2} and the {noun}.",
    "If the {noun} is {adj}, we can {vbase} it {place}.",
    "They bought {digits} {nouns} for the {noun2}.",
    "Where did you {vbase} the {adj} {noun}?",
    "I think the {noun} and the {noun2} are {adj}.",
    "{name}, {name2} and {name3} like {ving}.",
    "Yes, the {noun} is {color}. No, the {noun2} is not.",
    "Room {digits} is on the {ordinal} floor.",
    "This is the {ordinal} time that {name} {vpast} a {noun}.",
    "Wow, {name} {vpast} the {noun} {adv}!",
    "How many {nouns} did {name} {vbase}?",
    "The {adj} {noun} and the {adj2} {noun2} were {place}.",
    "We are {ving}, so please {vbase} the {noun} later.",
    "Before {ving}, {name} {vpast} the {noun}.",
    "The {noun} of {name} is {adv} {adj}.",
]
HELD_OUT_TEMPLATES = [
    "Tomorrow {name} will {vbase} {num} {adj} {nouns}.",
    "Where is the {color} {noun} that {name} {vpast}?",
    "The {noun} and the {noun2} are both {adj}.",
    "{name} {vpast} my {adj} {noun} {place}.",
]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
ORDINALS = ["first", "second", "third", "fourth", "fifth", "sixth", "tenth", "last"]


IRREGULAR_PLURALS = {"child": "children", "mouse": "mice", "knife": "knives", "wolf": "wolves",
                     "fish": "fish", "sheep": "sheep"}


def plural(noun: str) -> str:
    if noun in IRREGULAR_PLURALS:
        return IRREGULAR_PLURALS[noun]
    if noun.endswith("y") and noun[-2:-1] not in "aeiou":
        return noun[:-1] + "ies"
    if noun.endswith(("s", "x", "ch", "sh")) or noun in ("potato", "tomato"):
        return noun + "es"
    return noun + "s"


def _fill(template: str, rng: random.Random) -> str:
    name, name2, name3 = rng.sample(NAMES, 3)
    noun, noun2 = rng.sample(NOUNS, 2)
    adj, adj2 = rng.sample(ADJECTIVES, 2)
    text = template.format(
        name=name, name2=name2, name3=name3, noun=noun, noun2=noun2, nouns=plural(noun), nouns2=plural(noun2),
        adj=adj, adj2=adj2,
        vpast=rng.choice(VERBS_PAST), vbase=rng.choice(VERBS_BASE), ving=rng.choice(VERBS_ING),
        place=rng.choice(PLACES), num=rng.choice(NUMBERS), color=rng.choice(COLORS), adv=rng.choice(ADVERBS),
        day=rng.choice(DAYS), ordinal=rng.choice(ORDINALS), digits=str(rng.choice([rng.randint(2, 99),
                                                                                    rng.randint(100, 2500)])),
        time=f"{rng.randint(1, 12)}:{rng.choice(['00', '15', '30', '45'])}",
        price=rng.choice([f"${rng.randint(1, 99)}.{rng.randint(10, 99)}", f"{rng.randint(2, 90)} dollars"]))
    return text[0].upper() + text[1:]


def dictionary_words() -> list[str]:
    """Plain words of pocketsphinx's US English dictionary (empty without pocketsphinx)."""
    try:
        from pocketsphinx import get_model_path
    except ImportError:
        return []
    path = Path(get_model_path()) / "en-us" / "cmudict-en-us.dict"
    words = []
    for line in path.read_text(errors="replace").splitlines():
        word = line.split(" ", 1)[0]
        if re.fullmatch(r"[a-z]{3,10}", word):
            words.append(word)
    return words


def _word_salad(rng: random.Random, words: list[str]) -> str:
    text = " ".join(rng.choice(words) for _ in range(rng.randint(4, 9)))
    return text[0].upper() + text[1:] + rng.choice([".", ".", "?", "!"])


def sentences(count: int, *, seed: int = 0, templates: list[str] = TRAIN_TEMPLATES,
              exclude: set[str] = frozenset(), salad: float = 0.0, multi: float = 0.0) -> list[str]:
    """``count`` distinct texts (fewer only if the templates run out): a ``salad`` fraction of random
    dictionary words, a ``multi`` fraction of two or three templated sentences."""
    rng = random.Random(seed)
    words = dictionary_words() if salad > 0 else []
    out: list[str] = []
    seen = set(exclude)
    attempts = 0
    while len(out) < count and attempts < count * 50:
        attempts += 1
        kind = rng.random()
        if words and kind < salad:
            text = _word_salad(rng, words)
        elif kind < salad + multi:
            text = " ".join(_fill(rng.choice(templates), rng) for _ in range(rng.randint(2, 3)))
        else:
            text = _fill(rng.choice(templates), rng)
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out


def training_texts(count: int, seed: int = 0) -> list[str]:
    """The recipe's training texts: 70 % single sentences, 15 % word salad, 15 % multi-sentence."""
    return sentences(count, seed=seed, salad=0.15, multi=0.15)


def held_out(count: int = 40, *, seed: int = 1234, train: list[str] | None = None) -> list[str]:
    """Sentences from templates the training set never uses (and not in ``train``)."""
    return sentences(count, seed=seed, templates=HELD_OUT_TEMPLATES, exclude=set(train or []))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=12000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--held-out", type=Path, help="also write 40 held-out sentences here")
    args = parser.parse_args(argv)
    train = training_texts(args.count, seed=args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(train) + "\n")
    if args.held_out:
        args.held_out.write_text("\n".join(held_out(train=train)) + "\n")
    print(f"wrote {len(train)} texts to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
