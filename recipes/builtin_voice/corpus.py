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
import hashlib
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


# --- The fourth generation's corpus: more kinds of text, and a fixed three-way split. ---------------

SURNAMES = ["Smith", "Garcia", "Nguyen", "Brown", "Miller", "Wilson", "Moore", "Taylor", "Anderson", "Jackson",
            "White", "Harris", "Martin", "Thompson", "Lopez", "Clark", "Lewis", "Walker", "Young", "Allen", "King",
            "Wright", "Scott", "Green", "Baker", "Adams", "Nelson", "Hill", "Campbell", "Mitchell", "Roberts",
            "Carter", "Phillips", "Evans", "Turner", "Parker", "Collins", "Edwards", "Stewart", "Morris", "Murphy",
            "Cook", "Rogers", "Morgan", "Cooper", "Peterson", "Reed", "Bailey", "Kelly", "Howard", "Ward", "Cox",
            "Richardson", "Wood", "Watson", "Brooks", "Bennett", "Gray", "James", "Hughes", "Price", "Sanders"]
MORE_NAMES = ["Aaron", "Abigail", "Adrian", "Amelia", "Andrew", "Angela", "Arthur", "Beatrice", "Brian", "Caleb",
              "Caroline", "Daniel", "Dorothy", "Eleanor", "Ethan", "Felix", "Gabriel", "Hannah", "Isaac", "Jasmine",
              "Jonathan", "Joseph", "Katherine", "Lily", "Louis", "Margaret", "Matthew", "Michael", "Natalie",
              "Nathan", "Patrick", "Rachel", "Rebecca", "Samuel", "Sophia", "Steven", "Theodore", "Vincent",
              "Vanessa", "William", "Priya", "Ahmed", "Mei", "Hiroshi", "Fatima", "Carlos", "Ingrid", "Dmitri"]
CITIES = ["Boston", "Chicago", "Denver", "Seattle", "Atlanta", "Houston", "Phoenix", "Portland", "Dallas",
          "Miami", "Detroit", "Nashville", "London", "Paris", "Berlin", "Madrid", "Rome", "Tokyo", "Sydney",
          "Toronto", "Dublin", "Vienna", "Prague", "Lisbon", "Oslo", "Cairo", "Mumbai", "Seoul", "Mexico City"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
UNITS = ["miles", "kilometers", "pounds", "kilograms", "minutes", "hours", "days", "weeks", "meters", "feet",
         "inches", "liters", "degrees", "percent", "people", "pages", "votes", "points"]
SHORT_TEXTS = ["Yes.", "No.", "Thank you!", "Wait.", "Hello?", "Okay.", "Of course.", "Not yet.", "Good night.",
               "See you soon.", "Really?", "I agree.", "Why not?", "Watch out!", "Come in.", "Almost there.",
               "Well done!", "Excuse me.", "Not at all.", "Let me think.", "Right away.", "That's fine.",
               "Never mind.", "Go ahead.", "Sounds good.", "I'm sorry.", "Maybe later.", "Absolutely!",
               "Hold on.", "Got it.", "Please stop.", "How strange.", "Try again.", "Welcome back!"]
CONNECTIVES = ["because", "although", "while", "even though", "so", "and then", "but", "unless", "after", "since"]
V4_TEMPLATES = [
    # dates and years
    "{name}'s birthday is on {month} {daynum}.",
    "The meeting moved to {day}, {month} {daynum}, {year}.",
    "We first met in {year}, in {city}.",
    "The report is due on {slashdate}.",
    "Between {year} and {year2}, the {noun} changed {adv}.",
    "Is the concert on the {ordinal} of {month}?",
    # numbers, money, measures, phone numbers
    "The {noun} weighs {decimal} {unit}.",
    "Call {name} at {phone}.",
    "Our team scored {bignum} points this season.",
    "Prices rose by {percent} last {month}.",
    "The {adj} {noun} is {decimal} {unit} long, not {num} {unit}.",
    "Flight {digits} to {city} leaves at {clock}.",
    "I paid {price} for {num} {nouns}, which is too much.",
    "The population of {city} is about {bignum}.",
    "Chapter {digits} starts on page {bignum2}.",
    # names and places
    "Doctor {surname} will see {name} {surname2} {place}.",
    "{name} {surname} moved from {city} to {city2}.",
    "Mister {surname} and Missus {surname2} {vpast} a {noun} in {city}.",
    "Have you ever been to {city}, {name}?",
    # questions of every kind
    "When will {name} {vbase} the {noun}?",
    "Who {vpast} the {adj} {noun} {place}?",
    "Which {noun} do you want, the {color} one or the {adj} one?",
    "Can you tell me where the {noun2} is?",
    "Why would anyone {vbase} a {noun} {place}?",
    "You {vpast} the {noun}, didn't you?",
    "How long does it take to {vbase} a {adj} {noun}?",
    "Are the {nouns} {adj} or {adj2}?",
    # long sentences with clauses
    "{name} {vpast} the {adj} {noun} {place}, {conj} {name2} was {ving} {place2} with a {noun2}.",
    "When the {noun} finally arrived, {name} {vpast} it {adv} and walked to the {noun2} without a word.",
    "If you {vbase} the {noun} before {clock}, we can still {vbase2} the {adj} {noun2} {place}.",
    "After {ving} for {num} {unit}, {name} and {name2} {vpast} a {adj} {noun} and went home {adv}.",
    "The {adj} {noun} that {name} {vpast} {place} was {adv} {adj2}, {conj} nobody {vpast2} it.",
]
#: Templates whose texts never reach the training split: the validation and test splits also
#: measure sentence shapes the model never trained on.
V4_HELD_TEMPLATES = HELD_OUT_TEMPLATES + [
    "On {month} {daynum}, {name} {surname} {vpast} {num} {nouns} in {city}.",
    "Do you know why the {noun} costs {price}?",
    "{name} was {ving} {place} {conj} the {adj} {noun} {vpast2} the {noun2}.",
]


def _fill_v4(template: str, rng: random.Random) -> str:
    name, name2, name3 = rng.sample(NAMES + MORE_NAMES, 3)
    surname, surname2 = rng.sample(SURNAMES, 2)
    city, city2 = rng.sample(CITIES, 2)
    noun, noun2 = rng.sample(NOUNS, 2)
    adj, adj2 = rng.sample(ADJECTIVES, 2)
    year = rng.randint(1900, 2030)
    hour, minute = rng.randint(1, 12), rng.choice(["00", "05", "15", "20", "30", "45", "50"])
    text = template.format(
        name=name, name2=name2, name3=name3, surname=surname, surname2=surname2, city=city, city2=city2,
        noun=noun, noun2=noun2, nouns=plural(noun), adj=adj, adj2=adj2,
        vpast=rng.choice(VERBS_PAST), vpast2=rng.choice(VERBS_PAST), vbase=rng.choice(VERBS_BASE),
        vbase2=rng.choice(VERBS_BASE), ving=rng.choice(VERBS_ING), place=rng.choice(PLACES),
        place2=rng.choice(PLACES), num=rng.choice(NUMBERS), color=rng.choice(COLORS), adv=rng.choice(ADVERBS),
        day=rng.choice(DAYS), ordinal=rng.choice(ORDINALS), month=rng.choice(MONTHS), daynum=rng.randint(1, 28),
        year=year, year2=year + rng.randint(2, 40), slashdate=f"{rng.randint(1, 12)}/{rng.randint(1, 28)}/{year}",
        decimal=f"{rng.randint(0, 99)}.{rng.randint(1, 9)}", unit=rng.choice(UNITS),
        phone=f"{rng.randint(200, 989)}-{rng.randint(200, 989)}-{rng.randint(1000, 9999)}",
        bignum=f"{rng.randint(1, 999)},{rng.randint(0, 999):03d}", bignum2=rng.randint(100, 999),
        percent=f"{rng.randint(1, 60)}%", digits=rng.randint(2, 999),
        clock=f"{hour}:{minute} {rng.choice(['am', 'pm'])}", conj=rng.choice(CONNECTIVES),
        price=rng.choice([f"${rng.randint(1, 999)}.{rng.randint(10, 99)}", f"{rng.randint(2, 90)} dollars"]))
    return text[0].upper() + text[1:]


#: The fixed split: a text's split follows from its own characters (SHA-256 of the text), never from
#: how many texts were drawn or in what order, so a larger corpus keeps every earlier text's split.
#: Texts of the held templates go to validation or test only (half each); the rest: 92 % train,
#: 4 % validation, 4 % test.
SPLITS = ("train", "validation", "test")


def split_of(text: str, *, held: bool = False) -> str:
    bucket = int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big") % 100
    if held:
        return "validation" if bucket < 50 else "test"
    return "train" if bucket < 92 else "validation" if bucket < 96 else "test"


def v4_corpus(count: int = 24000, seed: int = 4) -> list[tuple[str, str]]:
    """``count`` distinct (text, split) pairs: 35 % the first corpus's templates, 25 % the new
    templates (dates, years, numbers, money, phone numbers, names and places, questions, long
    sentences), 6 % held templates, 4 % short texts, 10 % word salad, 20 % two or three sentences."""
    rng = random.Random(seed)
    words = dictionary_words()
    out: list[tuple[str, str]] = []
    seen: set[str] = set()
    attempts = 0
    while len(out) < count and attempts < count * 50:
        attempts += 1
        kind, held = rng.random(), False
        if kind < 0.35:
            text = _fill(rng.choice(TRAIN_TEMPLATES), rng)
        elif kind < 0.60:
            text = _fill_v4(rng.choice(V4_TEMPLATES), rng)
        elif kind < 0.66:
            text, held = _fill_v4(rng.choice(V4_HELD_TEMPLATES), rng), True
        elif kind < 0.70:
            text = rng.choice(SHORT_TEXTS)
            if rng.random() < 0.5:
                text = f"{text} {rng.choice(SHORT_TEXTS)}"
        elif kind < 0.80 and words:
            text = _word_salad(rng, words)
        else:
            pick = [_fill(rng.choice(TRAIN_TEMPLATES), rng) if rng.random() < 0.5
                    else _fill_v4(rng.choice(V4_TEMPLATES), rng) for _ in range(rng.randint(2, 3))]
            text = " ".join(pick)
        if text not in seen:
            seen.add(text)
            out.append((text, split_of(text, held=held)))
    return out


def evaluation_texts(split: str, count: int, corpus_count: int = 24000) -> list[str]:
    """The first ``count`` texts of a v4 split as the normalizer speaks them (what the recogniser
    should hear), keeping only those whose every word is in pocketsphinx's dictionary (so a JSGF
    grammar of them loads). ``split`` "held-out": the first generations' 40 held-out sentences."""
    if split == "held-out":
        return held_out(count)
    from audio_pipeline.text.normalize import normalize

    known = set(dictionary_words()) | {"a", "i", "an", "am", "at", "be", "by", "do", "go", "he", "in", "is", "it",
                                       "me", "my", "no", "of", "oh", "on", "or", "so", "to", "up", "us", "we"}
    out = []
    for text, where in v4_corpus(corpus_count):
        if where != split:
            continue
        spoken = normalize(text).spoken
        words = re.sub(r"[^a-z' ]", " ", spoken.lower()).split()
        if all(w in known or w.replace("'", "") in known for w in words):
            out.append(spoken)
            if len(out) == count:
                break
    return out


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
