"""Kyutai TTS's model and text state machine against the reference's fixtures
(tests/fixtures/kyutai_tts, made by scripts/kyutai_tts_reference/): the configuration and weights
as published, the script's words, and greedy generation step by step (text and depth logits
within 1e-4, every frame, text token, end step, consumption time and word timestamp equal)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from kyutai_tts_dense import generate_dense
from safetensors.torch import load_file

from audio_pipeline.checkpoints.kyutai_tts_config import (
    FRAME_RATE,
    dsm_config,
    read_dsm_config,
)
from audio_pipeline.layouts.dsm_text import (
    NEW_WORD,
    PAD,
    TextMachine,
    Word,
    script_words,
)
from audio_pipeline.models.kyutai_tts import load_dsm_model

FIXTURES = Path(__file__).parent / "fixtures" / "kyutai_tts"
CASES = sorted(p.name for p in (FIXTURES / "cases").iterdir())


def _case(name: str) -> dict:
    return json.loads((FIXTURES / "cases" / name / "case.json").read_text())


def _model(variant: str):
    directory = FIXTURES / "models" / variant
    config = read_dsm_config(directory)
    return config, load_dsm_model(directory, config)


def _tokenizer(variant: str):
    import sentencepiece

    config = read_dsm_config(FIXTURES / "models" / variant)
    return sentencepiece.SentencePieceProcessor(model_file=str(FIXTURES / "models" / variant / config.tokenizer_name))


def _voice(variant: str, name: str) -> torch.Tensor:
    config = read_dsm_config(FIXTURES / "models" / variant)
    path = FIXTURES / "models" / variant / "voices" / f"{name}.wav{config.voice_suffix}"
    return load_file(str(path))["speaker_wavs"][0]


def _names(voices) -> list[str]:
    """An item's voices in a case: one name, or a dialogue's (the main speaker's first)."""
    return [voices] if isinstance(voices, str) else list(voices)


def test_config_reads_the_published_layout():
    config = read_dsm_config(FIXTURES / "models" / "distilled")
    assert (config.n_q, config.card, config.text_card, config.context) == (8, 64, 384, 32)
    assert config.audio_delay_steps == 6 and config.second_stream_ahead == 2
    assert config.distilled_guidance and config.cfg_values == (1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0)
    assert config.voice_suffix == ".d5a1c0de@7.safetensors"
    assert not read_dsm_config(FIXTURES / "models" / "plain").distilled_guidance


@pytest.mark.parametrize("key, value, named", [
    ("dep_q", 4, "dep_q"), ("depformer_pos_emb", "sin", "depformer_pos_emb"), ("layer_scale", 0.1, "layer_scale"),
    ("gating", "none", "gating"), ("delays", [0, 0], "delays")])
def test_config_refuses_what_it_cannot_run(key, value, named):
    raw = json.loads((FIXTURES / "models" / "distilled" / "config.json").read_text())
    raw[key] = value
    with pytest.raises(ValueError, match=named):
        dsm_config(raw)


def test_weights_load_fused_or_split_and_a_missing_tensor_is_named(tmp_path):
    import shutil

    from safetensors.torch import save_file

    source = FIXTURES / "models" / "distilled"
    config = read_dsm_config(source)
    fused = load_dsm_model(source, config)
    # The package's own state-dict names (one tensor per weight set) load the same model.
    split = {k: v for k, v in fused.state_dict().items()}
    target = tmp_path / "split"
    shutil.copytree(source, target, symlinks=False)
    save_file(split, str(target / config.moshi_name))
    again = load_dsm_model(target, config)
    for key, value in fused.state_dict().items():
        assert torch.equal(value, again.state_dict()[key]), key
    del split["text_linear.weight"]
    save_file(split, str(target / config.moshi_name))
    with pytest.raises(ValueError, match="text_linear.weight"):
        load_dsm_model(target, config)


@pytest.mark.parametrize("name", CASES)
def test_script_words_equal_the_references(name):
    case = _case(name)
    variant = case["checkpoint"]
    config = read_dsm_config(FIXTURES / "models" / variant)
    sp = _tokenizer(variant)
    for script, entries in zip(case["script"], case["entries"]):
        words = script_words(sp.encode, script, frame_rate=FRAME_RATE, multi_speaker=config.multi_speaker,
                             padding_between=1)
        assert [(list(w.tokens), w.text, w.padding) for w in words] == \
            [(e["tokens"], e["text"], e["padding"]) for e in entries]


def test_tokenizer_pieces_equal_the_references():
    sp = _tokenizer("distilled")
    expected = json.loads((FIXTURES / "tokenizer_words.json").read_text())
    assert {word: sp.encode(word) for word in expected} == expected


def test_state_machine_rules():
    machine = TextMachine(text_card=10, second_stream_ahead=0, max_padding=3, initial_padding=1)
    state = machine.new_state([Word((5, 6), "ab", padding=2), Word((), "", padding=2), Word((7,), "c")])
    fed = [machine.step(step, state, token) for step, token in enumerate(
        [NEW_WORD, NEW_WORD, NEW_WORD, PAD, NEW_WORD, 9, PAD, NEW_WORD, NEW_WORD, PAD, PAD, PAD, NEW_WORD])]
    # 0: the initial padding; 1: the word asked for, taken (its tokens fed at 2 and 3, padding
    # forced meanwhile); 4: the pause taken, read as padding, forcing two frames; 5: an id other
    # than new word is padding; 6: max_padding reached, a new word is forced (the last one);
    # 8: the model asks past the last word: the end; after it, padding only.
    assert fed == [PAD, NEW_WORD, 5, 6, PAD, PAD, NEW_WORD, 7, PAD, PAD, PAD, PAD, PAD]
    assert state.consumed_at == [1, 4, 6] and state.transcript == [("ab", 1), ("c", 6)]
    assert state.end_step == 8


def test_an_open_queue_waits_for_words_and_ends_only_when_closed():
    machine = TextMachine(text_card=10, max_padding=2, initial_padding=0)
    state = machine.new_state([Word((5,), "a")], open=True)
    fed = [machine.step(step, state, NEW_WORD) for step in range(6)]
    assert fed[:2] == [NEW_WORD, 5] and state.end_step is None  # asked past the last word: waits
    state.add_words([Word((6,), "b")])
    fed.append(machine.step(6, state, NEW_WORD))
    assert fed[-1] == NEW_WORD and state.transcript[-1] == ("b", 6)
    state.close()
    for step in range(7, 12):
        machine.step(step, state, NEW_WORD)
    assert state.end_step is not None


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(max(1, torch.get_num_threads()))
    return {variant: _model(variant) for variant in ("distilled", "plain")}


@pytest.mark.parametrize("name", CASES)
def test_greedy_generation_equals_the_references(name, models):
    case = _case(name)
    variant = case["checkpoint"]
    config, model = models[variant]
    sp = _tokenizer(variant)
    settings = case["settings"]
    words = [script_words(sp.encode, script, frame_rate=FRAME_RATE, multi_speaker=config.multi_speaker,
                          padding_between=1) for script in case["script"]]
    speakers = [[_voice(variant, name) for name in _names(voices)] for voices in case["voices"]]
    directory = FIXTURES / "cases" / name
    text_logits = np.load(directory / "text_logits.npy")
    depth_logits = np.load(directory / "depth_logits.npy")
    result = generate_dense(model, words, speakers, cfg_coef=settings["cfg_coef"], codebooks=settings["n_q"],
                            padding_bonus=settings["padding_bonus"], keep_text_logits=len(text_logits),
                            keep_depth_logits=len(depth_logits))
    np.testing.assert_allclose(torch.stack(result.text_logits).numpy(), text_logits, atol=1e-4, rtol=0)
    assert result.depth_steps == case["depth_logit_steps"]
    np.testing.assert_allclose(torch.stack(result.depth_logits).numpy(), depth_logits, atol=1e-4, rtol=0)
    assert [[list(pair) for pair in item] for item in result.text_tokens] == \
        np.load(directory / "text_tokens.npy").tolist()
    assert result.end_steps == case["end_steps"]
    assert result.consumed_at == case["consumption_times"]
    assert [[list(pair) for pair in item] for item in result.transcripts] == case["transcripts"]
    np.testing.assert_array_equal(result.frames.numpy(), np.load(directory / "frames.npy"))
