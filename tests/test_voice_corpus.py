"""The fourth-generation voice's corpus (recipes/builtin_voice/corpus.py): big and varied enough,
and split into train, validation and test once and for all."""

import re

from recipes.builtin_voice.corpus import V4_HELD_TEMPLATES, evaluation_texts, split_of, v4_corpus


def test_the_corpus_has_twenty_thousand_training_texts_of_every_kind():
    corpus = v4_corpus(24000)
    texts = [t for t, _ in corpus]
    assert len(set(texts)) == 24000
    train = [t for t, s in corpus if s == "train"]
    assert len(train) >= 20000
    kinds = {"question": r"\?$", "number": r"\d", "date": r"\b(January|February|March|April|May|June|July|August|"
             r"September|October|November|December) \d", "money": r"\$\d", "phone": r"\d{3}-\d{3}-\d{4}",
             "surname": r"\b(Smith|Garcia|Nguyen|Brown)\b", "long": r"^(\S+ ){25}", "short": r"^(\S+ ){0,3}\S+[.!?]$"}
    for kind, pattern in kinds.items():
        assert sum(bool(re.search(pattern, t)) for t in train) >= 100, kind


def test_a_texts_split_depends_on_the_text_alone():
    small, large = dict(v4_corpus(2000)), dict(v4_corpus(24000))
    assert all(large[text] == split for text, split in small.items())
    assert {split_of(text) for text in list(large)[:500]} == {"train", "validation", "test"}
    shares = {s: sum(v == s for v in large.values()) / len(large) for s in ("train", "validation", "test")}
    assert 0.84 < shares["train"] < 0.9 and 0.05 < shares["validation"] < 0.09 and 0.05 < shares["test"] < 0.09


def test_held_template_sentences_never_reach_training():
    # Each held template's fixed words: a training text never starts with that shape.
    slot = r"(?:[\w$,:'/ -]|\.(?=\d))+"  # a filled slot: words, numbers, prices; never a sentence's end
    held_shapes = [re.compile("^" + re.sub(r"\\\{[a-z0-9]+\\\}", lambda _: slot, re.escape(t)) + "$")
                   for t in V4_HELD_TEMPLATES]
    held = [t for t, s in v4_corpus(24000) if s != "train" and any(p.match(t) for p in held_shapes)]
    assert len(held) > 500
    train = {t for t, s in v4_corpus(24000) if s == "train"}
    assert not any(p.match(t) for t in train for p in held_shapes[-3:])


def test_evaluation_texts_are_spoken_forms_from_their_split_alone():
    test, validation = evaluation_texts("test", 50), evaluation_texts("validation", 50)
    assert len(test) == len(validation) == 50 and not set(test) & set(validation)
    assert not any(re.search(r"\d", t) for t in test)  # the normalizer's words, as the recogniser hears them
    assert len(evaluation_texts("held-out", 40)) == 40
