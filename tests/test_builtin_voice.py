"""The built-in voices (builtin:slt-en-v5, the default model, builtin:slt-en-v4 and
builtin:slt-en-frame: the frame voices, the first two with a folded prompt; builtin:slt-en, their
phoneme-lpc twin; builtin:lpc-en, the first generation): the phoneme-lpc layout, front ends, shipped
files, the engine's alignment enforcement and budget, the gRPC service on the default model, and
the regression guard: held-out sentences spoken through the engine are identified by pocketsphinx."""

from __future__ import annotations

import numpy as np
import pytest

from audio_pipeline.errors import InvalidArgument
from audio_pipeline.layouts import phoneme_lpc as layout_module
from audio_pipeline.layouts.phoneme_lpc import (CONTEXT, DURATION_BASE, END_OF_SPEECH, LEFT_LEVELS, NO_NEXT,
                                              PHONEME, PHONEME_BASE, PhonemeLPCLayout, frame_tokens, prompt_ids,
                                              prompt_schedule, slot_token)
from helpers import run_texts, speech

#: Held-out sentences spoken (from templates the training set never used); each must be told
#: apart from all 40 held-out sentences of the recipe's evaluation.
SPOKEN = 6
MIN_IDENTIFIED = 5
SAMPLES_PER_FRAME = 320


def test_prompt_and_frames_follow_the_alignment_rules():
    phonemes = [(PHONEME_BASE + 3, 2), (PHONEME_BASE + 7, 1), (PHONEME_BASE + 0, 5)]
    prompt = prompt_ids(phonemes)
    assert prompt[1:3] == [PHONEME_BASE + 3, DURATION_BASE + 1] and prompt_schedule(prompt) == phonemes
    codes = [(e, 100 + e) for e in range(8)]
    stream = frame_tokens(phonemes, codes)
    layout = PhonemeLPCLayout()
    phoneme = [t - slot_token(PHONEME, 0) for t in stream[0:-1:4]]
    context = [divmod(t - slot_token(CONTEXT, 0), LEFT_LEVELS) for t in stream[1:-1:4]]
    assert phoneme == [3, 3, 7, 0, 0, 0, 0, 0] and stream[-1] == END_OF_SPEECH
    assert context == [(7, 1), (7, 0), (0, 0), (NO_NEXT, 3), (NO_NEXT, 3), (NO_NEXT, 2), (NO_NEXT, 1), (NO_NEXT, 0)]
    # The rules name every alignment token of the stream and its end, and leave the acoustics to the model.
    alignment = layout.alignment(prompt)
    assert alignment.tokens == len(stream) - 1
    for position, token in enumerate(stream):
        assert alignment.forced(position) == (None if position % 4 >= 2 else token)
        assert layout.forced_token(prompt, stream[:position]) == alignment.forced(position)
    assert layout.tokens_to_codes(stream[:-1]).view(-1, 4)[:, 2:].tolist() == [list(c) for c in codes]
    assert layout.codes_to_tokens(layout.tokens_to_codes(stream[:8])) == stream[:8]
    with pytest.raises(ValueError, match="frame position 1"):
        layout.token_to_code(slot_token(PHONEME, 5), 1)
    with pytest.raises(ValueError, match="not a phoneme-lpc prompt"):
        layout.alignment([1, 2, 3])


def test_the_front_end_gives_phoneme_frames_that_fill_the_speech():
    from audio_pipeline.text.espeak import espeak, frame_count, phoneme_frames

    utterance = espeak().synthesize("Hello there, how are you?", keep_audio=False)
    frames = phoneme_frames(utterance.phonemes, utterance.length, utterance.sample_rate, 50)
    assert [name for name, _ in frames][:4] == ["h", "@", "l", "'oU"]
    assert all(n > 0 for _, n in frames)
    assert sum(n for _, n in frames) == frame_count(utterance.length, utterance.sample_rate, 50)


@pytest.fixture(scope="module")
def voice_dir():
    from audio_pipeline.builtin import resolve_builtin_model

    return resolve_builtin_model("lpc-en")


def test_the_shipped_voice_is_a_small_hugging_face_directory(voice_dir):
    from transformers import AutoConfig, AutoTokenizer

    from audio_pipeline.layouts.manifest import ModelManifest

    size = sum(f.stat().st_size for f in voice_dir.rglob("*") if f.is_file())
    assert size < 20e6
    manifest = ModelManifest.read(voice_dir)
    assert (manifest.family, manifest.audio_decoder, manifest.default_voice) == ("phoneme-lpc", "lpc", "lpc-en")
    assert AutoConfig.from_pretrained(voice_dir).model_type == "llama"
    tokenizer = AutoTokenizer.from_pretrained(voice_dir)
    prompt = manifest.make_layout(voice_dir).build_prompt(tokenizer, "Good morning.", None)
    assert prompt[0] == layout_module.BEGIN and prompt[-1] == layout_module.START_OF_SPEECH
    assert tokenizer.convert_tokens_to_ids("<ph:'oU>") >= PHONEME_BASE


def test_the_default_model_is_the_built_in_voice_with_the_decoder_it_names():
    from audio_pipeline.config import DEFAULT_MODEL, AudioGenerationConfig
    from audio_pipeline.decoders.settings_check import check_decoder_settings

    config = AudioGenerationConfig.load(env={})
    assert DEFAULT_MODEL == config.model.model_path == "builtin:slt-en-v5"
    assert config.resolved_audio_decoder == "mcep" and config.to_display_dict()["audio_decoder"] == "mcep"
    # A decoder given explicitly wins; streaming settings are checked against the decoder in use.
    explicit = AudioGenerationConfig.load(env={}, audio_flags=["audio_decoder=causal-conv"])
    assert explicit.resolved_audio_decoder == "causal-conv"
    with pytest.raises(ValueError, match=r"chunk_size \[7\].*mcep's 4 tokens per frame"):
        check_decoder_settings(AudioGenerationConfig.load(env={}, audio_flags=["chunk_size=7"]))
    tiny = AudioGenerationConfig.load(env={}, model={"model_path": "builtin:tiny-orpheus"})
    assert tiny.resolved_audio_decoder == "snac"


def test_models_stream_by_default_unless_the_configuration_says_otherwise(tmp_path):
    """A model's manifest names its streaming defaults; Orpheus-layout models start at 28 tokens and
    grow; whatever the configuration sets (even chunk_size=none) wins, and so does another decoder."""
    import json

    from audio_pipeline.builtin import shipped_model_dir
    from audio_pipeline.config import AudioGenerationConfig

    default = AudioGenerationConfig.load(env={})
    assert (default.chunk_size, default.buffer, default.block_causal) == ([8, 8, 16, 24, 40], 0, True)
    shown = default.to_display_dict()
    assert (shown["chunk_size"], shown["block_causal"]) == ([8, 8, 16, 24, 40], True)
    off = AudioGenerationConfig.load(env={}, audio_flags=["chunk_size=none"])
    assert off.chunk_size is None and off.block_causal is True
    own = AudioGenerationConfig.load(env={}, audio_flags=["chunk_size=4", "block_causal=false"])
    assert (own.chunk_size, own.block_causal) == ([4], False)
    other = AudioGenerationConfig.load(env={}, audio_flags=["audio_decoder=causal-conv"])
    assert (other.chunk_size, other.block_causal) == (None, False)
    tiny = AudioGenerationConfig.load(env={}, model={"model_path": "builtin:tiny-orpheus"})
    assert (tiny.chunk_size, tiny.buffer, tiny.block_causal) == ([28, 56, 112], 0, False)
    # A model directory whose manifest names its own streaming settings.
    shipped = shipped_model_dir("lpc-en")
    model = tmp_path / "voice"
    model.mkdir()
    for item in shipped.iterdir():
        if item.is_file():
            (model / item.name).write_bytes(item.read_bytes())
    manifest = json.loads((shipped / "audio_pipeline.json").read_text())
    manifest["streaming"] = {"chunk_size": [12, 24], "buffer": 4}
    (model / "audio_pipeline.json").write_text(json.dumps(manifest))
    custom = AudioGenerationConfig.load(env={}, model={"model_path": str(model)})
    assert (custom.chunk_size, custom.buffer, custom.block_causal) == ([12, 24], 4, False)
    manifest["streaming"] = {"chunk_sizes": [12]}
    (model / "audio_pipeline.json").write_text(json.dumps(manifest))
    from audio_pipeline.layouts.manifest import ModelManifest

    with pytest.raises(ValueError, match="unknown streaming settings.*chunk_sizes"):
        ModelManifest.read(model)


def _engine(*flags):
    from audio_pipeline.config import AudioGenerationConfig
    from audio_pipeline.service.engine import TTSEngine

    # The phoneme-lpc voice (four positions per frame, forced alignment tokens): what this file tests.
    engine = TTSEngine(AudioGenerationConfig.load(env={}, audio_flags=list(flags),
                                                  model={"device": "cpu", "model_path": "builtin:slt-en"}))
    engine.start()
    return engine


@pytest.fixture(scope="module")
def engine():
    """builtin:slt-en through the engine, streaming in chunks of 2 then 10 frames."""
    engine = _engine("chunk_size=8,40")
    yield engine
    engine.stop()


@pytest.mark.slow
def test_held_out_sentences_through_the_engine_are_identified(engine, tmp_path):
    from recipes.builtin_voice.corpus import held_out
    from recipes.builtin_voice.evaluate import evaluate

    candidates = held_out(40)
    result = evaluate(candidates[:SPOKEN], lambda text: _speak(engine, text), str(tmp_path / "grammar.jsgf"),
                      candidates=candidates)
    assert result["identified"] >= MIN_IDENTIFIED, result


def _speak(engine, text):
    result = engine.synthesize(text, temperature=0.0)
    assert result.stop_reason.value == "end_of_speech"
    return result.samples, result.sample_rate


@pytest.mark.slow
def test_the_engine_keeps_the_alignment_even_when_sampling_wildly(engine):
    text = "Please call Stella and ask her to bring these things with her from the store."
    for seed in (1, 2):
        context = engine.create_context(text, temperature=2.0, top_p=1.0, seed=seed)
        assert context.alignment.tokens > 4 * 50 * 2  # over two seconds of speech
        audio, stop = speech(engine, context), context.stop_reason.value
        # Every phoneme gets exactly its frames: nothing skipped, repeated or cut off.
        assert stop == "end_of_speech" and len(context.generated) == context.alignment.tokens
        assert len(audio) == context.alignment.tokens // 4 * SAMPLES_PER_FRAME
        assert np.isfinite(audio).all() and np.abs(audio).max() <= 1.0
        # ... and the audio streamed is the decoder's audio of those frames, in order.
        one_shot = engine.decoder.decode(context.speech_codes(0, len(context.generated))).numpy()
        np.testing.assert_allclose(audio, one_shot, atol=1e-5)


@pytest.mark.slow
def test_max_tokens_defaults_to_what_the_text_needs_and_an_explicit_one_is_kept(engine):
    text = "This sentence is longer than six seconds of speech would be if it were spoken very slowly, " \
           "and it goes on for a good while longer than the engine's general default of 1200 tokens."
    context = engine.create_context(text)
    assert context.sampling.max_tokens == context.alignment.tokens + 4 > engine.config.sampling.max_tokens
    cut = engine.synthesize("Good morning, Anna.", max_tokens=40, temperature=0.0)
    whole = engine.synthesize("Good morning, Anna.", temperature=0.0)
    assert cut.stop_reason.value == "max_tokens" and whole.stop_reason.value == "end_of_speech"
    # 40 tokens are the first 10 frames of the whole speech, cut there.
    assert len(cut.samples) == 10 * SAMPLES_PER_FRAME < len(whole.samples)
    np.testing.assert_array_equal(cut.samples, whole.samples[:len(cut.samples)])


@pytest.mark.slow
def test_a_text_over_the_token_limit_is_refused_naming_the_text():
    engine = _engine("sampling.max_tokens=200", "sampling.max_tokens_limit=200")
    try:
        with pytest.raises(InvalidArgument, match="max_tokens_limit=200") as error:
            engine.create_context("This text takes far longer than one second to say out loud.")
        assert error.value.field == "text"
        assert engine.synthesize("Hi.", temperature=0.0).stop_reason.value == "end_of_speech"
    finally:
        engine.stop()


@pytest.mark.parametrize("flags", [("chunk_size=4",), ("chunk_size=8,40", "buffer=8"), ("chunk_size=4,8,40",
                                   "block_causal=true"), ("chunk_size=40", "buffer=16", "block_causal=true"),
                                   ("chunk_size=8,40", "block_causal=false"), ("chunk_size=12", "buffer=4")])
@pytest.mark.slow
def test_streamed_audio_equals_one_shot_at_every_setting(engine, flags):
    text = "Good morning, Anna."
    one_shot = _engine()
    try:
        reference = one_shot.synthesize(text, temperature=0.0).samples
    finally:
        one_shot.stop()
    streamed_engine = _engine(*flags)
    try:
        streamed = streamed_engine.synthesize(text, temperature=0.0).samples
    finally:
        streamed_engine.stop()
    assert len(streamed) == len(reference) > 16000 * 0.5
    # The decoder carries its whole state (responses' tails, pulse phase, noise) from chunk to chunk, with
    # or without block_causal: the streamed samples are the one-shot's.
    np.testing.assert_allclose(streamed, reference, atol=1e-5)


@pytest.mark.slow
def test_the_server_on_the_default_model_lists_and_streams_the_built_in_voice(tmp_path):
    import soundfile as sf

    from audio_pipeline.config import AudioGenerationConfig
    from audio_pipeline.testing.background import BackgroundServer
    from audio_pipeline_client import TTSClient
    from audio_pipeline_client.cli import main as tts_client
    from audio_pipeline_client.protocol import float_to_pcm16

    # Default settings: the voice's manifest makes the server stream from its first frames.
    config = AudioGenerationConfig.load(env={}, model={"device": "cpu"}, voices_dir=str(tmp_path / "voices"))
    server = BackgroundServer(config).start()
    try:
        with TTSClient(server.target) as client:
            voices = client.list_voices()
            assert [v.name for v in voices][:1] == ["slt-en"]
            chunks = list(client.stream("Good morning, Anna.", temperature=0.0))
            whole = client.synthesize("Good morning, Anna.", temperature=0.0)
        assert len(chunks) > 2 and whole.stop_reason == "end_of_speech" and whole.sample_rate == 16000
        assert chunks[0].samples.shape[0] == 2 * 320, "the first chunk holds the first 2 frames (8 tokens)"
        np.testing.assert_array_equal(np.concatenate([c.samples for c in chunks]), whole.samples)
        # The CLI client writes the default voice's speech to a WAV file.
        assert tts_client(["--server", server.target, "--text", "Good morning, Anna.", "--temperature", "0",
                           "--output", str(tmp_path / "out.wav")]) == 0
        audio, rate = sf.read(str(tmp_path / "out.wav"), dtype="int16")
        assert rate == 16000 and len(audio) > 16000 * 0.5
        np.testing.assert_array_equal(audio, float_to_pcm16(whole.samples))
    finally:
        server.stop()


TEXTS = ("Good morning, Anna.", "Please call Stella and ask her to bring these things with her.", "Thank you!")


def _greedy_tokens(engine, texts):
    """Each text's generated tokens, all submitted at once (greedy)."""
    contexts = run_texts(engine, texts, temperature=0.0)
    assert all(c.stop_reason.value == "end_of_speech" for c in contexts)
    return [list(c.generated) for c in contexts], contexts


@pytest.mark.slow
def test_forced_tokens_take_no_model_step(engine):
    """The model runner's forward passes (what it calls for every step) are counted."""
    calls = []
    forward = engine.model.forward

    def counting(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)

    engine.model.forward = counting
    try:
        (tokens,), (context,) = _greedy_tokens(engine, TEXTS[1:2])
    finally:
        engine.model.forward = forward
    frames = len(tokens) // 4
    assert len(tokens) == context.alignment.tokens
    # One step for the prompt and the first frame's phoneme, then two per frame (envelope, prosody),
    # and the last multi-step round may launch up to three passes past the end of speech (its
    # budget ends a frame after the alignment); at least one a frame (the count is real: the
    # runner's steps go through forward).
    assert frames <= len(calls) <= 2 * frames + 4


@pytest.mark.parametrize("flags", [("enable_overlap_scheduler=true",),
                                   ("enable_in_flight_batching=true", "max_batch_input_tokens=48"),
                                   ("max_num_steps=1",), ("max_num_steps=3",), ("deadline_scheduling=false",),
                                   ("first_audio_target_ms=0", "deadline_margin_ms=1000")])
@pytest.mark.slow
def test_scheduling_modes_give_the_same_greedy_speech(engine, flags):
    reference = [_greedy_tokens(engine, [t])[0][0] for t in TEXTS]
    other = _engine(*flags)
    try:
        together, _ = _greedy_tokens(other, TEXTS)
    finally:
        other.stop()
    assert together == reference


@pytest.mark.slow
def test_the_scheduler_plans_exactly_the_forced_tokens_a_sample_brings(engine):
    """One rule for forced tokens: after every sample, the tokens the request gained are exactly
    what tokens_per_sample planned (the scheduler's view), up to the end of speech."""
    context = engine.create_context("Good morning, Anna.", temperature=0.0)
    context.append_sample(context.alignment.forced(0))  # the first frame's phoneme, as the first step samples it
    samples, stop = 0, None
    while not stop:
        before = context.total_length
        planned = context.tokens_per_sample(before)
        start, _ = context.layout.token_range(len(context.generated))
        stop = context.append_sample(start + 1)
        samples += 1
        if not stop:
            assert context.total_length - before == planned
    assert stop.value == "end_of_speech"
    assert len(context.generated) == context.alignment.tokens and samples == 2 * len(context.alignment.frames)


def test_the_second_generation_voice_ships_its_front_end_codec_and_licences():
    from audio_pipeline.builtin import shipped_model_dir
    from audio_pipeline.layouts.manifest import ModelManifest

    directory = shipped_model_dir("slt-en")
    manifest = ModelManifest.read(directory)
    assert (manifest.layout_options["front_end"], manifest.audio_decoder, manifest.default_voice) == ("lexicon", "mcep",
                                                                                                     "slt-en")
    size = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
    assert size < 20e6
    licences = (directory / "LICENSES.md").read_text()
    assert "festlex-cmu" in licences and "cmu_us_slt_arctic_hts" in licences and "Carnegie Mellon" in licences


# The default and the voice of the other prompt form (slt-en-v4 differs from slt-en-v5 in its
# weights and codec only, and its prompts are checked below).
@pytest.mark.slow
@pytest.mark.parametrize("voice", ["builtin:slt-en-v5", "builtin:slt-en-frame"])
def test_the_frame_voice_speaks_held_out_sentences_in_one_pass_per_frame(tmp_path, voice):
    """The frame voices (phoneme-lpc-frame: one position and one backbone pass per frame, the
    prosody from its depth head; slt-en-v4's and slt-en-v5's prompt one position per phoneme): held-out sentences
    are identified, and sampling wildly it still speaks every frame of the alignment, streamed as
    the decoder's one-shot audio."""
    from audio_pipeline.config import AudioGenerationConfig
    from audio_pipeline.service.engine import TTSEngine
    from recipes.builtin_voice.corpus import held_out
    from recipes.builtin_voice.evaluate import evaluate

    engine = TTSEngine(AudioGenerationConfig.load(env={}, audio_flags=["chunk_size=8,40"],
                                                  model={"device": "cpu", "model_path": voice}))
    engine.start()
    try:
        assert type(engine.layout).__name__ == "PhonemeLPCFrameLayout"
        assert engine.layout.folded_prompt == (voice != "builtin:slt-en-frame")
        candidates = held_out(40)
        result = evaluate(candidates[:SPOKEN], lambda text: _speak(engine, text), str(tmp_path / "grammar.jsgf"),
                          candidates=candidates)
        assert result["identified"] >= MIN_IDENTIFIED, result
        context = engine.create_context("Please call Stella and ask her to bring these things with her from the store.",
                                        temperature=2.0, top_p=1.0, seed=3)
        audio, stop = speech(engine, context), context.stop_reason.value
        assert stop == "end_of_speech" and len(context.frames) == context.alignment.tokens > 100
        assert len(audio) == len(context.frames) * SAMPLES_PER_FRAME and np.abs(audio).max() <= 1.0
        one_shot = engine.decoder.decode(context.speech_codes(0, context.speech_code_count)).numpy()
        np.testing.assert_allclose(audio, one_shot, atol=1e-5)
    finally:
        engine.stop()


@pytest.mark.parametrize("voice", ["slt-en-v5", "slt-en-v4", "slt-en-frame"])
def test_a_prompts_first_frame_and_phonemes_come_out_as_the_whole_alignment_gives_them(voice):
    """A request's preparation reads the tokenizer's vocabulary once (again only when the tokenizer
    grows) and computes frame 0's codes from the first two phonemes alone: the same prompts and
    first frames as the whole alignment and a fresh vocabulary give, folded prompt or not."""
    from transformers import AutoTokenizer

    from audio_pipeline.builtin import shipped_model_dir
    from audio_pipeline.layouts.manifest import ModelManifest
    from audio_pipeline.layouts.phoneme_lpc import _vocabulary

    directory = shipped_model_dir(voice)
    layout = ModelManifest.read(directory).make_layout(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    vocabulary = _vocabulary(tokenizer)
    assert _vocabulary(tokenizer) is vocabulary and vocabulary == tokenizer.get_vocab()
    for text in ["Hi.", "Good morning, Dr. Smith!", "A", "Is it 3:45 already? The 12 trains left at noon."]:
        prompt = layout.build_prompt(tokenizer, text, None)
        # The last prompt position (start of speech, or the last of the leading pause's frames the
        # prompt holds) carries the phoneme and context of the first frame generated.
        assert layout.prompt_frames(prompt)[-1].tolist()[:2] == layout.alignment(prompt).frame_codes(-1)[:2]
    tokenizer.add_tokens(["<ph:test-only>"])
    grown = _vocabulary(tokenizer)
    assert grown is not vocabulary and "<ph:test-only>" in grown
