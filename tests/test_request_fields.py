"""Request fields over the three front doors of a real server on the built-in voice: a ``language``
in any usual spelling of the model's language (or auto) is served and another is refused the same
way over HTTP (the ``openai`` package), gRPC and the WebSocket; the HTTP door names unknown fields
beside the known ones it spoke past (X-Ignored-Fields); and no error a client reads names the
server's internals (layouts, families, Python classes)."""

from __future__ import annotations

import re

import grpc
import httpx
import numpy as np
import openai
import pytest

from audio_pipeline.errors import InvalidArgument
from audio_pipeline.layouts.registry import available_families
from helpers import make_config, scratch_voices_dir, socket_session

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


def grpc_speech(server, text=TEXT, **options):
    from audio_pipeline_client import TTSClient

    with TTSClient(server.target, timeout=120) as grpc_client:
        return grpc_client.synthesize(text, seed=SEED, **options).samples


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


# --- no internal names in errors -------------------------------------------------------------------

def internal_names(message: str) -> list[str]:
    """What a user-facing error must not say: the word layout, a family's or an audio decoder's
    registered name, a Python class."""
    from audio_pipeline.decoders.registry import available_audio_decoders

    found = [word for word in ("layout", "<class", "traceback") if word in message.lower()]
    found += [name for name in available_families() if re.search(rf"\b{re.escape(name)}\b", message.lower())]
    found += [name for name in available_audio_decoders() if f"'{name}'" in message.lower()]
    found += re.findall(r"\b[A-Z][a-z]+[A-Z][A-Za-z]*\b", message)  # InvalidArgument, PhonemeLPCLayout
    return found


HTTP_BAD = [
    {"model": "tts-1", "input": TEXT, "language": "fr"},
    {"model": "tts-1", "input": TEXT, "language": "Klingon"},
    {"model": "tts-1", "input": TEXT, "language": 7},
    {"model": "tts-1", "input": TEXT, "speed": 9},
    {"model": "tts-1", "input": TEXT, "voice": "nobody"},
    {"model": "tts-1", "input": TEXT, "response_format": "wma"},
    {"model": "tts-1", "input": ""},
    {"model": "tts-1", "input": TEXT, "sample_rate": 5},
    {"model": "tts-1", "input": TEXT, "seed": "x"},
    {"model": "tts-1", "input": "<speak><prosody rate='9'>Hi</prosody></speak>"},
    {"model": "tts-1", "input": "<speak><bogus/></speak>"},
    {"model": "tts-1", "input": TEXT, "pronunciations": [{"word": "hi", "phonemes": "Ж"}]},
    {"model": "tts-1", "input": TEXT, "pronunciations": "nope"},
    [1, 2],
]


def wav_bytes(seconds: float = 1.0, rate: int = 16000) -> bytes:
    import io

    import soundfile as sf

    buffer = io.BytesIO()
    t = np.arange(int(seconds * rate)) / rate
    sf.write(buffer, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), rate, format="WAV")
    return buffer.getvalue()


def test_bad_requests_never_name_the_servers_internals(idle):
    from audio_pipeline_client._proto import tts_pb2, tts_pb2_grpc

    messages = []
    for body in HTTP_BAD:
        response = httpx.post(f"{idle.http_url}/v1/audio/speech", json=body, timeout=60)
        assert response.status_code in (400, 404), (body, response.text)
        messages.append(response.json()["error"]["message"])
    response = httpx.post(f"{idle.http_url}/v1/audio/speech", content=b"{nope", timeout=60)
    messages.append(response.json()["error"]["message"])
    with grpc.insecure_channel(idle.target) as channel:
        stub = tts_pb2_grpc.TextToSpeechStub(channel)
        reference = tts_pb2.VoiceReference(audio=wav_bytes(), transcript="Hello.")
        unreadable = tts_pb2.VoiceReference(audio=b"RIFF-not-audio", transcript="Hello.")
        bad = [tts_pb2.SynthesizeRequest(text=TEXT, language="fr"),
               tts_pb2.SynthesizeRequest(text=TEXT, reference=reference),  # the built-in voice clones nothing
               tts_pb2.SynthesizeRequest(text=TEXT, reference=unreadable),
               tts_pb2.SynthesizeRequest(text=TEXT, speed=9),
               tts_pb2.SynthesizeRequest(text=TEXT, sampling=tts_pb2.SamplingParams(stop_token_ids=[10**9])),
               tts_pb2.SynthesizeRequest(text=TEXT, encoding=99)]
        for request in bad:
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Synthesize(request, timeout=60))
            assert refused.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
            messages.append(refused.value.details())
        with pytest.raises(grpc.RpcError) as refused:
            stub.RegisterVoice(tts_pb2.RegisterVoiceRequest(name="mine", reference=reference), timeout=60)
        messages.append(refused.value.details())
    received, _ = socket_session(idle, [{"type": "start", "context_id": "a", "language": "fr"},
                                        {"type": "start", "context_id": "b", "speed": "fast"},
                                        {"type": "dance", "context_id": "c"}], until_done=3)
    messages += [e["message"] for e in received if e["type"] == "error"]
    assert len(messages) == len(HTTP_BAD) + 1 + 7 + 3
    assert {message: internal_names(message) for message in messages if internal_names(message)} == {}


def test_a_single_speed_models_refusals_name_no_layout(tiny_model_dir):
    """The messages a model that speaks at one speed (the tiny Orpheus-layout model) refuses with,
    in process: a speed, an SSML rate."""
    from audio_pipeline.service.engine import TTSEngine
    from audio_pipeline.service.prepare import RequestPreparer

    engine = TTSEngine(make_config(tiny_model_dir))
    preparer = RequestPreparer(engine)
    messages = []
    with pytest.raises(InvalidArgument) as refused:
        engine.create_context("Hello.", speed=2.0)
    messages.append(str(refused.value))
    with pytest.raises(InvalidArgument) as refused:
        preparer.check_rates(preparer.resolve_settings(), [1.5])
    messages.append(str(refused.value))
    with pytest.raises(InvalidArgument) as refused:
        engine.create_context("Hello.", language="de")
    messages.append(str(refused.value))
    rate = ("text: SSML <prosody rate>: this model speaks at one speed; a request's speed time-stretches the "
            "whole stream instead")
    assert messages == ["speed: this model speaks at one speed: only 1.0 is supported", rate,
                        "language: 'de' (German) is not a language this model speaks; supported: English (en), or auto"]
