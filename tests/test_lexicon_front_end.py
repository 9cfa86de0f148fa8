"""The lexicon front end of the second-generation voice (pronouncing dictionary, phrase breaks,
durations) on its own and through the engine: a tiny random phoneme-lpc model written here, with
the lexicon front end and the mcep decoder, speaks with the units, frames and word timings the
front end gives."""

import json

import numpy as np
import pytest

from audio_pipeline.text.lexicon import Lexicon, LexiconFrontEnd, Phonemizer
from audio_pipeline.text.prosody import PAUSE_KINDS, ProsodyModel, duration_input_size

WORDS = {
    "the": ((("dh", "ax"), 0),),
    "cat": ((("k", "ae", "t"), 1),),
    "sat": ((("s", "ae", "t"), 1),),
    "on": ((("aa", "n"), 1),),
    "mat": ((("m", "ae", "t"), 1),),
    "jess": ((("jh", "eh", "s"), 1),),
    "well": ((("w", "eh", "l"), 1),),
    "known": ((("n", "ow", "n"), 1),),
    "sofa": ((("s", "ow"), 1), (("f", "ax"), 0)),
}
INVENTORY = ["pau", "dh", "ax0", "k", "ae1", "t", "s", "aa1", "n", "m", "jh", "eh1", "w", "l", "ow1", "f", "ih0", "z"]


def prosody(frames_per_unit=3.0, pause_frames=10.0, break_before=("on",), comma_unpaused=None):
    """A hand-made model: every phone lasts ``frames_per_unit``, every pause ``pause_frames``; a
    break before the words of ``break_before``; no pause after the one-word openings of
    ``comma_unpaused`` (None: the key absent, as in older voices)."""
    inventory = {u: i for i, u in enumerate(INVENTORY)}
    size = duration_input_size(len(inventory))
    w1 = np.zeros((size, 2))
    w1[inventory["pau"], 0] = 1.0  # hidden 0: "this is a pause"
    w1[:, 1] = 0.0
    b1 = np.array([0.0, 1.0])  # hidden 1: always on
    w2 = np.array([np.log(pause_frames) - np.log(frames_per_unit), np.log(frames_per_unit)])
    vocabulary = list(break_before)
    weights = np.full(len(vocabulary) + 1 + 16, 0.0)
    weights[:len(vocabulary)] = 10.0
    data = {"break_words": vocabulary, "break_weights": weights.tolist(), "break_bias": -5.0,
            "inventory": INVENTORY, "w1": w1.tolist(), "b1": b1.tolist(), "w2": w2.tolist(), "b2": 0.0}
    if comma_unpaused is not None:
        data["comma_unpaused_words"] = list(comma_unpaused)
    return ProsodyModel(data)


@pytest.fixture
def lexicon(tmp_path):
    path = tmp_path / "lexicon.txt.gz"
    Lexicon.write(path, WORDS)
    return Lexicon.load(path)


def test_words_become_phones_with_stress_and_the_rules_on_top(lexicon):
    phonemizer = Phonemizer(lexicon)
    units = [u for u, _ in phonemizer.units("The cat sat, on Jess's well-known sofa.")]
    assert units == ["pau", "dh", "ax0", "k", "ae1", "t", "s", "ae1", "t", "pau", "aa1", "n",
                     "jh", "eh1", "s", "ih0", "z",  # a possessive after a sibilant
                     "w", "eh1", "l", "n", "ow1", "n",  # a hyphenated word is its parts
                     "s", "ow1", "f", "ax0", "pau"]
    assert [u for u, _ in phonemizer.units("The cat's mat")][3:7] == ["k", "ae1", "t", "s"]  # voiceless: s


def test_a_word_the_lexicon_lacks_is_spelled_from_espeak_in_cmu_phones(lexicon):
    from audio_pipeline.text.lexicon import VOWELS

    units = [u for u, _ in Phonemizer(lexicon).units("Zorbulax")]
    assert units[0] == units[-1] == "pau"
    phones = [u.rstrip("01") for u in units[1:-1]]
    cmu = VOWELS | {"b", "ch", "d", "dh", "f", "g", "hh", "jh", "k", "l", "m", "n", "ng", "p", "r", "s", "sh", "t",
                    "th", "v", "w", "y", "z", "zh"}
    assert set(phones) <= cmu, phones
    # The word as spelled: its consonants z, r, b, l and x (k s) in order, a vowel between each
    # (eSpeak may glide a "y" into "bu"), and eSpeak's stress mark carried over.
    consonants = [p for p in phones if p not in VOWELS and p != "y"]
    assert consonants == ["z", "r", "b", "l", "k", "s"], units
    assert [p in VOWELS for p in phones].count(True) == 3, units
    assert any(u.endswith("1") for u in units)


def test_the_front_end_gives_units_frames_and_word_frames(lexicon):
    front_end = LexiconFrontEnd(lexicon, prosody())
    text = "The cat sat on the mat, the cat."
    aligned = front_end.align(text, 50)
    names = [n for n, _ in aligned.phonemes]
    # Pauses at the start, before "on" (a predicted break), after the comma, and at the end.
    assert names == ["pau", "dh", "ax0", "k", "ae1", "t", "s", "ae1", "t", "pau", "aa1", "n", "dh", "ax0",
                     "m", "ae1", "t", "pau", "dh", "ax0", "k", "ae1", "t", "pau"]
    assert [f for n, f in aligned.phonemes if n == "pau"] == [10] * 4
    # Every phone 3 frames but the last, a stop cut to what is heard of it before the closing pause.
    assert {f for n, f in aligned.phonemes[:-2] if n != "pau"} == {3} and aligned.phonemes[-2] == ("t", 2)
    words = aligned.words
    assert [text[w.start:w.end] for w in words] == ["The", "cat", "sat", "on", "the", "mat", "the", "cat"]
    assert (words[0].first_frame, words[0].end_frame) == (10, 16)
    assert words[3].first_frame == words[2].end_frame + 10  # the break's pause between them
    assert words[-1].end_frame == sum(f for _, f in aligned.phonemes) - 10


def test_the_break_model_uses_the_words_since_the_last_pause(lexicon):
    model = prosody(break_before=())
    vocabulary_size = 0
    weights = np.zeros(vocabulary_size + 1 + 16)
    weights[vocabulary_size + 1 + 4:vocabulary_size + 1 + 8] = 10.0  # five or more words since a pause
    model.break_weights, model.break_bias, model.vocabulary = weights, -5.0, {}
    units, _ = LexiconFrontEnd(lexicon, model).units("the cat sat on the mat the cat sat on the mat")
    kinds = [u.kind for u in units if u.name == "pau"]
    assert kinds[0] == "start" and kinds[-1] == "end" and "break" in kinds
    assert set(kinds) <= set(PAUSE_KINDS)


@pytest.fixture(scope="module")
def tiny_lexicon_voice(tmp_path_factory):
    """A random 1-layer phoneme-lpc model with the lexicon front end and an mcep decoder."""
    from safetensors.torch import save_file

    from audio_pipeline.decoders.mcep import DEFAULT_CONFIG, save_mcep_decoder
    from audio_pipeline.layouts.manifest import MANIFEST_NAME
    from audio_pipeline.layouts.phoneme_lpc import VOCAB_SIZE, write_tokenizer
    from audio_pipeline.testing.tiny_models import random_llama_state
    from recipes.builtin_voice.train import model_config

    path = tmp_path_factory.mktemp("lexicon-voice")
    config = model_config(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                          num_key_value_heads=2)
    assert config["vocab_size"] == VOCAB_SIZE
    (path / "config.json").write_text(json.dumps(config))
    state = random_llama_state(config, seed=0)
    save_file({k: v for k, v in state.items() if k != "lm_head.weight"}, str(path / "model.safetensors"))
    write_tokenizer(path, INVENTORY)
    rng = np.random.default_rng(0)
    order, bands = DEFAULT_CONFIG["order"], len(DEFAULT_CONFIG["aperiodicity_bands"]) - 1
    codebook = np.concatenate([rng.normal(0, 0.3, (1024, order)) / np.arange(1, order + 1),
                               rng.uniform(-30, -1, (1024, bands))], 1)
    save_mcep_decoder(path / "decoder", codebook)
    Lexicon.write(path / "lexicon.txt.gz", WORDS)
    model = prosody()
    (path / "prosody.json").write_text(json.dumps({
        "break_words": list(model.vocabulary), "break_weights": model.break_weights.tolist(),
        "break_bias": model.break_bias, "inventory": INVENTORY, "w1": model.w1.tolist(), "b1": model.b1.tolist(),
        "w2": model.w2.tolist(), "b2": model.b2}))
    (path / MANIFEST_NAME).write_text(json.dumps({
        "family": "phoneme-lpc", "voices": [{"name": "tiny"}], "default_voice": "tiny", "audio_decoder": "mcep",
        "audio_decoder_weights": "decoder", "layout_options": {"front_end": "lexicon"},
        "streaming": {"chunk_size": [8, 40]}}))
    return path


def test_the_engine_speaks_a_lexicon_voice_with_its_frames_and_word_timings(tiny_lexicon_voice):
    from audio_pipeline.config import AudioGenerationConfig
    from audio_pipeline.service.engine import TTSEngine
    from audio_pipeline.layouts.phoneme_lpc import TAIL_PAUSE_FRAMES

    config = AudioGenerationConfig.load(env={}, audio_flags=[], model={"model_path": str(tiny_lexicon_voice),
                                                                        "device": "cpu"})
    engine = TTSEngine(config)
    engine.start()
    try:
        text = "The cat sat on the mat, the cat."
        context = engine.create_context(text, seed=1)
        phonemes = engine.layout.front_end.align(text, 50).phonemes
        # The speech ends TAIL_PAUSE_FRAMES into the closing pause (the voice names no silence
        # frame, so its opening pause is spoken whole).
        frames = sum(f for _, f in phonemes) - (phonemes[-1][1] - TAIL_PAUSE_FRAMES)
        assert phonemes[-1][0] == "pau" and phonemes[-1][1] > TAIL_PAUSE_FRAMES
        assert context.alignment.tokens == 4 * frames
        assert [w.text for w in context.words] == ["The", "cat", "sat", "on", "the", "mat", "the", "cat"]
        assert context.words[0].start_sample == 10 * 320
        assert context.words[-1].end_sample <= frames * 320
        result = engine.synthesize(text, seed=1)
        assert result.stop_reason.value == "end_of_speech"
        assert result.samples.shape[0] == frames * 320 and result.sample_rate == 16000
    finally:
        engine.stop()


def test_a_manifest_names_a_known_front_end(tiny_lexicon_voice, tmp_path):
    """The front end is a layout option of the phoneme-lpc families; a manifest written when it
    was a top-level key still names it there."""
    import shutil

    from audio_pipeline.layouts.manifest import MANIFEST_NAME, ModelManifest

    copy = tmp_path / "voice"
    shutil.copytree(tiny_lexicon_voice, copy)
    manifest = json.loads((copy / MANIFEST_NAME).read_text())
    (copy / MANIFEST_NAME).write_text(json.dumps({**manifest, "layout_options": {"front_end": "festival"}}))
    with pytest.raises(ValueError, match=r"unknown layout_options\.front_end 'festival' \(known: espeak, lexicon\)"):
        ModelManifest.read(copy).make_layout(copy)
    older = {key: value for key, value in manifest.items() if key != "layout_options"}
    (copy / MANIFEST_NAME).write_text(json.dumps({**older, "front_end": "lexicon"}))
    assert ModelManifest.read(copy).layout_options == {"front_end": "lexicon"}
    assert ModelManifest.read(copy).make_layout(copy).front_end is not None


def test_a_voice_finds_its_front_end_in_the_folder_its_manifest_names(tiny_lexicon_voice, tmp_path):
    """Voices may share one front end (the built-in ones do): ``front_end_dir``, relative to the
    model directory, says where lexicon.txt.gz and prosody.json are, and the voice speaks as with
    its own copies; a folder without them is refused at load naming the key, and the key is
    refused for a front end that reads no files."""
    import shutil

    from audio_pipeline.config import AudioGenerationConfig
    from audio_pipeline.service.engine import TTSEngine
    from audio_pipeline.layouts.manifest import MANIFEST_NAME, ModelManifest

    def speak(directory):
        config = AudioGenerationConfig.load(env={}, audio_flags=[], model={"model_path": str(directory),
                                                                            "device": "cpu"})
        engine = TTSEngine(config)
        engine.start()
        try:
            return engine.synthesize("The cat sat on the mat, the cat.", seed=1).samples
        finally:
            engine.stop()

    voice, shared = tmp_path / "voices" / "tiny", tmp_path / "voices" / "front-end"
    shutil.copytree(tiny_lexicon_voice, voice)
    shared.mkdir()
    for name in ("lexicon.txt.gz", "prosody.json"):
        (voice / name).rename(shared / name)
    manifest = json.loads((voice / MANIFEST_NAME).read_text())
    (voice / MANIFEST_NAME).write_text(json.dumps({**manifest, "layout_options": {"front_end": "lexicon",
                                                                                "front_end_dir": "../front-end"}}))
    np.testing.assert_array_equal(speak(voice), speak(tiny_lexicon_voice))

    (shared / "prosody.json").unlink()
    with pytest.raises(ValueError, match=r"prosody.json is missing from front_end_dir '../front-end'"):
        ModelManifest.read(voice).make_layout(voice)
    (voice / MANIFEST_NAME).write_text(json.dumps({**manifest, "layout_options": {"front_end": "espeak",
                                                                                "front_end_dir": "."}}))
    with pytest.raises(ValueError, match="front_end_dir is the lexicon front end's folder"):
        ModelManifest.read(voice).make_layout(voice)


def test_a_one_word_opening_the_teacher_runs_on_from_keeps_no_pause_at_its_comma(lexicon):
    """The teacher said "Wow, David..." without a pause (0 of 98 in its training speech): a voice
    whose prosody.json lists such openings runs on past their comma, as the model learned it.
    Only a phrase of that one word: the same word later in a phrase, and other openings, pause
    at their comma; and a voice without the list pauses at every comma."""
    def pauses(model, text):
        units, _ = LexiconFrontEnd(lexicon, model).units(text)
        return [u.kind for u in units if u.name == "pau"]

    learned = prosody(break_before=(), comma_unpaused=["well"])
    assert pauses(learned, "Well, the cat sat.") == ["start", "end"]
    assert pauses(learned, "WELL, the cat sat.") == ["start", "end"]
    assert pauses(learned, "The cat sat well, the mat.") == ["start", ",", "end"]  # "well" ends a phrase here
    assert pauses(learned, "The cat, well, the mat.") == ["start", ",", "end"]  # after a pause it opens one
    assert pauses(learned, "Jess, the cat sat.") == ["start", ",", "end"]
    assert pauses(learned, "The mat. Well, the cat sat.") == ["start", ".", "end"]  # it opens a sentence
    older = prosody(break_before=())
    assert pauses(older, "Well, the cat sat.") == ["start", ",", "end"]


def test_the_recipe_learns_which_openings_run_on_from_the_teachers_pauses(lexicon):
    """recipes/builtin_voice/prosody.py: each comma after a one-word phrase, and whether the
    teacher paused there, read from its segments; the openings it paused after less than half the
    time (seen often enough) are the ones a voice runs on from."""
    from recipes.builtin_voice.prosody import comma_openings, unpaused_comma_words

    def record(opening, opening_phones, paused):
        segments, t = [["pau", 0.2, 0, ""]], 0.2
        for word, phones in ((opening, opening_phones), ("the", ["dh", "ax"]), ("cat", ["k", "ae", "t"]),
                             ("sat", ["s", "ae", "t"])):
            for phone in phones:
                t += 0.06
                segments.append([phone, round(t, 3), int(phone in ("eh", "ae")), word])
            if word == opening and paused:
                t += 0.1
                segments.append(["pau", round(t, 3), 0, ""])
        segments.append(["pau", round(t + 0.2, 3), 0, ""])
        return {"text": f"{opening.capitalize()}, the cat sat.", "segments": segments}

    phonemizer = Phonemizer(lexicon)
    assert comma_openings(record("well", ["w", "eh", "l"], False), phonemizer) == [("well", False)]
    assert comma_openings(record("jess", ["jh", "eh", "s"], True), phonemizer) == [("jess", True)]
    assert comma_openings({"text": "The cat sat, the mat.", "segments": record("well", ["w", "eh", "l"], True)[
        "segments"]}, phonemizer) == []  # a comma after three words is no one-word opening
    openings = [("well", False)] * 5 + [("jess", True)] * 5 + [("mat", False)] * 4 + [("cat", False), ("cat", True)] * 3
    assert unpaused_comma_words(openings) == ["well"]  # "mat" seen too rarely, "cat" paused half the time
