"""Voices over HTTP (POST /v1/audio/voices with a multipart form, DELETE /v1/audio/voices/{name})
against a real server: the gRPC registration's limits, errors and admin tokens, in OpenAI's shape."""

from __future__ import annotations

import httpx
import pytest

from audio_pipeline.service.auth import AuthTokens
from audio_pipeline.testing.background import BackgroundServer
from helpers import TRANSCRIPT, make_config, recording, wait_idle

#: Real servers and whole voices: left out of the quick subset (scripts/test.sh -m "not slow").
pytestmark = pytest.mark.slow

CLIENT, ADMIN = "client-token-0123456789", "admin-token-0123456789"


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    running = BackgroundServer(make_config(tiny_model_dir, "limits.max_message_bytes=200000",
                                           voices_dir=str(tmp_path_factory.mktemp("voices"))), http_port=0).start()
    yield running
    wait_idle(running.engine)
    running.stop()


def register(server, name="me", audio=None, transcript=TRANSCRIPT, headers=None, **extra):
    files = {"file": ("me.wav", recording() if audio is None else audio, "audio/wav")} if audio is not False else None
    data = {"name": name, "transcript": transcript, **extra}
    return httpx.post(f"{server.http_url}/v1/audio/voices", data=data, files=files, headers=headers, timeout=120)


def test_a_voice_registered_over_http_is_listed_speaks_and_is_deleted(server):
    response = register(server, "http-voice", description="made over HTTP")
    assert response.status_code == 201, response.text
    assert response.json() == {"name": "http-voice", "description": "made over HTTP", "language": "en-US",
                               "registered": True}
    listed = httpx.get(f"{server.http_url}/v1/audio/voices", timeout=30).json()["voices"]
    assert {"name": "http-voice", "registered": True}.items() <= next(
        v for v in listed if v["name"] == "http-voice").items()
    spoken = httpx.post(f"{server.http_url}/v1/audio/speech", timeout=120,
                        json={"model": "tts", "input": "Hello.", "voice": "http-voice", "response_format": "pcm"})
    assert spoken.status_code == 200 and spoken.content
    assert server.engine.voice_catalogue.store.get("http-voice").prompt.transcript == TRANSCRIPT
    again = register(server, "http-voice")
    assert again.status_code == 409 and again.json()["error"]["param"] == "name"
    deleted = httpx.delete(f"{server.http_url}/v1/audio/voices/http-voice", timeout=30)
    assert deleted.status_code == 200 and deleted.json() == {"name": "http-voice", "deleted": True}
    gone = httpx.delete(f"{server.http_url}/v1/audio/voices/http-voice", timeout=30)
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "name"


@pytest.mark.parametrize("fields, status, param", [
    (dict(name="Bad Name!"), 400, "name"),
    (dict(audio=False), 400, "file"),
    (dict(transcript=""), 400, "transcript"),
    (dict(audio=b"not audio at all"), 400, "file"),
    (dict(audio=b"\0" * 300_000), 413, "body"),
    (dict(name="tara"), 409, "name"),  # a preset voice's name
])
def test_bad_registrations_are_refused_naming_the_form_field(server, fields, status, param):
    response = register(server, **fields)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]
    assert server.engine.voice_catalogue.store.get("Bad Name!") is None


def test_with_admin_tokens_only_an_admin_registers_or_deletes(tiny_model_dir, tmp_path):
    running = BackgroundServer(make_config(tiny_model_dir, voices_dir=str(tmp_path / "voices")), http_port=0,
                               auth=AuthTokens(frozenset({CLIENT}), frozenset({ADMIN}))).start()
    try:
        assert register(running, "guarded").status_code == 401
        denied = register(running, "guarded", headers={"Authorization": f"Bearer {CLIENT}"})
        assert denied.status_code == 403 and denied.json()["error"]["code"] == "permission_denied"
        assert register(running, "guarded", headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 201
        url = f"{running.http_url}/v1/audio/voices/guarded"
        assert httpx.delete(url, headers={"Authorization": f"Bearer {CLIENT}"}, timeout=30).status_code == 403
        assert httpx.delete(url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30).status_code == 200
        listed = httpx.get(f"{running.http_url}/v1/audio/voices", headers={"Authorization": f"Bearer {CLIENT}"},
                           timeout=30)
        assert listed.status_code == 200  # listing is a client's
    finally:
        running.stop()
