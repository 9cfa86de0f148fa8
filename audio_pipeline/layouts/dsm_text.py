"""The text side of delayed streams modeling (Kyutai TTS): a script becomes a queue of words, and a
small state machine decides, from each text id the model samples, what the model reads next.

The model samples a text id at every frame. Only two of its values matter: "new word" (0), asking
for the next word, and anything else, read as "pad" (3). The machine feeds a word's tokens one per
frame after the model asked for it, forces padding while they are fed and for the word's padding
after, forces a new word after ``max_padding`` frames of padding, and notes the frame where the model
asked past the last word: the end of the speech. With a lookahead stream the word ``ahead`` words
on is fed beside the current one, multiplexed in one id: ``(second + 1) * (text_card + 1) + first``.

A word queue may be open (words still arriving: streamed text): asking past its last word then
waits, padding, until a word arrives or the queue is closed.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

NEW_WORD = 0
MAIN_SPEAKER = 1
OTHER_SPEAKER = 2
PAD = 3
#: The id the model embeds as zero (the lookahead stream when it has nothing to feed, a codebook
#: not generated yet, guidance's null text).
ZERO = -1

#: A pause (``<break time="0.5s"/>``) or the spaces between words.
_EVENT = re.compile(r'<break\s+time="([0-9]+(?:.[0-9]*)?)s"\s*/?>|\s+')


@dataclass(frozen=True)
class Word:
    """One entry of the queue: a word's text tokens (empty for a pause), its text, the frames of
    padding forced once it is taken (a pause's length; after a word, its tokens' time), and where
    it is in the text it was read from (offsets; None: unknown)."""

    tokens: tuple[int, ...]
    text: str
    padding: int = 0
    at: tuple[int, int] | None = None


def script_words(encode: Callable[[str], list[int]], script: Sequence[str], *, frame_rate: float,
                 multi_speaker: bool = True, padding_between: int = 0, first_speaker: int = 0,
                 last_speaker: int | None = None) -> list[Word]:
    """The words of a script: one string per speaker turn, the speakers alternating from
    ``first_speaker`` (0 the main speaker, 1 the other; the reference's form is a main speaker's
    turn first, an empty one to start with the other). A turn's first word carries its speaker's
    token where the speaker changes from ``last_speaker`` (the speaker of the words before the
    script: a streamed text's earlier pieces; None: none), on models that know several speakers;
    ``padding_between`` forces that many frames after each word beyond its tokens' own. Colons
    become spaces, parentheses go, typographic apostrophes become plain ones;
    ``<break time="Xs"/>`` is a pause of X seconds. Each word's ``at`` is where it is in its turn's
    string."""
    speakers = (MAIN_SPEAKER, OTHER_SPEAKER)
    words: list[Word] = []

    def add(turn: int, text: str, first: bool, at: tuple[int, int]) -> None:
        nonlocal last_speaker
        tokens = list(encode(text))
        speaker = (first_speaker + turn) % len(speakers)
        if first and multi_speaker and last_speaker != speaker:
            last_speaker = speaker
            tokens.insert(0, speakers[speaker])
        padding = max(0, padding_between + len(tokens) - 1) if padding_between > 0 else 0
        words.append(Word(tuple(tokens), text, padding, at))

    for turn, raw in enumerate(script):
        first = True
        kept = [i for i, c in enumerate(raw) if c not in "()"]  # where each kept character was
        line = "".join(raw[i] for i in kept).replace("\u2019", "'").replace(":", " ")
        cursor = 0
        while cursor < len(line):
            match = _EVENT.search(line, cursor)
            end = match.start() if match is not None else len(line)
            if end > cursor:
                add(turn, line[cursor:end], first, (kept[cursor], kept[end - 1] + 1))
                first = False
            if match is None:
                break
            if match.group(1):
                words.append(Word((), "", int(round(float(match.group(1)) * frame_rate))))
            cursor = match.end()
    return words


@dataclass
class TextState:
    """One request's reading state (see the module docstring)."""

    words: deque[Word]
    remaining_padding: int
    forced_padding: int
    #: Whether more words may still arrive (streamed text not closed yet).
    open: bool = False
    queued: deque[int] = field(default_factory=deque)
    lookahead_queued: deque[int] = field(default_factory=deque)
    #: The frame where the model asked past the last word of a closed queue (the speech's end).
    end_step: int | None = None
    #: Frames at which each entry (words and pauses) was taken.
    consumed_at: list[int] = field(default_factory=list)
    #: (word, frame) of every word taken: the word timestamps.
    transcript: list[tuple[str, int]] = field(default_factory=list)
    #: Words (a list) and the close (None) sent while the request runs, taken in order by the
    #: thread that steps the machine (appends and pops of a deque are atomic: no lock).
    inbox: deque = field(default_factory=deque)

    def add_words(self, words: Sequence[Word]) -> None:
        """More words, from any thread (taken at the machine's next step)."""
        self.inbox.append(list(words))

    def close(self) -> None:
        """No more words will come, from any thread (taken at the machine's next step)."""
        self.inbox.append(None)

    def take_inbox(self) -> None:
        while self.inbox:
            item = self.inbox.popleft()
            if item is None:
                self.open = False
            else:
                self.words.extend(item)

    def tokens_ahead(self, ahead: int) -> tuple[int, ...]:
        for word in self.words:
            if word.tokens:
                ahead -= 1
                if ahead == 0:
                    return word.tokens
        return ()


@dataclass(frozen=True)
class TextMachine:
    """The rules: ``text_card`` (the text vocabulary, for multiplexing), the lookahead distance
    (0: one stream), the most frames of padding in a row, and the padding the speech opens with."""

    text_card: int
    second_stream_ahead: int = 0
    max_padding: int = 8
    initial_padding: int = 2

    def new_state(self, words: Sequence[Word], *, open: bool = False) -> TextState:
        return TextState(deque(words), self.initial_padding, self.initial_padding, open=open)

    def step(self, frame: int, state: TextState, sampled: int) -> int:
        """The text id fed at the next frame, given the id the model sampled at ``frame``."""
        state.take_inbox()
        token = NEW_WORD if sampled == NEW_WORD else PAD
        if state.queued or state.forced_padding > 0:
            token = PAD
        elif state.remaining_padding <= 0:
            token = NEW_WORD
        if token == NEW_WORD:
            if state.words:
                word = state.words.popleft()
                state.consumed_at.append(frame)
                if word.tokens:
                    state.transcript.append((word.text, frame))
                    state.queued.extend(word.tokens)
                    if self.second_stream_ahead:
                        state.lookahead_queued.extend(state.tokens_ahead(self.second_stream_ahead))
                    state.remaining_padding = self.max_padding
                else:  # a pause: read as padding
                    token = PAD
                state.forced_padding = word.padding
            elif state.open:  # the next word has not arrived: wait
                token = PAD
            else:
                token = PAD
                if self.second_stream_ahead and state.end_step is None:
                    token = NEW_WORD
                if state.end_step is None:
                    state.end_step = frame
        if token == PAD:
            if state.remaining_padding > 0:
                state.remaining_padding -= 1
            if state.forced_padding > 0:
                state.forced_padding -= 1
            out = state.queued.popleft() if state.queued else PAD
        else:
            out = NEW_WORD
        if not self.second_stream_ahead:
            return out
        second = ZERO
        if out == NEW_WORD:  # the new-word mark goes on the lookahead stream
            second = NEW_WORD
            out = state.queued.popleft() if state.queued else PAD
        elif state.lookahead_queued:
            second = state.lookahead_queued.popleft()
        return (second + 1) * (self.text_card + 1) + out


@dataclass
class TextRule:
    """A request's reading of its words as the engine runs it: the model runner hands it each text
    id the backbone samples, in order, and feeds back what it returns (the request carries it
    across the engine core's process boundary, so it is plain data)."""

    machine: TextMachine
    state: TextState
    #: Frames sampled so far (the next frame's index).
    steps: int = 0

    def step(self, sampled: int) -> int:
        """The id fed back for the frame just sampled (``sampled``: the backbone's text id)."""
        fed = self.machine.step(self.steps, self.state, sampled)
        self.steps += 1
        return fed

    @property
    def end_step(self) -> int | None:
        """The frame where the model asked past the last word (None: not yet)."""
        return self.state.end_step

    @property
    def frames_since_word(self) -> int:
        """Frames sampled since it last took a word (or a pause), or since its start."""
        taken = self.state.consumed_at
        return self.steps - (taken[-1] if taken else 0)

    @property
    def waiting(self) -> bool:
        """Whether it has read every word it has and more may come: the model only pads until
        they do (any thread may ask; a word on its way makes it False)."""
        state = self.state
        return state.open and not state.words and not state.queued and not state.inbox
