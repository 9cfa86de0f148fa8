"""Live text for a model that reads a text stream (service/live_text.py): every whole word goes out
as soon as the space after it comes, except the last ones whose reading goes with the next word
(text/normalize.py's ``reads_with_next``), which wait for it; never more than two. Checked on the
pieces handed to the synthesis; the spoken result is in tests/test_kyutai_tts_engine.py."""

from __future__ import annotations

import asyncio

import pytest

from audio_pipeline.service.live_text import LiveText
from audio_pipeline.text.normalize import normalize, reads_with_next


class Pieces:
    """The side of a text stream's synthesis LiveText feeds: what it was given, in order."""

    text_stream = True

    def __init__(self):
        self.sent: list[str] = []
        self.closed = False

    def add_segment(self, segment):
        self.sent.append(segment.text)

    def close(self):
        self.closed = True


@pytest.mark.parametrize("word, held", [
    ("1847", True), ("$5", True), ("7:30", True), ("in", True), ("since", True), ("May", True), ("Jan.", True),
    ("$", True), ("in,", False), ("may", False), ("hello", False), ("Dr.", False), ("years", False)])
def test_the_words_that_wait_for_the_next(word, held):
    assert reads_with_next(word + " ") is held


def feed(words: list[str]) -> list[list[str]]:
    """What each word (sent with its space) lets out, then what the end lets out."""
    synthesis = Pieces()
    live = LiveText(synthesis, max_chars=10_000, max_segment_chars=200)

    async def run():
        steps = []
        for word in words:
            before = len(synthesis.sent)
            await live.add(word + " ")
            steps.append(synthesis.sent[before:])
        before = len(synthesis.sent)
        await live.end()
        return steps + [synthesis.sent[before:]]

    steps = asyncio.run(run())
    assert synthesis.closed and "".join(synthesis.sent).split() == words  # every word, once, in order
    return steps


def test_a_years_cue_and_the_year_go_out_together_and_read_as_a_year():
    steps = feed("They came in 1847 with friends.".split())
    assert steps == [["They "], ["came "], [], [], ["in 1847 with "], ["friends. "], []]
    assert normalize(steps[4][0]).spoken == "in eighteen forty-seven with "


def test_a_month_and_its_day_and_a_number_and_its_unit_go_out_together():
    steps = feed("On May 5 it ran 120 m today.".split())
    assert steps == [["On "], [], [], ["May 5 it "], ["ran "], [], ["120 m "], ["today. "], []]
    assert normalize(steps[3][0]).spoken == "May fifth it "
    assert normalize(steps[6][0]).spoken == "one hundred twenty meters "


def test_at_most_two_words_wait_so_a_list_of_numbers_goes_out_as_it_comes():
    steps = feed("1, 2, 3, 4, 5, done".split())
    assert steps == [[], [], ["1, "], ["2, "], ["3, "], ["4, 5, done "], []]
