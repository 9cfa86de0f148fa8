"""Word timings over a real server: every written word of the input once, in order, with its place
in the text; on the built-in voice within one frame of its alignment and where the audio has its
words; segment-level timings for a model without an alignment; the CLI's JSON and WebVTT files."""

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from audio_pipeline_client import FLUSH, TTSClient
from helpers import scratch_voices_dir

TEXT = ("Dr. Smith paid $5.50 at 9:15 a.m., didn't he? Yes! The well-known café opened in 1999 "
        "and serves 12% more guests, call 555-1234.")
RATE = 16000  # the built-in voice's sample rate
FRAME = 320  # its samples per frame (50 Hz)


def written_words(text):
    """Spans of the written words (letters and digits) of ``text``."""
    return [m.span() for m in re.finditer(r"[^\W_]+", text)]


def assert_every_word_once_in_order(text, timings):
    """Each timing names its piece of the text, the pieces do not overlap and come in order, and
    every written word lies in exactly one of them."""
    for timing in timings:
        assert text[timing.text_start:timing.text_end] == timing.text, timing
    spans = [(t.text_start, t.text_end) for t in timings]
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans
    starts = [t.start_sample for t in timings]
    assert starts == sorted(starts)
    for start, end in written_words(text):
        holders = [t for t in timings if t.text_start <= start and end <= t.text_end]
        assert len(holders) == 1, (text[start:end], holders)


@pytest.fixture(scope="module")
def builtin_server():
    """A real server running the built-in voice whose alignment comes from eSpeak NG (lpc-en)."""

    from audio_pipeline.config import AudioGenerationConfig
    from audio_pipeline.testing.background import BackgroundServer

    config = AudioGenerationConfig.load(env={}, audio_flags=[], model={"model_path": "builtin:lpc-en", "device": "cpu"},
                                        voices_dir=scratch_voices_dir())
    server = BackgroundServer(config).start()
    yield server
    server.stop()


def expected_words(spoken):
    """The built-in voice's alignment of one segment's spoken text, from a fresh eSpeak run: a word
    starts where its first phoneme (after its word event) starts and ends where its last one ends,
    pauses left out; in samples of the voice's 16 kHz audio (None for a word without a phoneme)."""
    from audio_pipeline.text.espeak import espeak

    utterance = espeak().synthesize(spoken, keep_audio=False)
    scale = RATE / utterance.sample_rate
    events = [sample for _, _, sample in utterance.words] + [utterance.length + 1]
    out = []
    for begin, following in zip(events, events[1:]):
        mine = [i for i, (name, start) in enumerate(utterance.phonemes)
                if begin <= start < following and not name.startswith("_")]
        ends = [start for _, start in utterance.phonemes[1:]] + [utterance.length]
        out.append((utterance.phonemes[mine[0]][1] * scale, ends[mine[-1]] * scale) if mine else None)
    return out


@pytest.mark.slow
def test_the_built_in_voice_times_every_word_within_a_frame_of_its_alignment(builtin_server):
    from audio_pipeline.text.espeak import text_alignment
    from audio_pipeline.text.normalize import normalize
    from audio_pipeline.text.segment import segments

    with TTSClient(builtin_server.target, timeout=300) as client:
        result = client.synthesize(TEXT, temperature=0.0)
    words = result.words
    assert_every_word_once_in_order(TEXT, words)
    assert {w.precision for w in words} == {"word"} and result.sample_rate == RATE
    money = next(w for w in words if w.text == "$5.50")
    assert money.spoken == "five dollars and fifty cents"
    assert next(w for w in words if w.text == "didn't").spoken == "didn't"

    # Each segment sounds for exactly the frames of the alignment the voice ran (this server runs
    # in this process: text_alignment is its cache), then the pause its punctuation asks for.
    # Against a fresh eSpeak alignment of each segment at its place in the stream, every timing
    # starts and ends within a frame of a spoken word's, and every spoken word lies in a timing
    # ("$5.50" is one timing for five spoken words); timings start and end on phoneme boundaries.
    expected, boundaries, base = [], set(), 0
    for segment in segments(TEXT, 300):
        spoken = normalize(segment.text).spoken
        frames = np.cumsum([0] + [n for _, n in text_alignment(spoken, 50).phonemes])
        boundaries.update(base + frames * FRAME)
        spoken_words = expected_words(spoken)
        expected += [(base + start, base + end) for start, end in filter(None, spoken_words)]
        base += frames[-1] * FRAME + int(round(segment.pause * RATE))
    assert base - int(round(segment.pause * RATE)) == result.samples.size
    # The timings sit exactly on the forced alignment's boundaries. A fresh eSpeak run is an
    # independent check: its timings move by a few milliseconds from run to run (text_alignment's
    # cache keeps one), so it is allowed one frame plus that jitter (5 ms).
    slack = FRAME + RATE // 200
    for word in words:
        assert word.start_sample in boundaries and word.end_sample in boundaries, word
        assert min(abs(word.start_sample - start) for start, _ in expected) <= slack, word
        assert min(abs(word.end_sample - end) for _, end in expected) <= slack, word
    for start, end in expected:
        assert any(w.start_sample - slack <= start and end <= w.end_sample + slack for w in words), (start, end)

    # Where the timings say words are, the audio speaks; the long stretches between them are quiet.
    audio = result.samples.astype(np.float64)
    inside = np.zeros(audio.size, dtype=bool)
    for w in words:
        assert 0 <= w.start_sample < w.end_sample <= audio.size
        inside[w.start_sample:w.end_sample] = True
    assert np.sqrt(np.mean(audio[inside] ** 2)) > 10 * np.sqrt(np.mean(audio[~inside] ** 2) + 1e-12)


@pytest.mark.slow
def test_word_timings_follow_the_output_sample_rate(builtin_server):
    with TTSClient(builtin_server.target, timeout=300) as client:
        native = client.synthesize("Hello there, world.", temperature=0.0)
        resampled = client.synthesize("Hello there, world.", temperature=0.0, sample_rate=24000)
    assert [w.text for w in native.words] == [w.text for w in resampled.words] == ["Hello", "there", "world"]
    for a, b in zip(native.words, resampled.words):
        assert b.sample_rate == 24000 and abs(a.start_seconds - b.start_seconds) < 1e-3
        assert abs(a.end_seconds - b.end_seconds) < 1e-3


@pytest.mark.slow
def test_live_text_timings_point_into_all_the_pieces_joined(builtin_server):
    pieces = ["The first sen", "tence is here. ", "And the sec", "ond, ", FLUSH, "then $3 more."]
    joined = "".join(p for p in pieces if p is not FLUSH)
    with TTSClient(builtin_server.target, timeout=300) as client:
        chunks = list(client.stream_text(pieces, temperature=0.0))
    words = [w for c in chunks for w in c.words]
    assert_every_word_once_in_order(joined, words)
    assert next(w for w in words if w.text == "$3").spoken == "three dollars"
    # A word comes with the chunk its audio starts in.
    position = 0
    for chunk in chunks:
        for word in chunk.words:
            assert position <= word.start_sample < position + chunk.samples.size
        position += chunk.samples.size


@pytest.mark.slow
def test_a_model_without_alignment_gets_one_timing_per_segment(idle_server):
    """The tiny Orpheus-layout model: segment precision, each sentence once, ending where its audio does."""
    from audio_pipeline.text.segment import segments

    text = "First one here. Second one, there! Last."
    with TTSClient(idle_server.target, timeout=300) as client:
        chunks = list(client.stream(text, temperature=0.0))
    words = [w for c in chunks for w in c.words]
    assert [w.text for w in words] == [s.text for s in segments(text, 300)]
    assert {w.precision for w in words} == {"segment"}
    assert_every_word_once_in_order(text, words)
    total = sum(c.samples.size for c in chunks)
    assert words[0].start_sample == 0 and words[-1].end_sample == total
    # A segment's timing arrives once its audio is out: never before the chunk that ends it.
    position = 0
    for chunk in chunks:
        position += chunk.samples.size
        assert all(w.end_sample <= position for w in chunk.words)


@pytest.mark.slow
def test_the_cli_writes_timings_as_json_and_webvtt(builtin_server, tmp_path):
    for name in ("out.json", "out.vtt"):
        done = subprocess.run([sys.executable, "-m", "audio_pipeline_client.cli", "--server", builtin_server.target,
                               "--text", "Hello, it costs $5.", "--output", str(tmp_path / "out.wav"),
                               "--timings", str(tmp_path / name), "--quiet"],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    document = json.loads((tmp_path / "out.json").read_text())
    assert document["sample_rate"] == RATE
    assert [w["text"] for w in document["words"]] == ["Hello", "it", "costs", "$5"]
    assert document["words"][-1]["spoken"] == "five dollars" and document["words"][-1]["precision"] == "word"
    vtt = (tmp_path / "out.vtt").read_text().splitlines()
    assert vtt[0] == "WEBVTT"
    cues = [(vtt[i + 1], vtt[i + 2]) for i in range(len(vtt)) if vtt[i].isdigit()]
    assert [text for _, text in cues] == ["Hello", "it", "costs", "$5"]
    first, last = cues[0][0], cues[-1][0]
    assert first.startswith("00:00:00.000 --> ") and re.fullmatch(r"\d\d:\d\d:\d\d\.\d{3} --> \d\d:\d\d:\d\d\.\d{3}", last)
    assert abs(float(last.split(" --> ")[1][6:]) - document["words"][-1]["end"]) < 0.002


def test_spoken_words_of_one_written_piece_become_one_timing():
    from audio_pipeline.text.espeak import WordFrames
    from audio_pipeline.text.normalize import normalize
    from audio_pipeline.text.timings import word_timings

    text = normalize("Pay $5 now")
    assert text.spoken == "Pay five dollars now"
    spoken = [(0, 3), (4, 8), (9, 16), (17, 20)]
    frames = [WordFrames(start, end, 2 * i, 2 * i + 1) for i, (start, end) in enumerate(spoken)]
    timings = word_timings(text, frames, samples_per_frame=10)
    assert [(t.text, t.spoken, t.start_sample, t.end_sample) for t in timings] == [
        ("Pay", "Pay", 0, 10), ("$5", "five dollars", 20, 50), ("now", "now", 60, 70)]


def test_webvtt_times_run_past_an_hour():
    from audio_pipeline_client import WordTiming, timings_webvtt

    word = WordTiming("late", 0, 4, 3_600_500 * 16, 3_601_250 * 16, "late", "word", 16000)
    assert "01:00:00.500 --> 01:00:01.250\nlate" in timings_webvtt([word])


def test_the_front_end_times_every_word_of_a_long_text_once():
    """eSpeak speaks unstressed words with the word before ("on the" in "on the coast") and gives
    them no word event of their own; they are timed with that word, and no written word is lost."""
    from audio_pipeline.bench.long_text import DEFAULT_FILE
    from audio_pipeline.text.espeak import text_alignment
    from audio_pipeline.text.normalize import normalize
    from audio_pipeline.text.segment import segments
    from audio_pipeline.text.timings import word_timings

    text = DEFAULT_FILE.read_text()
    timings, base = [], 0
    for segment in segments(text, 300):
        spoken = normalize(segment.text)
        aligned = text_alignment(spoken.spoken, 50)
        total = sum(n for _, n in aligned.phonemes)
        for timing in word_timings(spoken, aligned.words, 1):  # in frames
            assert 0 <= timing.start_sample <= timing.end_sample <= total
            timings.append(timing.shifted(segment.start, base))
        base += total
    assert_every_word_once_in_order(text, timings)
    assert len(timings) > 0.9 * len(written_words(text)) - 200  # most words have their own timing
    grouped = [t.text for t in timings if " " in t.text and t.text == t.spoken]
    assert "on the" in " | ".join(grouped)


@pytest.mark.slow
def test_speed_changes_the_built_in_voices_durations_and_its_timings(builtin_server):
    with TTSClient(builtin_server.target, timeout=300) as client:
        normal = client.synthesize("Hello there, world.", temperature=0.0)
        fast = client.synthesize("Hello there, world.", temperature=0.0, speed=2.0)
        slow = client.synthesize("Hello there, world.", temperature=0.0, speed=0.5)
    assert 0.45 < fast.samples.size / normal.samples.size < 0.62  # phonemes of 1 frame stay 1 frame
    assert 1.9 < slow.samples.size / normal.samples.size < 2.1
    for result in (fast, slow):
        assert [w.text for w in result.words] == ["Hello", "there", "world"]
        assert result.words[-1].end_sample <= result.samples.size
    ratio = slow.words[-1].end_sample / normal.words[-1].end_sample
    assert 1.9 < ratio < 2.1


@pytest.mark.slow
def test_the_default_voice_times_every_word_on_its_front_ends_alignment():
    """slt-en (the lexicon front end): every written word once, in order, on the unit boundaries
    the engine forces."""
    from audio_pipeline.config import AudioGenerationConfig
    from audio_pipeline.service.engine import TTSEngine
    from audio_pipeline.layouts.phoneme_lpc import split_prompt
    from audio_pipeline.text.normalize import normalize

    engine = TTSEngine(AudioGenerationConfig.load(env={}, model={"model_path": "builtin:slt-en", "device": "cpu"}))
    text = "Dr. Smith paid $5.50 at 9:15, didn't he?"
    context = engine.create_context(text)
    assert_every_word_once_in_order(text, context.words)
    assert next(w for w in context.words if w.text == "$5.50").spoken == "five dollars and fifty cents"
    frames = np.cumsum([0] + [n for _, n in engine.layout.front_end.align(normalize(text).spoken, 50).phonemes])
    # The leading pause's frames the prompt holds are not spoken: the speech starts that far in.
    handed_over = len(split_prompt(context.prompt_ids)[1]) // engine.layout.tokens_per_frame
    boundaries = set((frames - handed_over) * FRAME)
    assert all(w.start_sample in boundaries and w.end_sample in boundaries for w in context.words)
