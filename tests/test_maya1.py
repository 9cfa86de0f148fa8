"""Maya1: Orpheus's tokens and SNAC frames with a voice described in words. The prompt is the
documented one, a checkpoint without a manifest is recognised, any description is a voice (a
preset's name stands for its description), and HTTP's ``instructions`` describe the voice, on a
tiny random model written by the test and served for real."""

import json
import shutil

import numpy as np
import pytest

from audio_pipeline.layouts import orpheus
from helpers import make_config, pcm16_to_float

DESCRIPTION = "Warm adult female voice, slow pacing."


@pytest.fixture(scope="module")
def maya1_dir(tmp_path_factory):
    from audio_pipeline.testing.tiny_models import write_tiny_orpheus_model

    return write_tiny_orpheus_model(tmp_path_factory.mktemp("maya1"), seed=0, family="maya1")


@pytest.fixture(scope="module")
def engine(maya1_dir):
    from audio_pipeline.service.engine import TTSEngine

    engine = TTSEngine(make_config(maya1_dir))
    engine.start()
    yield engine
    engine.stop(0.0)


def test_the_prompt_is_the_description_then_the_text_between_orpheus_markers(engine):
    prompt = engine.create_context("Hello there.", voice=DESCRIPTION).prompt_ids
    text_ids = engine.tokenizer(f'<description="{DESCRIPTION}"> Hello there.').input_ids
    assert text_ids[0] == orpheus.BEGIN_OF_TEXT
    assert prompt == [orpheus.START_OF_HUMAN, *text_ids, orpheus.END_OF_TEXT, orpheus.END_OF_HUMAN,
                      orpheus.START_OF_AI, orpheus.START_OF_SPEECH]


def test_any_description_is_a_voice_and_a_preset_name_stands_for_its_own(engine):
    from audio_pipeline.errors import InvalidArgument
    from audio_pipeline.layouts.maya1 import PRESET_VOICES

    preset = PRESET_VOICES[1]
    named = engine.create_context("Hi.", voice=preset.name)
    described = engine.create_context("Hi.", voice=preset.description)
    assert named.prompt_ids == described.prompt_ids and named.voice == preset.description
    default = engine.create_context("Hi.")
    assert default.voice == PRESET_VOICES[0].description
    # Quotes and line breaks cannot end the description early.
    quoted = engine.create_context("Hi.", voice='A "deep"\nvoice')
    assert quoted.prompt_ids == engine.create_context("Hi.", voice="A 'deep' voice").prompt_ids
    with pytest.raises(InvalidArgument) as refused:
        engine.create_context("Hi.", voice="x" * 2000)
    assert refused.value.field == "voice"


def test_a_checkpoint_without_a_manifest_is_recognised_by_its_name(maya1_dir, tmp_path):
    from audio_pipeline.layouts.manifest import ModelManifest
    from audio_pipeline.layouts.maya1 import Maya1Layout

    bare = tmp_path / "checkpoint"
    shutil.copytree(maya1_dir, bare)
    (bare / "audio_pipeline.json").unlink()
    assert type(ModelManifest.read(bare).make_layout(bare)) is orpheus.OrpheusLayout
    config = json.loads((bare / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({**config, "_name_or_path": "maya-research/maya1"}))
    manifest = ModelManifest.read(bare)
    assert manifest.family == "maya1" and isinstance(manifest.make_layout(bare), Maya1Layout)
    assert manifest.default_voice in {v.name for v in manifest.voices}


@pytest.mark.slow
def test_http_instructions_describe_the_voice_as_grpc_voice_does(maya1_dir):
    """Through a real server: HTTP's instructions are the description (not ignored), and give the
    samples gRPC gives for that description as the voice; another description other samples."""
    import httpx

    from audio_pipeline.testing.background import BackgroundServer
    from audio_pipeline_client import TTSClient

    server = BackgroundServer(make_config(maya1_dir), http_port=0).start()
    try:
        body = {"input": "Hello there.", "instructions": DESCRIPTION, "response_format": "pcm", "seed": 5,
                "sample_rate": 24000}
        response = httpx.post(f"{server.http_url}/v1/audio/speech", json=body, timeout=120)
        assert response.status_code == 200 and "x-ignored-fields" not in response.headers
        heard = pcm16_to_float(response.content)
        with TTSClient(server.target, timeout=120) as client:
            same = client.synthesize("Hello there.", voice=DESCRIPTION, seed=5, sample_rate=24000).samples
            other = client.synthesize("Hello there.", voice="A whispering old man.", seed=5,
                                      sample_rate=24000).samples
        assert heard.size == same.size and np.abs(heard - same).max() <= 2 / 32768
        assert other.size != same.size or np.abs(other - same).max() > 0.01
    finally:
        server.stop()
