"""Request fields over the three front doors of a real server on the built-in voice: a ``language``
in any usual spelling of the model's language (or auto) is served and another is refused the same
way over HTTP (the ``openai`` package), gRPC and the WebSocket; the HTTP door names unknown fields
beside the known ones it spoke past (X-Ignored-Fields)."""

from __future__ import annotations

import json

import grpc
import httpx
import numpy as np
import openai
import pytest

from conftest import scratch_voices_dir, wait_idle

#: Real servers: left out of the quick subset (scripts/test.sh -m "not slow").
pytestmark = pytest.mark.slow

TEXT = "Hi there."
SEED = 3
REFUSED = ("language: 'fr' (French) is not a language this model speaks; supported: English (en-US), or auto")


@pytest.fixture(scope="module")
def server():
    from audio_pipeline.config import AudioGenerationConfig
    from audio_pipeline.testing.background import BackgroundServer

    # The default model: the built-in voice (US English).
    config = AudioGenerationConfig.load(env={}, model={"device": "cpu"}, voices_dir=scratch_voices_dir())
    server = BackgroundServer(config, http_port=0).start()
    yield server
    server.stop()


@pytest.fixture
def idle(server):
    wait_idle(server.engine)
    yield server
    wait_idle(server.engine)


@pytest.fixture
def client(idle):
    with openai.OpenAI(base_url=f"{idle.http_url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def grpc_speech(server, text=TEXT, **options):
    from audio_pipeline_client import TTSClient

    with TTSClient(server.target, timeout=120) as grpc_client:
        return grpc_client.synthesize(text, seed=SEED, **options).samples


def socket_session(server, messages, *, until_done=1, timeout=120):
    """Sends ``messages`` over /v1/audio/stream; (JSON messages, binary frames by context) until
    ``until_done`` utterances have finished (done, interrupted or error)."""
    from websockets.sync.client import connect

    received, audio, current, finished = [], {}, None, 0
    with connect(f"ws://127.0.0.1:{server.http_port}/v1/audio/stream", open_timeout=30) as socket:
        for message in messages:
            socket.send(json.dumps(message))
        while finished < until_done:
            frame = socket.recv(timeout=timeout)
            if isinstance(frame, bytes):
                audio.setdefault(current, []).append(frame)
                continue
            event = json.loads(frame)
            received.append(event)
            current = event["context_id"] if event["type"] == "started" else current
            finished += event["type"] in ("done", "interrupted", "error")
    return received, {k: b"".join(v) for k, v in audio.items()}


def pcm(samples: np.ndarray) -> np.ndarray:
    return np.frombuffer(np.clip(np.round(samples * 32767), -32768, 32767).astype("<i2").tobytes(), "<i2")


# --- language --------------------------------------------------------------------------------------

def test_the_voices_listing_and_the_languages_agree(idle):
    voices = httpx.get(f"{idle.http_url}/v1/audio/voices", timeout=30).json()["voices"]
    assert {v["language"] for v in voices} == {"en-US"}
    assert idle.engine.languages.entries == ("en-US",)


@pytest.mark.parametrize("language", ["English", "english", "en", "EN", "eng", "en-US", "en_GB", "Auto", "auto"])
def test_every_spelling_of_the_models_language_is_served_over_every_door(client, idle, language):
    """The same speech as a request without a language (the same seed), over HTTP (the openai
    package), gRPC and the WebSocket."""
    plain = grpc_speech(idle)
    np.testing.assert_array_equal(grpc_speech(idle, language=language), plain)
    response = client.audio.speech.create(model="tts-1", voice="slt-en", input=TEXT, response_format="pcm",
                                          extra_body={"language": language, "seed": SEED,
                                                      "sample_rate": idle.engine.sample_rate})
    assert "x-ignored-fields" not in response.response.headers
    heard = np.frombuffer(response.content, "<i2")
    np.testing.assert_allclose(heard, pcm(plain), atol=1)
    received, audio = socket_session(idle, [{"type": "start", "context_id": "a", "input": TEXT, "language": language,
                                             "seed": SEED, "sample_rate": idle.engine.sample_rate}])
    assert [e["type"] for e in received if e["type"] != "words"] == ["started", "done"]
    np.testing.assert_allclose(np.frombuffer(audio["a"], "<i2"), pcm(plain), atol=1)


def test_another_language_is_refused_alike_over_every_door(client, idle):
    from audio_pipeline_client._proto import tts_pb2, tts_pb2_grpc

    with pytest.raises(openai.BadRequestError) as http:
        client.audio.speech.create(model="tts-1", voice="slt-en", input=TEXT, extra_body={"language": "fr"})
    assert http.value.status_code == 400
    assert http.value.body == {"message": REFUSED, "type": "invalid_request_error", "param": "language",
                               "code": None}
    with grpc.insecure_channel(idle.target) as channel, pytest.raises(grpc.RpcError) as refused:
        list(tts_pb2_grpc.TextToSpeechStub(channel).Synthesize(tts_pb2.SynthesizeRequest(text=TEXT, language="fr"),
                                                                timeout=60))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and refused.value.details() == REFUSED
    received, _ = socket_session(idle, [
        {"type": "start", "context_id": "whole", "input": TEXT, "language": "fr"},
        {"type": "start", "context_id": "live", "language": "fr"},  # live text: refused at its start
        {"type": "start", "context_id": "next", "input": TEXT, "language": "en-US"},  # the connection goes on
    ], until_done=3)
    errors = [e for e in received if e["type"] == "error"]
    assert [(e["context_id"], e["param"], e["message"]) for e in errors] == [("whole", "language", REFUSED),
                                                                            ("live", "language", REFUSED)]
    assert ("done", "next") in [(e["type"], e["context_id"]) for e in received]


# --- unknown fields --------------------------------------------------------------------------------

def test_unknown_fields_are_named_beside_the_known_ones_spoken_past(client, idle):
    response = client.audio.speech.create(model="tts-1", voice="alloy", input=TEXT, response_format="pcm",
                                          extra_body={"speeed": 2, "sead": 3})
    assert response.response.headers["x-ignored-fields"] == "voice=alloy, speeed, sead"
    # Every known field acted on: no header.
    response = client.audio.speech.create(model="tts-1", voice="slt-en", input=TEXT, response_format="wav",
                                          speed=1.5, extra_body={"seed": 3, "normalize_text": True,
                                                                 "language": "en", "stream": False, "ssml": False})
    assert "x-ignored-fields" not in response.response.headers
    # Odd names come JSON-quoted (no forged headers); many are counted past the first 16.
    odd = {"a\r\nX-Forged: 1": 1, "naïve": 2, **{f"f{i}": i for i in range(20)}}
    response = httpx.post(f"{idle.http_url}/v1/audio/speech", timeout=60,
                          json={"model": "tts-1", "input": TEXT, "response_format": "pcm", **odd})
    assert response.status_code == 200 and "x-forged" not in response.headers
    assert response.headers["x-ignored-fields"] == ", ".join(
        ['"a\\r\\nX-Forged: 1"', '"na\\u00efve"', *(f"f{i}" for i in range(14)), "+6 more"])
