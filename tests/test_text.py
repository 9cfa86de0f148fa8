"""Text normalization (written forms to the words a reader says) and sentence segmentation."""

import pytest

from audio_pipeline.text.normalize import normalize
from audio_pipeline.text.segment import PAUSES, segments

NORMALIZATION = [
    # cardinals, signs, separators, decimals
    ("I have 3 apples.", "I have three apples."),
    ("0", "zero"),
    ("There were 42 of them.", "There were forty-two of them."),
    ("1,234,567 people", "one million two hundred thirty-four thousand five hundred sixty-seven people"),
    ("It is 1000 km long.", "It is one thousand kilometers long."),
    ("-3 degrees", "minus three degrees"),
    ("Pi is 3.14.", "Pi is three point one four."),
    ("It weighs 0.5 kg.", "It weighs zero point five kilograms."),
    ("Version 2.0 is out.", "Version two point zero is out."),
    ("A 2+2=4 trick.", "A two plus two equals four trick."),
    # ordinals
    ("She came 1st.", "She came first."),
    ("the 2nd floor", "the second floor"),
    ("my 3rd try", "my third try"),
    ("the 21st century", "the twenty-first century"),
    ("his 100th birthday", "his one hundredth birthday"),
    # money
    ("I paid $5.50.", "I paid five dollars and fifty cents."),
    ("It costs $1.", "It costs one dollar."),
    ("Only $0.99!", "Only ninety-nine cents!"),
    ("$1.5 million", "one point five million dollars"),
    ("$2 billion", "two billion dollars"),
    ("€20 each", "twenty euros each"),
    ("£3.50", "three pounds and fifty pence"),
    ("$1,200", "one thousand two hundred dollars"),
    # percentages
    ("Up 12.5% today.", "Up twelve point five percent today."),
    ("100% sure", "one hundred percent sure"),
    ("50%off", "fifty percent off"),
    # times
    ("at 9:15", "at nine fifteen"),
    ("At 10:00 we start.", "At ten o'clock we start."),
    ("by 9:05 pm", "by nine oh five p m"),
    ("at 7:30am", "at seven thirty a m"),
    ("at 23:45", "at twenty-three forty-five"),
    # dates and years
    ("Born on 2024-01-05.", "Born on January fifth, twenty twenty-four."),
    ("Due 3/5/2024.", "Due March fifth, twenty twenty-four."),
    ("On January 5th, 2024 we met.", "On January fifth, twenty twenty-four we met."),
    ("July 4, 1776", "July fourth, seventeen seventy-six"),
    ("Sept. 3", "September third"),
    ("Dec 25", "December twenty-fifth"),
    ("In 1999 it rained.", "In nineteen ninety-nine it rained."),
    ("since 2005", "since two thousand five"),
    ("in 1905", "in nineteen oh five"),
    ("by 2100", "by twenty-one hundred"),
    ("The 1990s were fun.", "The nineteen nineties were fun."),
    ("the 1800s", "the eighteen hundreds"),
    # phone numbers
    ("Call (555) 123-4567 now.", "Call five five five, one two three, four five six seven now."),
    ("Call 555-123-4567.", "Call five five five, one two three, four five six seven."),
    ("+1 555 123 4567", "plus one, five five five, one two three, four five six seven"),
    ("Call 555-1234 today.", "Call five five five, one two three four today."),
    # units
    ("It is 5 km away.", "It is five kilometers away."),
    ("He ran 1 mile.", "He ran one mile."),
    ("a 10 kg bag", "a ten kilograms bag"),
    ("It was 5°C.", "It was five degrees Celsius."),
    ("3 GB of RAM", "three gigabytes of RAM"),
    ("60 mph", "sixty miles per hour"),
    ("at 2.4 GHz", "at two point four gigahertz"),
    ("wait 30 min", "wait thirty minutes"),
    # abbreviations and titles
    ("Dr. Smith is here.", "doctor Smith is here."),
    ("Mr. and Mrs. Jones", "mister and missus Jones"),
    ("Prof. Lee", "professor Lee"),
    ("cats vs. dogs", "cats versus dogs"),
    ("apples, pears, etc.", "apples, pears, et cetera"),
    ("fruit, e.g. apples", "fruit, for example apples"),
    ("one, i.e. the first", "one, that is the first"),
    ("Acme Inc. and Foo Ltd.", "Acme incorporated and Foo limited"),
    # URLs and e-mail
    ("Visit https://example.com/docs today.", "Visit example dot com slash docs today."),
    ("Go to www.example.org.", "Go to w w w dot example dot org."),
    ("Mail john.doe@example.org please.", "Mail john dot doe at example dot org please."),
    # symbols
    ("Tom & Jerry", "Tom and Jerry"),
    ("Room #4", "Room number four"),
    ("Q&A", "Q and A"),
    ("me @ home", "me at home"),
    # left alone
    ("No numbers here.", "No numbers here."),
    ("The 5G network", "The 5G network"),
    ("COVID-19", "COVID-nineteen"),  # a hyphen after a word is no minus sign
]


@pytest.mark.parametrize("written, spoken", NORMALIZATION, ids=[w for w, _ in NORMALIZATION])
def test_written_forms_are_read_as_words(written, spoken):
    assert normalize(written).spoken == spoken


@pytest.mark.parametrize("written, spoken", NORMALIZATION, ids=[w for w, _ in NORMALIZATION])
def test_each_reading_holds_inside_a_sentence_maps_back_and_is_left_alone_once_spoken(written, spoken):
    """What a client relies on for every entry: the reading does not depend on the words around it,
    each replaced piece points back at exactly its written form (word timings name "$5", not "five
    dollars"), and text that is already words passes through unchanged."""
    assert normalize(f"Then {written} and so.").spoken == f"Then {spoken} and so."
    normalized = normalize(written)
    rebuilt, position = [], 0
    for span in sorted(normalized.spans, key=lambda s: s.start):
        rebuilt += [normalized.spoken[position:span.start], written[span.source_start:span.source_end]]
        position = span.end
    assert "".join(rebuilt) + normalized.spoken[position:] == written
    assert normalize(spoken).spoken == spoken


def test_every_spoken_piece_points_back_to_its_written_form():
    text = "I paid $5 on 3/5/2024 at 9:15, Dr. Lee said."
    normalized = normalize(text)
    for written in ("$5", "3/5/2024", "9:15", "Dr."):
        start = text.index(written)
        span = next(s for s in normalized.spans if s.source_start == start)
        assert normalized.source_of(span.start, span.end) == (start, start + len(written))
    # Untouched words map to themselves, after the shifts the replacements made.
    said = normalized.spoken.index("said")
    assert text[slice(*normalized.source_of(said, said + 4))] == "said"


SEGMENTATION = [
    ("Mr. Smith paid $5.50 for e.g. apples. Then he left.",
     ["Mr. Smith paid $5.50 for e.g. apples.", "Then he left."]),
    ("Pi is 3.14, roughly. Is it?", ["Pi is 3.14, roughly.", "Is it?"]),
    ("J. R. R. Tolkien wrote it. We read it.", ["J. R. R. Tolkien wrote it.", "We read it."]),
    ('"Yes!" she said. Then silence...  And then? Nothing.',
     ['"Yes!" she said.', "Then silence...", "And then?", "Nothing."]),
    ("No final stop", ["No final stop"]),
]


@pytest.mark.parametrize("text, expected", SEGMENTATION)
def test_sentences_split_where_a_reader_stops(text, expected):
    found = segments(text)
    assert [s.text for s in found] == expected
    for segment in found:  # spans point into the text
        assert text[segment.start:segment.end] == segment.text


def test_long_sentences_split_at_clauses_then_spaces_and_every_character_is_kept():
    clause = "the river ran past the old mill and the children watched it go"
    text = "; ".join([clause] * 12) + "."
    found = segments(text, max_chars=150)
    assert len(found) > 4 and all(len(s.text) <= 150 for s in found)
    assert all(s.text.endswith(";") for s in found[:-1]) and found[-1].text.endswith(".")
    assert " ".join(s.text for s in found) == text
    words = " ".join(["word"] * 200)
    cut = segments(words, max_chars=100)
    assert all(len(s.text) <= 100 for s in cut) and " ".join(s.text for s in cut) == words
    assert [s.pause for s in cut[:-1]] == [PAUSES["cut"]] * (len(cut) - 1)


def test_pauses_follow_the_punctuation():
    found = segments("First; second, third... Fourth! Fifth", max_chars=8)
    assert [s.pause for s in found][-1] == PAUSES["sentence"]
    assert segments("Then silence...  And then?")[0].pause == PAUSES["ellipsis"]
    assert segments("Done. Next.")[0].pause == PAUSES["sentence"]
    assert segments("") == [] and segments("   ") == []


@pytest.mark.slow
def test_the_server_normalizes_before_the_layout_unless_the_request_says_not_to(idle_server):
    """Through a real server with a text-token model: "$5.50 on 3/5" reaches the model as its spoken
    words (the same prompt, so the same speech for the same seed), and as written when the request
    turns normalization off."""
    import numpy as np

    from audio_pipeline_client import TTSClient

    engine = idle_server.engine
    with TTSClient(idle_server.target, timeout=120) as client:
        def speak(text, **options):
            return client.synthesize(text, max_tokens=28, seed=1, **options)

        written = "It costs $5.50 on 3/5/2024."
        spoken = normalize(written).spoken
        assert spoken == "It costs five dollars and fifty cents on March fifth, twenty twenty-four."
        normalized, as_spoken, as_written = speak(written), speak(spoken), speak(written, normalize_text=False)
    assert normalized.usage.prompt_tokens == as_spoken.usage.prompt_tokens
    np.testing.assert_array_equal(normalized.samples, as_spoken.samples)
    # Normalization off: the model's prompt is the layout's prompt of the written characters.
    raw_prompt = engine.layout.build_prompt(engine.tokenizer, written, engine.manifest.default_voice, None)
    assert as_written.usage.prompt_tokens == len(raw_prompt) != as_spoken.usage.prompt_tokens
    assert not np.array_equal(as_written.samples, as_spoken.samples)
