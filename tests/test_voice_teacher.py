"""The voice recipe's teacher step (Festival): its script quoting and its output parsing. Festival
itself is a recipe-time tool (Debian), absent from a fresh machine; where it is installed, one real
utterance is spoken too."""

import shutil
from pathlib import Path

import pytest

from recipes.builtin_voice.teacher import MARK, _scheme_string, parse_output, synthesize


def test_texts_reach_festival_as_exact_scheme_strings():
    assert _scheme_string('He said "hi" \\ left.') == '"He said \\"hi\\" \\\\ left."'


def test_marked_lines_become_utterances_and_festivals_own_output_is_ignored(tmp_path):
    out = "\n".join(["SIOD ERROR: nothing", f"{MARK}U 3", f"{MARK}S pau 0.175 0 0", f"{MARK}S k 0.26 1 Carla",
                     "some festival chatter", f"{MARK}W Carla 0.175 0.65", f"{MARK}U 4", f"{MARK}S pau 0.2"])
    first, second = parse_output(out, {3: "Carla.", 4: "Hm."}, tmp_path)
    assert (first.index, first.text, first.wav) == (3, "Carla.", tmp_path / "00003.wav")
    assert first.segments == [("pau", 0.175, 0, ""), ("k", 0.26, 1, "Carla")]
    assert first.words == [("Carla", 0.175, 0.65)]
    assert second.segments == [("pau", 0.2, 0, "")] and second.words == []


@pytest.mark.skipif(shutil.which("festival") is None, reason="Festival is a recipe-time tool, not installed here")
def test_festival_speaks_with_segment_and_word_timings(tmp_path):
    import soundfile as sf

    (utterance,) = synthesize([(0, 'The "9:15" train.')], tmp_path)
    audio, rate = sf.read(Path(utterance.wav))
    assert rate > 16000 and len(audio) / rate == pytest.approx(utterance.segments[-1][1], abs=0.05)
    ends = [end for _, end, _, _ in utterance.segments]
    assert ends == sorted(ends) and utterance.segments[0][0] == "pau"
    assert [w for w, _, _ in utterance.words] == ["The", "nine", "fifteen", "train"]
    # Each phone knows its word and its syllable's stress ("train" is one stressed syllable).
    assert [(name, stress) for name, _, stress, word in utterance.segments if word == "train"] == [
        ("t", 1), ("r", 1), ("ey", 1), ("n", 1)]
