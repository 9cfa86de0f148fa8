"""Speech that starts at once and ends when it ends: the built-in voices speak 20 ms of their
opening pause before a loud first sound, none before a soft one (the rest is handed to the model as
prompt frames of silence), and 20 ms of their closing pause (the alignment ends there), and an utterance's first and last stop or weak fricative
are cut to what a listener hears of them."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest

from audio_pipeline.layouts.phoneme_lpc import (CONTEXT, ENVELOPE, LEAD_PAUSE_FRAMES, PHONEME, PROSODY,
                                              QUIET_ONSETS, TAIL_PAUSE_FRAMES, alignment_tokens, prompt_schedule,
                                              slot_token, split_prompt)

TEXTS = ["Please call Stella.", "It is late.", "Thanks for calling!", "Your order has shipped.", "Next month."]


def shipped_layout(name: str):
    from audio_pipeline.builtin import shipped_model_dir
    from audio_pipeline.layouts.manifest import ModelManifest
    from audio_pipeline.checkpoints.plain_config import VocabularyTokenizer

    directory = shipped_model_dir(name)
    tokenizer = VocabularyTokenizer(directory)
    return ModelManifest.read(directory).make_layout(directory, tokenizer), tokenizer


def lead_frames(layout, text: str) -> int:
    """The opening pause's frames spoken: LEAD_PAUSE_FRAMES, none before a sound that starts softly."""
    return 0 if layout.front_end.align(text, 50).phonemes[1][0] in QUIET_ONSETS else LEAD_PAUSE_FRAMES


def test_a_pause_frame_goes_before_a_loud_first_sound_only():
    layout, _ = shipped_layout("slt-en-v5")
    assert [lead_frames(layout, text) for text in TEXTS] == [0, LEAD_PAUSE_FRAMES, 0, LEAD_PAUSE_FRAMES,
                                                             LEAD_PAUSE_FRAMES]


@pytest.mark.parametrize("name", ["slt-en-v5", "slt-en"])
def test_the_prompt_holds_the_opening_pause_but_its_last_frame_and_the_alignment_ends_in_the_closing_one(name):
    layout, tokenizer = shipped_layout(name)
    assert layout.silence_frame is not None
    envelope, prosody = layout.silence_frame
    for text in TEXTS:
        prompt = layout.build_prompt(tokenizer, text, None)
        head, given_ids = split_prompt(prompt)
        pairs = prompt_schedule(prompt)
        assert pairs == prompt_schedule(head)  # the whole pauses stay in the prompt, as the model learned
        opening, closing = pairs[0][1], pairs[-1][1]
        kept = lead_frames(layout, text)
        assert opening > kept
        given = opening - kept
        whole = alignment_tokens(pairs)
        alignment = layout.alignment(prompt)
        assert alignment.frames == whole[given:len(whole) - max(0, closing - TAIL_PAUSE_FRAMES)]
        assert alignment.edge_pause_frames == (kept, min(closing, TAIL_PAUSE_FRAMES))
        if layout.tokens_per_frame == 1:  # a frame voice: one position per frame, its frame in prompt_frames
            assert given_ids == [slot_token(ENVELOPE, envelope)] * given
            rows = layout.prompt_frames(prompt)[len(head) - 1:].tolist()
            for k, row in enumerate(rows):  # start of speech, then the frames handed over
                phoneme, context = whole[k]  # each position carries the next frame's phoneme and context
                assert row[:2] == [phoneme - slot_token(PHONEME, 0), context - slot_token(CONTEXT, 0)]
                assert row[2:] == ([-1, -1] if k == 0 else [envelope, prosody])
        else:  # four positions a frame: the frames' own tokens
            assert given_ids == [token for phoneme, context in whole[:given] for token in
                                 (phoneme, context, slot_token(ENVELOPE, envelope), slot_token(PROSODY, prosody))]
        words = layout.word_frames(text)
        assert words[0].first_frame == kept
        assert words[-1].end_frame == len(alignment.frames) - min(closing, TAIL_PAUSE_FRAMES)


def test_without_a_silence_frame_the_opening_pause_is_spoken_whole():
    layout, tokenizer = shipped_layout("slt-en-v5")
    plain = dataclasses.replace(layout, silence_frame=None)
    prompt = plain.build_prompt(tokenizer, "Please call Stella.", None)
    head, given = split_prompt(prompt)
    assert given == [] and head == prompt
    pairs = prompt_schedule(prompt)
    alignment = plain.alignment(prompt)
    assert alignment.frames[:pairs[0][1]] == alignment_tokens(pairs)[:pairs[0][1]]
    assert alignment.edge_pause_frames == (pairs[0][1], TAIL_PAUSE_FRAMES)
    # A prompt that hands over another number of frames than the layout would is not its prompt.
    with pytest.raises(ValueError, match="leading pause frames"):
        layout.alignment(prompt + [slot_token(ENVELOPE, 1)])


def test_an_utterances_first_and_last_stop_or_weak_fricative_is_cut_to_what_is_heard_of_it():
    from audio_pipeline.text.lexicon import CODA_FRAMES, ONSET_FRAMES

    layout, _ = shipped_layout("slt-en-v5")
    front_end = layout.front_end
    starts = {"Please call Stella.": "p", "Thanks again.": "th", "Call me.": "k", "Hello.": "hh"}
    for text, phone in starts.items():
        phonemes = front_end.align(text, 50).phonemes
        assert phonemes[1][0] == phone and phonemes[1][1] <= ONSET_FRAMES[phone]
        # Only the first: the same word later in a sentence keeps its duration.
        later = front_end.align(f"I said {text.lower()}", 50).phonemes
        assert max(f for name, f in later[1:] if name == phone) >= phonemes[1][1]
    vowel = front_end.align("It is late.", 50).phonemes
    assert vowel[1][0].startswith("ih")
    # The last phone before the closing pause likewise.
    for text, phone in {"It is late.": "t", "Next month.": "th", "Half a cup of milk.": "k"}.items():
        phonemes = front_end.align(text, 50).phonemes
        assert phonemes[-2][0] == phone and phonemes[-2][1] <= CODA_FRAMES[phone]


def test_a_silence_frame_that_is_not_two_codes_is_refused(tmp_path):
    from audio_pipeline.builtin import shipped_model_dir
    from audio_pipeline.layouts.manifest import MANIFEST_NAME, ModelManifest

    voice = tmp_path / "voice"
    shutil.copytree(shipped_model_dir("slt-en-frame"), voice)
    shutil.copytree(shipped_model_dir("slt-en-frame").parent / "front-end-en", tmp_path / "front-end-en")
    manifest = json.loads((voice / MANIFEST_NAME).read_text())
    for bad in ([943], [943, 4096], "silent"):
        manifest["layout_options"] = {"silence_frame": bad}
        (voice / MANIFEST_NAME).write_text(json.dumps(manifest))
        with pytest.raises(ValueError, match="layout_options.silence_frame must be"):
            ModelManifest.read(voice).make_layout(voice)


@pytest.mark.slow
def test_the_default_voice_is_heard_at_once_and_ends_when_its_words_do():
    """Measured as listeners hear it (two 20 ms frames at -45 dBFS): at most 80 ms of silence before
    the speech (20 ms of pause, then the first phoneme's quiet start), at most 100 ms after it."""
    from audio_pipeline.audio.audibility import audible_end, audible_onset
    from audio_pipeline.config import AudioGenerationConfig
    from audio_pipeline.service.engine import TTSEngine

    engine = TTSEngine(AudioGenerationConfig.load(env={}, model={"device": "cpu"}))
    engine.start()
    try:
        rate = engine.sample_rate
        for text in TEXTS + ["What time does the pharmacy close?", "The flight departs at seven."]:
            for seed in (1, 2):
                context = engine.create_context(text, seed=seed)
                result = engine.synthesize(text, seed=seed)
                samples = np.asarray(result.samples).reshape(-1)
                assert samples.shape[0] == len(context.alignment.frames) * 320
                layout = engine.layout
                assert context.words[0].start_sample == lead_frames(layout, text) * 320
                assert audible_onset(samples, rate) <= 0.08 * rate, text
                assert samples.shape[0] - audible_end(samples, rate) <= 0.1 * rate, text
                # No click: the first 2 ms are quiet, whichever sound opens the speech.
                assert np.abs(samples[:32]).max() <= 0.01 * np.abs(samples).max(), text
    finally:
        engine.stop()
