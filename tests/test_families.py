"""A model family is one declaration (layouts/registry.py): the built-in ones are found by name and
by their checkpoints, and a family registered by nothing but its record is served end to end."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pytest

from audio_pipeline.config import AudioGenerationConfig
from audio_pipeline.layouts.base import Layout
from audio_pipeline.layouts.manifest import MANIFEST_NAME, ModelManifest
from audio_pipeline.layouts.orpheus import OrpheusLayout
from audio_pipeline.layouts.registry import (DEFAULT_FAMILY, Family, available_families, detect_family, get_family,
                                             register_family)
from audio_pipeline.layouts.voice_info import VoiceInfo
from helpers import make_config


def test_every_builtin_family_is_declared_with_a_layout():
    assert {"orpheus", "maya1", "csm", "neutts", "phoneme-lpc", "phoneme-lpc-frame"} <= set(available_families())
    for name in available_families():
        family = get_family(name)
        assert family.name == name and callable(family.make_layout)
    assert get_family("csm").decoder == "mimi" and get_family("csm").streaming["block_causal"] is True
    assert get_family("neutts").sampling["top_k"] == 50
    with pytest.raises(ValueError, match=r"unsupported model family 'bark' \(supported: .*orpheus"):
        get_family("bark")


def test_a_checkpoint_without_a_manifest_is_detected_from_its_files(tmp_path):
    def checkpoint(name, config):
        directory = tmp_path / name
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps(config))
        return directory

    assert detect_family(checkpoint("a", {"model_type": "csm"})).name == "csm"
    assert detect_family(checkpoint("b", {"model_type": "llama", "_name_or_path": "maya-research/maya1"})).name == "maya1"
    assert detect_family(checkpoint("maya1-local", {"model_type": "llama"})).name == "maya1"
    assert detect_family(checkpoint("c", {"model_type": "llama"})).name == DEFAULT_FAMILY == "orpheus"
    manifest = ModelManifest.read(tmp_path / "a")
    assert (manifest.family, manifest.audio_decoder, manifest.default_voice) == ("csm", "mimi", "0")


def test_a_manifest_naming_an_unknown_family_is_refused(tmp_path):
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"family": "bark"}))
    with pytest.raises(ValueError, match=r"audio_pipeline.json: unsupported model family 'bark'"):
        ModelManifest.read(tmp_path)


def test_a_family_name_is_registered_once():
    with pytest.raises(ValueError, match="'orpheus' is already registered"):
        register_family(Family("orpheus", make_layout=lambda *_: OrpheusLayout()))


def test_the_base_layout_says_what_a_family_need_not_provide():
    layout = OrpheusLayout()
    assert isinstance(layout, Layout)
    assert (layout.requires_reference, layout.described_voices, layout.supports_speed) == (False, False, False)
    assert layout.alignment([1, 2]) is None and layout.word_frames("hi") is None
    assert layout.prompt_frames([1, 2]) is None and layout.codes_per_frame == 7


@dataclass(frozen=True)
class WhisperLayout(OrpheusLayout):
    """Orpheus's tokens with a prompt of its own: the family a third party would add."""

    def build_prompt(self, tokenizer, text, voice, reference=None, speed=1.0):
        return self.prompt_ids(tokenizer(f"(whispering, {voice}) {text}").input_ids)


WHISPER = register_family(Family(
    "test-whisper", make_layout=lambda model_dir, tokenizer, manifest: WhisperLayout(),
    voices=(VoiceInfo("ghost", "a whisper"),), default_voice="ghost",
    streaming={"chunk_size": [14, 28]}, sampling={"temperature": 0.5, "top_k": 7}))


def test_a_family_registered_by_its_record_alone_is_served(tiny_model_dir, tmp_path):
    """Nothing but the record above: its layout builds the prompt, its streaming and sampling
    defaults sit below the configuration's sources, and the engine speaks with it."""
    import shutil

    from audio_pipeline.service.engine import TTSEngine

    model_dir = tmp_path / "whisper"
    shutil.copytree(tiny_model_dir, model_dir)
    (model_dir / MANIFEST_NAME).write_text(json.dumps({"family": "test-whisper", "audio_decoder": "snac",
                                                       "audio_decoder_weights": "snac"}))
    config = AudioGenerationConfig.load(env={}, model={"model_path": str(model_dir), "device": "cpu"})
    assert config.chunk_size == [14, 28] and (config.sampling.temperature, config.sampling.top_k) == (0.5, 7)
    engine = TTSEngine(make_config(model_dir, "sampling.max_tokens=28"))
    engine.start()
    try:
        assert isinstance(engine.layout, WhisperLayout)
        assert [v.name for v in engine.voice_catalogue.listed] == ["ghost"] and engine.manifest.default_voice == "ghost"
        context = engine.create_context("Hello there.", voice="ghost", seed=1)
        assert context.prompt_ids == engine.layout.prompt_ids(engine.tokenizer("(whispering, ghost) Hello there.").input_ids)
        result = engine.synthesize("Hello there.", voice="ghost", seed=1)
        assert result.samples.size > 0 and np.isfinite(result.samples).all()
    finally:
        engine.stop()


def test_layout_options_are_the_familys_own_and_checked(tmp_path):
    """A manifest's layout_options: a family refuses those it does not declare, naming them and its
    own; Qwen3-TTS's language must be one its checkpoint knows."""
    import shutil
    from pathlib import Path

    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"family": "orpheus", "layout_options": {"bogus": 1}}))
    with pytest.raises(ValueError, match=r"unknown layout_options \['bogus'\] for the orpheus family \(known: none\)"):
        ModelManifest.read(tmp_path)
    qwen = tmp_path / "qwen"
    shutil.copytree(Path(__file__).parent / "fixtures" / "qwen3_tts" / "models" / "custom_voice", qwen)
    (qwen / MANIFEST_NAME).write_text(json.dumps({"family": "qwen3-tts", "layout_options": {"language": "klingon"}}))
    with pytest.raises(ValueError, match=r"layout_options.language 'klingon' is not one of auto, beijing_dialect"):
        ModelManifest.read(qwen).make_layout(qwen)
    (qwen / MANIFEST_NAME).write_text(json.dumps({"family": "qwen3-tts",
                                                  "layout_options": {"language": "English", "streaming_text": True}}))
    layout = ModelManifest.read(qwen).make_layout(qwen)
    assert (layout.language, layout.streaming_text) == ("english", True)
