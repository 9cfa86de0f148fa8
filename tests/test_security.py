"""Security end to end: TLS, mutual TLS, bearer and admin tokens, limits on registered voices and on
messages, and where /metrics listens. Real servers on free ports, driven by the client library and
tts-client (mutual TLS by the generated stubs: the client library has no client-certificate option)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
import soundfile as sf
from grpc_health.v1 import health_pb2, health_pb2_grpc

from audio_pipeline.cli import main as audio_pipeline
from audio_pipeline.config import AudioGenerationConfig
from audio_pipeline.server.app import ServerOptions, grpc_server_options
from audio_pipeline.service.auth import AuthTokens
from audio_pipeline.testing.background import BackgroundServer
from audio_pipeline.server.tls import TLSFiles
from audio_pipeline_client import AsyncTTSClient, TTSClient, TTSError
from audio_pipeline_client._proto import tts_pb2, tts_pb2_grpc
from audio_pipeline_client.cli import main as tts_client
from audio_pipeline_client.protocol import float_to_pcm16
from certificates import CertificateAuthority
from helpers import PCM_STEP, TRANSCRIPT, free_port, listening_port, make_config, recording, wait_idle

CLIENT_TOKEN = "client-token-0123456789"
ADMIN_TOKEN = "admin-token-9876543210"
#: A second loopback address: a socket bound to 127.0.0.1 does not answer on it, and the reverse.
OTHER_LOOPBACK = "127.0.0.2"


def metrics_answer(host: str, port: int) -> bool:
    """True when http://host:port/metrics serves Prometheus text; False when nothing listens there."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as response:
            return response.status == 200 and b"tts_" in response.read()
    except (urllib.error.URLError, ConnectionError):
        return False


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(TTSError) as caught:
        call()
    return caught.value.code


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pki")
    ca = CertificateAuthority(directory)
    stranger = CertificateAuthority(directory, "stranger CA")
    return SimpleNamespace(ca=ca, server=ca.issue("server", "localhost", server=True),
                           client=ca.issue("client", "client", server=False),
                           stranger_client=stranger.issue("stranger-client", "stranger", server=False))


@pytest.fixture(scope="module")
def reference_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("reference") / "me.wav"
    path.write_bytes(recording(seconds=1.0, rate=16000))
    return path


@pytest.fixture(scope="module")
def secured(tiny_model_dir, pki, tmp_path_factory):
    """TLS, client and admin tokens, /metrics on a port of its own (its host left to follow the gRPC one)."""
    metrics_port = free_port()
    server = BackgroundServer(make_config(tiny_model_dir, voices_dir=str(tmp_path_factory.mktemp("voices"))),
                              tls=TLSFiles(str(pki.server.cert_file), str(pki.server.key_file)),
                              auth=AuthTokens(frozenset({CLIENT_TOKEN}), frozenset({ADMIN_TOKEN})),
                              metrics_port=metrics_port).start()
    server.ca, server.metrics_port = str(pki.ca.cert_file), metrics_port
    yield server
    wait_idle(server.engine)
    server.stop()


# --- TLS ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_client_trusting_the_ca_gets_audio_over_tls(secured):
    with TTSClient(secured.target, tls=secured.ca, token=CLIENT_TOKEN, timeout=120) as client:
        result = client.synthesize("Hello over TLS.", max_tokens=28, seed=1)
    assert result.usage.generated_tokens == 28
    # The engine's own speech of the request, carried unchanged by TLS.
    expected = secured.engine.synthesize("Hello over TLS.", max_tokens=28, seed=1).samples
    np.testing.assert_allclose(result.samples, expected, rtol=0, atol=PCM_STEP)


@pytest.mark.slow
def test_a_client_not_trusting_the_ca_or_speaking_plaintext_cannot_connect(secured):
    # The system roots do not know the test CA: the handshake fails, as does a plaintext channel.
    for tls in (True, False):
        with TTSClient(secured.target, tls=tls, token=CLIENT_TOKEN, timeout=10, retries=0) as client:
            assert code_of(client.list_voices) == grpc.StatusCode.UNAVAILABLE


@pytest.fixture(scope="module")
def mutual(tiny_model_dir, pki):
    """Mutual TLS: clients must present a certificate signed by the test CA. No tokens."""
    server = BackgroundServer(make_config(tiny_model_dir), tls=TLSFiles(
        str(pki.server.cert_file), str(pki.server.key_file), str(pki.ca.cert_file))).start()
    yield server
    server.stop()


def mtls_stub(target, pki, issued):
    credentials = grpc.ssl_channel_credentials(root_certificates=pki.ca.cert_file.read_bytes(),
                                               private_key=issued.key_file.read_bytes(),
                                               certificate_chain=issued.cert_file.read_bytes())
    channel = grpc.secure_channel(target, credentials)
    return channel, tts_pb2_grpc.TextToSpeechStub(channel)


@pytest.mark.slow
def test_mutual_tls_rejects_a_client_without_a_certificate(mutual, pki):
    with TTSClient(mutual.target, tls=str(pki.ca.cert_file), timeout=10, retries=0) as client:
        assert code_of(client.list_voices) == grpc.StatusCode.UNAVAILABLE


@pytest.mark.slow
def test_mutual_tls_accepts_a_certificate_of_the_ca_only(mutual, pki):
    channel, stub = mtls_stub(mutual.target, pki, pki.client)
    with channel:
        chunks = list(stub.Synthesize(tts_pb2.SynthesizeRequest(
            text="Hello, known client.", sampling=tts_pb2.SamplingParams(max_tokens=28)), timeout=120))
        assert chunks[0].HasField("format") and chunks[-1].HasField("complete")
    channel, stub = mtls_stub(mutual.target, pki, pki.stranger_client)
    with channel, pytest.raises(grpc.RpcError) as caught:
        stub.ListVoices(tts_pb2.ListVoicesRequest(), timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    wait_idle(mutual.engine)


@pytest.mark.slow
def test_the_client_library_and_cli_present_a_client_certificate(mutual, pki, tmp_path):
    """TTSClient, AsyncTTSClient and tts-client take a client certificate and key for mutual TLS."""
    ca, cert, key = str(pki.ca.cert_file), str(pki.client.cert_file), str(pki.client.key_file)
    with TTSClient(mutual.target, tls=ca, client_cert=cert, client_key=key, timeout=60) as client:
        voices = client.list_voices()
    assert [v.name for v in voices if v.is_default] == [mutual.engine.manifest.default_voice]

    async def listed():
        async with AsyncTTSClient(mutual.target, tls=ca, client_cert=cert, client_key=key, timeout=60) as client:
            return await client.list_voices()

    assert asyncio.run(listed()) == voices
    out = tmp_path / "mtls.wav"
    assert tts_client(["--server", mutual.target, "--ca-file", ca, "--cert-file", cert, "--key-file", key,
                       "--text", "Hi.", "--output", str(out), "--max-tokens", "28", "--seed", "1", "--quiet"]) == 0
    with TTSClient(mutual.target, tls=ca, client_cert=cert, client_key=key, timeout=60) as client:
        expected = client.synthesize("Hi.", max_tokens=28, seed=1).samples
    np.testing.assert_array_equal(sf.read(str(out), dtype="int16")[0], float_to_pcm16(expected))
    with pytest.raises(ValueError, match="both or neither"):
        TTSClient(mutual.target, tls=ca, client_cert=cert)
    with pytest.raises(ValueError, match="needs TLS"):
        TTSClient(mutual.target, client_cert=cert, client_key=key)
    wait_idle(mutual.engine)


# --- tokens --------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_missing_or_wrong_token_is_unauthenticated_alike(secured):
    answers = []
    for token in (None, "not-a-token", CLIENT_TOKEN + "x", CLIENT_TOKEN[:-1]):
        with TTSClient(secured.target, tls=secured.ca, token=token, timeout=10, retries=0) as client:
            for call in (client.list_voices, lambda: client.synthesize("Hi.", max_tokens=7)):
                with pytest.raises(TTSError) as caught:
                    call()
                answers.append(str(caught.value))
    # One answer for all: a caller cannot tell a missing token from a wrong one, or a near miss.
    assert len(set(answers)) == 1 and answers[0].startswith("UNAUTHENTICATED:")
    assert CLIENT_TOKEN not in answers[0]


@pytest.mark.slow
def test_the_right_token_gets_audio_and_health_needs_no_token(secured):
    with TTSClient(secured.target, tls=secured.ca, timeout=30) as anonymous:
        anonymous.wait_ready(10)  # the health service answers without a token
    channel = grpc.secure_channel(secured.target, grpc.ssl_channel_credentials(Path(secured.ca).read_bytes()))
    with channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    for token in (CLIENT_TOKEN, ADMIN_TOKEN):  # an admin token passes wherever a client token does
        with TTSClient(secured.target, tls=secured.ca, token=token, timeout=120) as client:
            assert "tara" in [v.name for v in client.list_voices()]
            chunks = list(client.stream("Hello with a token.", max_tokens=28, seed=1))
        assert chunks[-1].final
        expected = secured.engine.synthesize("Hello with a token.", max_tokens=28, seed=1).samples
        np.testing.assert_allclose(np.concatenate([c.samples for c in chunks]), expected, rtol=0, atol=PCM_STEP)


@pytest.mark.slow
def test_the_async_client_sends_its_token(secured):
    async def go(token):
        async with AsyncTTSClient(secured.target, tls=secured.ca, token=token, timeout=60, retries=0) as client:
            return [v.name for v in await client.list_voices()]

    assert "tara" in asyncio.run(go(CLIENT_TOKEN))
    with pytest.raises(TTSError) as caught:
        asyncio.run(go(None))
    assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.slow
def test_only_admin_tokens_register_and_delete_voices(secured, reference_file):
    with TTSClient(secured.target, tls=secured.ca, token=CLIENT_TOKEN, timeout=120) as client, \
            TTSClient(secured.target, tls=secured.ca, token=ADMIN_TOKEN, timeout=120) as admin:
        assert code_of(lambda: client.register_voice("guarded", reference_file, TRANSCRIPT)) == \
            grpc.StatusCode.PERMISSION_DENIED
        assert admin.register_voice("guarded", reference_file, TRANSCRIPT).registered
        # A client token may speak with the voice (the recording's speech), not delete it.
        np.testing.assert_array_equal(
            client.synthesize("Hi.", voice="guarded", max_tokens=14, temperature=0.0).samples,
            admin.synthesize("Hi.", reference_audio=reference_file.read_bytes(), reference_transcript=TRANSCRIPT,
                             max_tokens=14, temperature=0.0).samples)
        assert code_of(lambda: client.delete_voice("guarded")) == grpc.StatusCode.PERMISSION_DENIED
        assert "guarded" in [v.name for v in client.list_voices()]
        admin.delete_voice("guarded")
        assert "guarded" not in [v.name for v in client.list_voices()]
    with TTSClient(secured.target, tls=secured.ca, timeout=10, retries=0) as anonymous:
        assert code_of(lambda: anonymous.delete_voice("guarded")) == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.slow
def test_tts_client_cli_with_ca_and_tokens(secured, reference_file, tmp_path, capsys, monkeypatch):
    server = ["--server", secured.target, "--ca-file", secured.ca]
    out = tmp_path / "tls.wav"
    assert tts_client([*server, "--token", CLIENT_TOKEN, "--text", "Hi.", "--output", str(out), "--max-tokens", "28",
                       "--seed", "1", "--quiet"]) == 0
    with TTSClient(secured.target, tls=secured.ca, token=CLIENT_TOKEN, timeout=120) as client:
        expected = client.synthesize("Hi.", max_tokens=28, seed=1).samples
    np.testing.assert_array_equal(sf.read(str(out), dtype="int16")[0], float_to_pcm16(expected))
    capsys.readouterr()
    assert tts_client([*server, "--text", "Hi.", "--output", str(out), "--timeout", "10"]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    register = ["register-voice", "cli-guarded", "--audio", str(reference_file), "--transcript", TRANSCRIPT, *server]
    assert tts_client([*register, "--token", CLIENT_TOKEN]) == 1
    assert "PERMISSION_DENIED" in capsys.readouterr().err
    assert tts_client([*register, "--token", ADMIN_TOKEN]) == 0
    assert "registered voice cli-guarded" in capsys.readouterr().out
    monkeypatch.setenv("AUDIO_PIPELINE_TOKEN", ADMIN_TOKEN)  # the CLI's default token
    assert tts_client(["delete-voice", "cli-guarded", *server]) == 0


@pytest.mark.slow
def test_metrics_follow_the_grpc_host_by_default(secured):
    port = secured.metrics_port
    assert metrics_answer("127.0.0.1", port)
    assert not metrics_answer(OTHER_LOOPBACK, port)


# --- limits ---------------------------------------------------------------------------------------------

LIMIT_FLAGS = ("limits.max_registered_voices=1", "limits.max_reference_audio_bytes=100000",
               "limits.max_message_bytes=200000", "limits.max_voice_name_chars=16", "limits.max_description_chars=20")


@pytest.fixture(scope="module")
def limited(tiny_model_dir, tmp_path_factory):
    """Plaintext, no tokens, tight limits, /metrics on another address than gRPC."""
    voices = tmp_path_factory.mktemp("limited-voices")
    metrics_port = free_port(OTHER_LOOPBACK)
    server = BackgroundServer(make_config(tiny_model_dir, *LIMIT_FLAGS, voices_dir=str(voices)),
                              metrics_port=metrics_port, metrics_host=OTHER_LOOPBACK).start()
    server.metrics_port = metrics_port
    yield server
    wait_idle(server.engine)
    server.stop()


@pytest.mark.slow
def test_the_registered_voice_count_is_limited(limited, reference_file):
    with TTSClient(limited.target, timeout=120) as client:
        client.register_voice("first", reference_file, TRANSCRIPT)
        with pytest.raises(TTSError) as full:
            client.register_voice("second", reference_file, TRANSCRIPT)
        assert full.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "limits.max_registered_voices=1" in full.value.details
        client.delete_voice("first")  # room again
        client.register_voice("second", reference_file, TRANSCRIPT)
        client.delete_voice("second")


@pytest.mark.slow
def test_the_bytes_of_registered_voices_are_limited(tiny_model_dir, tmp_path, reference_file):
    voices = tmp_path / "voices"
    with BackgroundServer(make_config(tiny_model_dir, "limits.max_registered_voice_bytes=2000",
                                      voices_dir=str(voices))) as server, \
            TTSClient(server.target, timeout=120) as client:
        with pytest.raises(TTSError) as full:
            client.register_voice("big", reference_file, TRANSCRIPT)
        assert full.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "limits.max_registered_voice_bytes=2000" in full.value.details
        assert "big" not in [v.name for v in client.list_voices()]
    assert list(voices.iterdir()) == []  # nothing left behind, not even the staging directory


@pytest.mark.slow
def test_names_descriptions_and_recordings_over_their_limits_are_invalid(limited, reference_file):
    huge = "a" * 100_000
    with TTSClient(limited.target, timeout=60) as client:
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        cases = [
            (lambda: client.register_voice(huge, reference_file, TRANSCRIPT), invalid, "name: 100000 characters"),
            (lambda: client.register_voice("b" * 17, reference_file, TRANSCRIPT), invalid,
             "limits.max_voice_name_chars"),
            (lambda: client.register_voice("Bad Name!", reference_file, TRANSCRIPT), invalid,
             "not a valid voice name"),
            (lambda: client.register_voice("ok", reference_file, TRANSCRIPT, description="d" * 21), invalid,
             "limits.max_description_chars"),
            (lambda: client.register_voice("ok", recording(seconds=4.0), TRANSCRIPT), invalid,
             "limits.max_reference_audio_bytes"),
            (lambda: client.synthesize("Hi.", reference_audio=recording(seconds=4.0), reference_transcript=TRANSCRIPT),
             invalid, "limits.max_reference_audio_bytes"),
            (lambda: client.delete_voice(huge), grpc.StatusCode.NOT_FOUND, "no registered voice named 'aaaa"),
        ]
        for call, code, words in cases:
            with pytest.raises(TTSError) as caught:
                call()
            assert caught.value.code == code and words in caught.value.details
            assert len(caught.value.details) < 300  # a huge client string is never echoed back in full
        # Over limits.max_message_bytes, gRPC refuses the message before it is decoded.
        assert code_of(lambda: client.register_voice("ok", recording(seconds=8.0), TRANSCRIPT)) == \
            grpc.StatusCode.RESOURCE_EXHAUSTED
        assert [v.name for v in client.list_voices() if v.registered] == []


@pytest.mark.slow
def test_metrics_listen_on_the_metrics_host_only(limited):
    port = limited.metrics_port
    assert metrics_answer(OTHER_LOOPBACK, port)
    assert not metrics_answer("127.0.0.1", port)


def test_connection_limits_come_from_the_config():
    config = AudioGenerationConfig.load(env={}, audio_flags=["limits.max_concurrent_streams=7",
                                                             "limits.max_message_bytes=4096"])
    options = dict(grpc_server_options(config))
    assert options["grpc.max_concurrent_streams"] == 7 and options["grpc.max_receive_message_length"] == 4096
    assert ServerOptions(host="10.1.2.3").metrics_bind_host == "10.1.2.3"
    assert ServerOptions(host="[::]").metrics_bind_host == "::"
    assert ServerOptions(host="0.0.0.0", metrics_host="127.0.0.1").metrics_bind_host == "127.0.0.1"


# --- token sources and start-up errors ---------------------------------------------------------------------

def test_tokens_come_from_files_and_the_environment_together(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("# client tokens\n\n  file-token  \n#not-a-token\nsecond-token\n")
    auth = AuthTokens.load(str(tokens), None, environ={"AUDIO_PIPELINE_AUTH_TOKENS": "env-a, env-b,",
                                                       "AUDIO_PIPELINE_ADMIN_TOKENS": "boss"})
    assert auth.client == {"file-token", "second-token", "env-a", "env-b"} and auth.admin == {"boss"}
    assert not AuthTokens.load(environ={}).enabled
    # The token variables are not configuration fields: loading the configuration ignores them.
    AudioGenerationConfig.load(env={"AUDIO_PIPELINE_AUTH_TOKENS": "x", "AUDIO_PIPELINE_ADMIN_TOKENS": "y"})


@pytest.mark.parametrize("make_args, words", [
    (lambda p: ["--tls-cert-file", str(p.server.cert_file)], "--tls-cert-file needs --tls-key-file"),
    (lambda p: ["--tls-key-file", str(p.server.key_file)], "--tls-key-file needs --tls-cert-file"),
    (lambda p: ["--tls-client-ca-file", str(p.ca.cert_file)], "needs --tls-cert-file and --tls-key-file"),
    (lambda p: ["--tls-cert-file", "/nonexistent/server.crt", "--tls-key-file", str(p.server.key_file)],
     "--tls-cert-file: cannot read /nonexistent/server.crt"),
    (lambda p: ["--tls-cert-file", str(p.server.cert_file), "--tls-key-file", str(p.server.key_file),
                "--tls-client-ca-file", "/nonexistent/ca.crt"], "--tls-client-ca-file: cannot read"),
    (lambda p: ["--tls-cert-file", str(p.server.cert_file), "--tls-key-file", str(p.client.key_file)],
     "is not the private key of the certificate"),
    (lambda p: ["--tls-cert-file", str(p.server.cert_file), "--tls-key-file", str(p.server.key_file),
                "--tls-client-ca-file", str(p.server.key_file)], "--tls-client-ca-file: "),
    (lambda p: ["--auth-token-file", "/nonexistent/tokens"], "--auth-token-file: cannot read /nonexistent/tokens"),
    (lambda p: ["--admin-token-file", str(p.empty_file)], "holds no token"),
], ids=["cert-only", "key-only", "ca-only", "unreadable-cert", "unreadable-ca", "mismatched-key", "key-as-ca",
        "unreadable-tokens", "empty-admin"])
def test_serve_reports_bad_security_flags_in_one_line(tiny_model_dir, pki, tmp_path, capsys, make_args, words):
    pki.empty_file = tmp_path / "empty"
    pki.empty_file.write_text("# nothing yet\n")
    code = audio_pipeline(["serve", "--host", "127.0.0.1", "--port", "0", "--model", str(tiny_model_dir),
                           "--device", "cpu", *make_args(pki)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and words in err[0] and err[0].startswith("audio-pipeline: error:")


@pytest.mark.slow
def test_serve_command_with_tls_tokens_and_metrics_host(tiny_model_dir, pki, tmp_path, capsys):
    tokens, admins = tmp_path / "tokens", tmp_path / "admins"
    tokens.write_text(f"# clients\n{CLIENT_TOKEN}\n")
    admins.write_text(f"{ADMIN_TOKEN}\n")
    metrics_port = free_port(OTHER_LOOPBACK)
    server = subprocess.Popen([sys.executable, "-m", "audio_pipeline.cli", "serve", "--host", "127.0.0.1",
                               "--port", "0", "--model", str(tiny_model_dir), "--device", "cpu",
                               "--task-arg", "chunk_size=28", "--metrics-port", str(metrics_port),
                               "--metrics-host", OTHER_LOOPBACK, "--tls-cert-file", str(pki.server.cert_file),
                               "--tls-key-file", str(pki.server.key_file), "--auth-token-file", str(tokens),
                               "--admin-token-file", str(admins), "--task-arg", f"voices_dir={tmp_path / 'v'}"],
                              stderr=subprocess.PIPE, text=True)
    try:
        port = listening_port(server)
        connection = ["--server", f"127.0.0.1:{port}", "--ca-file", str(pki.ca.cert_file), "--wait-ready", "120"]
        out = tmp_path / "served.wav"
        assert tts_client([*connection, "--token", CLIENT_TOKEN, "--text", "Hi.", "--output", str(out),
                           "--max-tokens", "14", "--seed", "1", "--quiet"]) == 0, capsys.readouterr().err
        with TTSClient(f"127.0.0.1:{port}", tls=str(pki.ca.cert_file), token=CLIENT_TOKEN, timeout=120) as client:
            expected = client.synthesize("Hi.", max_tokens=14, seed=1).samples
        assert expected.size == 2 * 2048  # 14 tokens: two SNAC frames
        np.testing.assert_array_equal(sf.read(str(out), dtype="int16")[0], float_to_pcm16(expected))
        assert tts_client([*connection, "--token", "guess", "--text", "Hi.", "--output", str(out)]) == 1
        assert "UNAUTHENTICATED" in capsys.readouterr().err
        assert tts_client(["delete-voice", "nobody", *connection, "--token", CLIENT_TOKEN]) == 1
        assert "PERMISSION_DENIED" in capsys.readouterr().err
        assert tts_client(["delete-voice", "nobody", *connection, "--token", ADMIN_TOKEN]) == 1
        assert "NOT_FOUND" in capsys.readouterr().err
        assert metrics_answer(OTHER_LOOPBACK, metrics_port) and not metrics_answer("127.0.0.1", metrics_port)
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        server.stderr.close()
