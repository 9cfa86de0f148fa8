"""The HTTP front door over a real server (gRPC and HTTP on the same engine), spoken to with the
official ``openai`` package and httpx: every response format decodes to the expected audio,
streaming gives audio before the synthesis ends, SSE carries all of it, a client that leaves frees
its request, and bad requests get OpenAI-shaped errors."""

import base64
import io
import json

import httpx
import numpy as np
import openai
import pytest

from helpers import PCM_STEP, make_config, pcm16, pcm16_to_float, socket_session, wait_idle

#: Real servers and whole voices: left out of the quick subset (scripts/test.sh -m "not slow").
pytestmark = pytest.mark.slow

TEXT = "Hello there, world."


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    from audio_pipeline.testing.background import BackgroundServer

    # top_k: the tiny random model's next-token distribution is nearly flat over 4096 codes, so
    # top_p sampling lands near a boundary between near-equal candidates often enough that the
    # last-bit differences of another batch's logits change a draw in a long text; from 50
    # candidates that is rare enough for the tests comparing one request's runs.
    server = BackgroundServer(make_config(tiny_model_dir, "max_queue_size_tg=64", "sampling.top_k=50",
                                          model={"served_model_name": "tiny-tts"}), http_port=0).start()
    yield server
    server.stop()


def grpc_result(server, text=TEXT, **options):
    """The same speech through gRPC (the client's SynthesisResult)."""
    from audio_pipeline_client import TTSClient

    with TTSClient(server.target, timeout=120) as grpc_client:
        return grpc_client.synthesize(text, **options)


def grpc_samples(server, text=TEXT, **options):
    """The same speech through gRPC: float samples (24 kHz unless ``sample_rate`` says otherwise)."""
    return grpc_result(server, text, **options).samples


def decode(data: bytes, response_format: str):
    """(float samples, rate) of an encoded response."""
    import av

    if response_format == "pcm":
        return pcm16_to_float(data), 24000
    with av.open(io.BytesIO(data)) as container:
        frames = [f for f in container.decode(audio=0)]
    samples = np.concatenate([f.to_ndarray().reshape(-1) for f in frames]).astype(np.float32)
    if frames[0].format.name.startswith("s16"):
        samples /= 32768
    return samples, frames[0].sample_rate


def decode_g711(data: bytes, name: str, rate: int = 8000) -> np.ndarray:
    """G.711 bytes decoded by FFmpeg (PyAV), not by the code under test."""
    import av

    with av.open(io.BytesIO(data), format=name, options={"sample_rate": str(rate), "ch_layout": "mono"}) as container:
        return np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(audio=0)]) / 32768


def assert_g711_copy(decoded: np.ndarray, pcm: np.ndarray) -> None:
    """G.711 keeps about 3 % of a sample's magnitude (4 bits of mantissa), and a step near silence."""
    assert decoded.size == pcm.size
    assert np.all(np.abs(decoded - pcm) <= 0.035 * np.abs(pcm) + 2e-3)


#: The band where MP3 (64 kbit/s), AAC and Opus keep the waveform of this model's noise-like
#: speech: above it they code it by its energy, below it Opus drops the DC it sits on.
CODEC_BAND_HZ = (100, 4000)
#: Longest codec delay looked for (LAME adds 1105 samples at 24 kHz, FFmpeg's AAC 1024).
MAX_CODEC_DELAY = 2400


def lossy_snr(decoded: np.ndarray, rate: int, reference: np.ndarray) -> float:
    """SNR (dB) of a lossy codec's decoded audio against the 24 kHz ``reference`` speech, in
    CODEC_BAND_HZ, once the codec's delay is skipped (found by cross-correlation). The decoded
    audio must hold all of the reference after its delay."""
    from scipy import signal

    if rate != 24000:  # Opus decodes at 48 kHz: back to the speech's rate (an independent resampler)
        decoded = signal.resample_poly(decoded.astype(np.float64), 24000, rate)
    band = signal.butter(6, CODEC_BAND_HZ, "bandpass", fs=24000, output="sos")
    heard, spoken = signal.sosfiltfilt(band, decoded), signal.sosfiltfilt(band, reference.astype(np.float64))
    correlation = signal.correlate(heard, spoken, mode="full", method="fft")[spoken.size - 1:]
    delay = int(np.argmax(correlation[:MAX_CODEC_DELAY + 1]))
    heard = heard[delay:delay + spoken.size]
    assert heard.size == spoken.size, f"{spoken.size - heard.size} samples of the speech are missing"
    edge = spoken.size // 20  # the band filter's and the codec's start and end transients
    heard, spoken = heard[edge:-edge], spoken[edge:-edge]
    return float(10 * np.log10(np.sum(spoken ** 2) / np.sum((heard - spoken) ** 2)))


#: Lowest SNR in CODEC_BAND_HZ of each lossy codec's copy of the speech (measured: MP3 and Opus
#: about 14 dB, AAC about 10 dB).
MIN_SNR_DB = {"mp3": 11.0, "opus": 11.0, "aac": 8.0}


def assert_lossy_copy(server, decoded: np.ndarray, rate: int, name: str, seed: int, text: str = TEXT) -> None:
    """The decoded audio is the speech of ``seed``: within the codec's SNR of it, and nearer to it
    than to another seed's speech of the same text (this model's seeds differ by about 16 dB, so
    the comparison tells them apart)."""
    own = lossy_snr(decoded, rate, grpc_samples(server, text, seed=seed, sample_rate=24000))
    other = lossy_snr(decoded, rate, grpc_samples(server, text, seed=seed + 1, sample_rate=24000))
    assert own >= MIN_SNR_DB[name] and own > other, (own, other)


@pytest.mark.parametrize("response_format", ["mp3", "opus", "aac", "flac", "wav", "pcm"])
def test_the_openai_package_gets_speech_in_every_format(client, idle, response_format):
    reference = grpc_samples(idle, seed=3, sample_rate=24000)
    response = client.audio.speech.create(model="tts-1", voice="alloy", input=TEXT, response_format=response_format,
                                          extra_body={"seed": 3})
    samples, rate = decode(response.content, response_format)
    assert rate == (48000 if response_format == "opus" else 24000)
    # Lossy codecs pad the start and end by a frame or two (at most ~0.1 s here).
    expected = reference.size / 24000
    assert samples.size / rate == pytest.approx(expected, abs=0.11 if response_format in ("mp3", "aac") else 0.03)
    assert response.response.headers["x-ignored-fields"] == "voice=alloy"
    if response_format in ("wav", "pcm", "flac"):  # lossless: the very samples gRPC gives
        assert samples.size == reference.size
        np.testing.assert_allclose(samples, reference, rtol=0, atol=PCM_STEP)
    else:  # lossy: gRPC's speech of the same seed, within the codec's SNR once its delay is skipped
        assert_lossy_copy(idle, samples, rate, response_format, seed=3)
    # Streamed (with_streaming_response): the same audio, piece by piece.
    with client.audio.speech.with_streaming_response.create(
            model="tts-1", voice="alloy", input=TEXT, response_format=response_format,
            extra_body={"seed": 3}) as streamed:
        pieces = list(streamed.iter_bytes())
    streamed_samples, streamed_rate = decode(b"".join(pieces), response_format)
    assert streamed_rate == rate
    np.testing.assert_array_equal(streamed_samples, samples)


def test_streamed_audio_arrives_before_the_synthesis_ends(client, idle):
    text = " ".join(["This sentence is one of several."] * 6)
    with client.audio.speech.with_streaming_response.create(model="tts-1", voice="alloy", input=text,
                                                            response_format="pcm", extra_body={"seed": 8}) as response:
        chunks = response.iter_bytes()
        first = next(chunks)
        still_running = idle.engine.core.load != (0, 0)
        rest = b"".join(chunks)
    assert first and still_running
    assert response.headers["content-type"] == "audio/pcm"
    # The pieces make up the audio of the same request answered whole (up to a rounding step:
    # a sentence's decoding shares batches with the next one's, which rounds differently).
    whole = httpx.post(f"{idle.http_url}/v1/audio/speech", timeout=120,
                       json={"model": "tts-1", "input": text, "response_format": "pcm", "seed": 8}).content
    np.testing.assert_allclose(pcm16(first + rest).astype(np.int32), pcm16(whole).astype(np.int32), rtol=0, atol=1)


def test_server_sent_events_carry_all_the_audio_then_the_usage(idle):
    body = {"model": "tts-1", "input": TEXT, "response_format": "pcm", "seed": 4}
    plain = httpx.post(f"{idle.http_url}/v1/audio/speech", json=body, timeout=120).content
    with httpx.stream("POST", f"{idle.http_url}/v1/audio/speech", json={**body, "stream_format": "sse"},
                      timeout=120) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[len("data: "):]) for line in response.iter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1)
    assert b"".join(base64.b64decode(e["audio"]) for e in events[:-1]) == plain
    done = events[-1]
    usage = grpc_result(idle, seed=4).usage  # the same request through gRPC
    assert done["type"] == "speech.audio.done"
    assert (done["usage"]["input_tokens"], done["usage"]["output_tokens"]) == (usage.prompt_tokens,
                                                                                usage.generated_tokens)
    assert done["usage"]["total_tokens"] == usage.prompt_tokens + usage.generated_tokens


def test_a_client_that_leaves_mid_stream_frees_its_request(idle):
    """``idle`` checks afterwards that no request and no KV block is left."""
    from audio_pipeline.core.stop import StopReason

    cancelled = idle.engine.core.stop_reasons[StopReason.CANCELLED]
    text = " ".join(["A long text that keeps the engine busy."] * 30)
    with httpx.stream("POST", f"{idle.http_url}/v1/audio/speech", timeout=120,
                      json={"model": "tts-1", "input": text, "response_format": "mp3"}) as response:
        next(response.iter_bytes())
        assert idle.engine.core.load != (0, 0)
    # Leaving the block closed the connection: the server cancels the synthesis (not let it finish).
    wait_idle(idle.engine)
    assert idle.engine.core.stop_reasons[StopReason.CANCELLED] > cancelled
    metrics = httpx.get(f"{idle.http_url}/metrics").text
    assert 'tts_rpc_requests_total{outcome="client_cancelled"}' in metrics


def test_mu_law_at_8_khz_round_trips_within_its_quantization_error(idle):
    import av

    body = {"model": "tts-1", "input": TEXT, "seed": 5, "sample_rate": 8000}
    pcm = pcm16_to_float(httpx.post(f"{idle.http_url}/v1/audio/speech", json={**body, "response_format": "pcm"},
                                    timeout=120).content)
    response = httpx.post(f"{idle.http_url}/v1/audio/speech", timeout=120,
                          json={"model": "tts-1", "input": TEXT, "seed": 5, "response_format": "mulaw"})
    assert response.headers["content-type"] == "audio/basic"
    with av.open(io.BytesIO(response.content), format="mulaw",
                 options={"sample_rate": "8000", "ch_layout": "mono"}) as container:
        decoded = np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(audio=0)]) / 32768
    assert decoded.size == pcm.size == len(response.content)
    # mu-law keeps about 3 % of a sample's magnitude, and a step near silence.
    assert np.all(np.abs(decoded - pcm) <= 0.035 * np.abs(pcm) + 2e-3)


@pytest.mark.parametrize("body,status,param", [
    ({"model": "tts-1", "voice": "alloy"}, 400, "input"),
    ({"model": "tts-1", "input": "Hi.", "response_format": "wma"}, 400, "response_format"),
    ({"model": "tts-1", "input": "Hi.", "speed": 9}, 400, "speed"),
    ({"model": "tts-1", "input": "Hi.", "stream_format": "websocket"}, 400, "stream_format"),
    ({"model": "tts-1", "input": "Hi.", "voice": "nobody-here"}, 404, "voice"),
    ({"model": "tts-1", "input": "x" * 200_000}, 400, "input"),
])
def test_bad_requests_get_openai_shaped_errors(client, body, status, param):
    extra = {k: v for k, v in body.items() if k not in ("model", "input", "voice")}
    with pytest.raises(openai.APIStatusError) as caught:
        client.audio.speech.create(model=body["model"], input=body.get("input", ""), voice=body.get("voice", "alloy"),
                                   extra_body=extra)
    assert caught.value.status_code == status
    error = caught.value.body
    assert error["param"] == param and error["message"] and error["type"]


def test_an_oversized_body_is_refused_with_413(idle):
    limit = idle.engine.config.limits.max_message_bytes
    response = httpx.post(f"{idle.http_url}/v1/audio/speech", timeout=60,
                          content=json.dumps({"model": "tts-1", "input": "x" * (limit + 10)}))
    assert response.status_code == 413 and response.json()["error"]["param"] == "body"


def ok_requests(base: str) -> float:
    """The server's count of requests that ended ok (its /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = [s for family in text_string_to_metric_families(httpx.get(f"{base}/metrics").text)
               for s in family.samples if s.name == "tts_rpc_requests_total" and s.labels == {"outcome": "ok"}]
    return samples[0].value if samples else 0.0


def test_models_voices_health_and_metrics(idle):
    base = idle.http_url
    models = httpx.get(f"{base}/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["object"] == "model"
    assert [m["id"] for m in models["data"]] == ["tiny-tts"]  # model.served_model_name
    voices = httpx.get(f"{base}/v1/audio/voices").json()["voices"]
    assert [v["name"] for v in voices if v["default"]] == [idle.engine.manifest.default_voice]
    assert httpx.get(f"{base}/health").json() == {"status": "serving"}
    before = ok_requests(base)
    speech = httpx.post(f"{base}/v1/audio/speech", json={"model": "tts-1", "input": "Hi.", "seed": 2,
                                                         "response_format": "wav"}, timeout=60)
    assert ok_requests(base) == before + 1  # this request, counted once
    assert speech.status_code == 200 and speech.headers["content-type"] == "audio/wav"
    samples, _ = decode(speech.content, "wav")
    np.testing.assert_allclose(samples, grpc_samples(idle, "Hi.", seed=2), rtol=0, atol=PCM_STEP)
    missing = httpx.get(f"{base}/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["message"]


def test_bearer_tokens_guard_the_http_routes_too(tiny_model_dir, tmp_path):
    from audio_pipeline.service.auth import AuthTokens
    from audio_pipeline.testing.background import BackgroundServer
    from audio_pipeline_client import TTSClient

    tokens = tmp_path / "tokens"
    tokens.write_text("secret-token\n")
    with BackgroundServer(make_config(tiny_model_dir), http_port=0,
                          auth=AuthTokens.load(str(tokens))) as server:
        with openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="wrong", max_retries=0) as wrong:
            with pytest.raises(openai.AuthenticationError):
                wrong.audio.speech.create(model="tts-1", voice="alloy", input="Hi.")
        with openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="secret-token", max_retries=0) as right:
            data = right.audio.speech.create(model="tts-1", voice="alloy", input="Hi.", response_format="wav",
                                             extra_body={"seed": 5}).content
        assert httpx.get(f"{server.http_url}/health").status_code == 200  # probes stay open
        with TTSClient(server.target, timeout=120, token="secret-token") as grpc_client:
            reference = grpc_client.synthesize("Hi.", seed=5).samples
        samples, _ = decode(data, "wav")  # the speech itself, as gRPC gives it with the token
        np.testing.assert_allclose(samples, reference, rtol=0, atol=PCM_STEP)


def test_the_websocket_speaks_two_utterances_in_order_with_word_timings(idle):
    first, second = "First one here. And more.", "Second one, there."
    received, audio = socket_session(idle, [
        {"type": "start", "context_id": "a", "seed": 1},
        {"type": "start", "context_id": "b", "seed": 2},
        {"type": "text", "context_id": "a", "text": first[:9]}, {"type": "text", "context_id": "a", "text": first[9:]},
        {"type": "text", "context_id": "b", "text": second}, {"type": "end", "context_id": "b"},
        {"type": "end", "context_id": "a"},
    ], until_done=2)
    kinds = [(e["type"], e.get("context_id")) for e in received if e["type"] != "words"]
    assert kinds == [("started", "a"), ("done", "a"), ("started", "b"), ("done", "b")]
    body = {"model": "tts-1", "response_format": "pcm"}
    for context, text, seed in (("a", first, 1), ("b", second, 2)):
        alone = httpx.post(f"{idle.http_url}/v1/audio/speech", json={**body, "input": text, "seed": seed},
                           timeout=120).content
        # The same speech as a whole-text request, up to a rounding step (utterances share batches).
        np.testing.assert_allclose(pcm16(audio[context]).astype(np.int32), pcm16(alone).astype(np.int32), atol=2)
        words = [w for e in received if e["type"] == "words" and e["context_id"] == context for w in e["words"]]
        # This model has no word alignment: one timing per sentence, pointing into the utterance's text.
        assert [w["text"] for w in words] == (["First one here.", "And more."] if context == "a" else [second])
        assert all(text[w["text_start"]:w["text_end"]] == w["text"] and w["precision"] == "segment" for w in words)


def test_an_interrupt_stops_the_current_utterance_at_once_and_the_next_goes_on(idle):
    """``idle`` checks afterwards that nothing is left running."""
    long_text = " ".join(["This is a long sentence that goes on."] * 20)
    received, audio = socket_session(idle, [
        {"type": "start", "context_id": "long"}, {"type": "text", "context_id": "long", "text": long_text},
        {"type": "interrupt", "context_id": "long"},
        {"type": "start", "context_id": "next", "seed": 3}, {"type": "text", "context_id": "next", "text": "Hello."},
        {"type": "end", "context_id": "next"},
    ], until_done=2)
    outcome = {e["context_id"]: e["type"] for e in received if e["type"] in ("done", "interrupted", "error")}
    assert outcome == {"long": "interrupted", "next": "done"}


def test_bad_websocket_messages_are_answered_naming_the_field(idle):
    received, _ = socket_session(idle, [
        {"type": "text", "context_id": "nobody", "text": "Hi."},
        {"type": "start", "context_id": "x", "response_format": "wma"},
        {"type": "dance", "context_id": "y"},
        {"type": "start"},
    ], until_done=4)
    assert [e["param"] for e in received] == ["context_id", "response_format", "type", "context_id"]


@pytest.mark.parametrize("name", ["wav", "mp3", "opus", "aac", "flac", "mulaw", "alaw"])
def test_grpc_streams_every_encoded_format(idle, name):
    """The same encoders on gRPC: the chunks' bytes joined are one file holding the speech of the
    request's seed (the very samples in WAV and FLAC, within G.711's error in mu-law and A-law,
    within the codec's SNR in the lossy formats)."""
    from audio_pipeline_client import TTSClient

    telephony = name in ("mulaw", "alaw")
    with TTSClient(idle.target, timeout=120) as grpc_client:
        reference = grpc_client.synthesize(TEXT, seed=6, sample_rate=8000 if telephony else None)
        rate = reference.sample_rate
        result = grpc_client.synthesize(TEXT, seed=6, encoding=name)
        chunks = list(grpc_client.stream(TEXT, seed=6, encoding=name))
    assert result.sample_rate == (48000 if name == "opus" else rate) and result.data
    streamed = b"".join(c.data for c in chunks[:-1])
    if name == "opus":  # each Ogg stream has its own random serial number: the same audio inside
        np.testing.assert_array_equal(decode(streamed, "opus")[0], decode(result.data, "opus")[0])
    else:
        assert streamed == result.data  # streamed = whole, byte for byte
    assert sum(c.num_samples for c in chunks[:-1]) == reference.samples.size
    if name in ("wav", "flac"):  # lossless: the samples of the PCM16 stream
        assert result.samples.size == reference.samples.size
        np.testing.assert_allclose(result.samples, reference.samples, rtol=0, atol=PCM_STEP)
    elif telephony:  # decoded by the client, and by FFmpeg
        assert_g711_copy(result.samples, reference.samples)
        assert_g711_copy(decode_g711(result.data, name), reference.samples)
    else:  # the client cannot decode AAC (PyAV can); it decodes Opus at its own 48 kHz
        decoded, decoded_rate = (decode(result.data, "aac") if name == "aac"
                                 else (result.samples, result.sample_rate))
        assert decoded.size / decoded_rate == pytest.approx(reference.duration_seconds, abs=0.11)
        assert_lossy_copy(idle, decoded, decoded_rate, name, seed=6)


def test_a_decoded_opus_result_says_the_rate_of_its_samples(idle):
    reference = grpc_result(idle, seed=6)
    result = grpc_result(idle, seed=6, encoding="opus")
    assert result.duration_seconds == pytest.approx(reference.duration_seconds, abs=0.03)


def test_the_cli_picks_the_format_from_the_output_name(idle, tmp_path):
    import subprocess
    import sys

    import av

    for name in ("out.mp3", "out.flac", "out.ulaw"):
        done = subprocess.run([sys.executable, "-m", "audio_pipeline_client.cli", "--server", idle.target,
                               "--text", TEXT, "--seed", "9", "--output", str(tmp_path / name), "--quiet"],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    with av.open(str(tmp_path / "out.mp3")) as container:
        assert container.streams.audio[0].codec_context.name.startswith("mp3")
    with av.open(str(tmp_path / "out.flac")) as container:
        assert container.streams.audio[0].codec_context.name == "flac"
    # Each file holds gRPC's speech of the seed: MP3 within its SNR, FLAC the very samples, the
    # .ulaw file 8 kHz mu-law within G.711's error.
    samples, rate = decode((tmp_path / "out.mp3").read_bytes(), "mp3")
    assert_lossy_copy(idle, samples, rate, "mp3", seed=9)
    samples, rate = decode((tmp_path / "out.flac").read_bytes(), "flac")
    assert rate == 24000
    np.testing.assert_allclose(samples, grpc_samples(idle, seed=9), rtol=0, atol=PCM_STEP)
    assert_g711_copy(decode_g711((tmp_path / "out.ulaw").read_bytes(), "mulaw"),
                     grpc_samples(idle, seed=9, sample_rate=8000))


def test_a_model_without_an_alignment_is_time_stretched_to_the_speed(idle):
    """The speech at speed 1, time-stretched (WSOLA, audio/stretch.py) by the speed."""
    from audio_pipeline.audio.stretch import TimeStretch
    from audio_pipeline_client import TTSClient

    def stretched(samples, speed):
        stretch = TimeStretch(speed, 24000)
        return np.concatenate([stretch.process(samples), stretch.finish()])

    body = {"model": "tts-1", "input": TEXT, "response_format": "pcm", "seed": 7}
    fast, _ = decode(httpx.post(f"{idle.http_url}/v1/audio/speech", json={**body, "speed": 2.0},
                                timeout=60).content, "pcm")
    with TTSClient(idle.target, timeout=60) as grpc_client:
        slow = grpc_client.synthesize(TEXT, seed=7, speed=0.5)
        normal = grpc_client.synthesize(TEXT, seed=7, encoding="float32").samples  # unrounded
    expected_fast, expected_slow = stretched(normal, 2.0), stretched(normal, 0.5)
    assert (fast.size, slow.samples.size) == (expected_fast.size, expected_slow.size) == (normal.size // 2,
                                                                                        2 * normal.size)
    np.testing.assert_allclose(fast, expected_fast, rtol=0, atol=PCM_STEP)
    np.testing.assert_allclose(slow.samples, expected_slow, rtol=0, atol=PCM_STEP)
    assert slow.words[-1].end_sample == slow.samples.size  # the sentence's timing, stretched too
    response = httpx.post(f"{idle.http_url}/v1/audio/speech", json={**body, "speed": 9}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "speed"


def test_a_full_queue_answers_429_with_retry_after_and_voices_can_be_mapped(tiny_model_dir):
    """gRPC calls fill the one batch slot and the one queue place: the HTTP door shares the
    admission and refuses with 429."""
    import time

    import grpc

    from audio_pipeline.testing.background import BackgroundServer
    from audio_pipeline_client import TTSClient
    from audio_pipeline_client._proto import tts_pb2, tts_pb2_grpc

    config = make_config(tiny_model_dir, "max_batch_size=1", "max_queue_size=1", 'openai_voices={"nova": "leo"}')
    with BackgroundServer(config, http_port=0) as server, grpc.insecure_channel(server.target) as channel:
        stub = tts_pb2_grpc.TextToSpeechStub(channel)
        long = tts_pb2.SynthesizeRequest(text="Hello.", sampling=tts_pb2.SamplingParams(max_tokens=4000,
                                                                                          min_tokens=4000))
        running = stub.Synthesize(long, timeout=120)
        next(running), next(running)  # format, first audio: this one holds the only batch slot
        queued = stub.Synthesize(long, timeout=120)
        deadline = time.monotonic() + 30
        while server.engine.core.load != (1, 1) and time.monotonic() < deadline:
            time.sleep(0.01)
        refused = httpx.post(f"{server.http_url}/v1/audio/speech", json={"model": "tts-1", "input": "Hi."},
                             timeout=30)
        running.cancel()
        queued.cancel()
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "rate_limit_error"
        wait_idle(server.engine)
        mapped = httpx.post(f"{server.http_url}/v1/audio/speech", timeout=60,
                            json={"model": "tts-1", "input": "Hi.", "voice": "nova", "response_format": "wav",
                                  "seed": 4})
        assert mapped.status_code == 200 and "x-ignored-fields" not in mapped.headers
        # "nova" speaks as the server's "leo" (not as the default voice "tara") for the same seed.
        with TTSClient(server.target, timeout=60) as grpc_client:
            leo, tara = (grpc_client.synthesize("Hi.", voice=voice, seed=4).samples for voice in ("leo", "tara"))
        samples, _ = decode(mapped.content, "wav")
        assert not np.allclose(leo, tara, rtol=0, atol=PCM_STEP)
        np.testing.assert_allclose(samples, leo, rtol=0, atol=PCM_STEP)


def test_an_http_port_in_use_stops_the_server_with_one_clear_error(tiny_model_dir):
    import socket

    from audio_pipeline.testing.background import BackgroundServer

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = BackgroundServer(make_config(tiny_model_dir), http_port=taken.getsockname()[1])
        with pytest.raises(RuntimeError, match="--http-port: cannot serve HTTP on 127.0.0.1"):
            server.start()
        server.stop()


def test_while_warming_up_speech_answers_503_with_retry_after_and_health_is_not_serving(tiny_model_dir):
    import threading
    import time

    from audio_pipeline.service.engine import TTSEngine
    from audio_pipeline.testing.background import BackgroundServer

    engine = TTSEngine(make_config(tiny_model_dir))
    gate = threading.Event()
    real_warmup = engine.warmup
    engine.warmup = lambda: (gate.wait(120), real_warmup())[1]
    warming = BackgroundServer(engine.config, engine=engine, http_port=0).start(wait_ready=False)
    try:
        deadline = time.monotonic() + 60
        while warming.http_port is None:  # HTTP listens before warm-up, right after gRPC
            assert time.monotonic() < deadline, "HTTP did not start"
            time.sleep(0.05)
        health = httpx.get(f"{warming.http_url}/health", timeout=30)
        assert (health.status_code, health.json()) == (503, {"status": "not_serving"})
        speech = httpx.post(f"{warming.http_url}/v1/audio/speech", timeout=30,
                            json={"model": "tts-1", "input": "Not yet.", "voice": "tara"})
        assert speech.status_code == 503 and speech.headers["Retry-After"]
        assert "warming up" in speech.json()["error"]["message"]
        gate.set()
        warming.wait_ready(120)
        assert httpx.get(f"{warming.http_url}/health", timeout=30).status_code == 200
    finally:
        gate.set()
        warming.stop()


@pytest.mark.parametrize("response_format", ["flac", "wav", "mp3", "opus", "aac"])
def test_every_encoded_response_opens_in_soundfile_and_pyav_with_its_duration(client, idle, response_format):
    """Through the openai client, whole and streamed: each file opens in soundfile (libsndfile;
    it reads no AAC) and in FFmpeg (PyAV) with the speech's duration. FLAC comes as one complete
    file, so its header holds the length libsndfile needs."""
    import soundfile

    reference = grpc_samples(idle, seed=3, sample_rate=24000)
    expected = reference.size / 24000
    tolerance = 0.11 if response_format in ("mp3", "aac") else 0.03  # lossy codecs pad a frame or two
    request = dict(model="tts-1", voice="alloy", input=TEXT, response_format=response_format, extra_body={"seed": 3})
    whole = client.audio.speech.create(**request).content
    with client.audio.speech.with_streaming_response.create(**request) as streamed:
        pieces = list(streamed.iter_bytes())
    if response_format == "flac":
        assert b"".join(pieces) == whole  # the same complete file
    lossless = response_format in ("flac", "wav")
    for data in (whole, b"".join(pieces)):
        samples, rate = decode(data, response_format)
        assert samples.size / rate == pytest.approx(expected, abs=tolerance)
        if lossless:  # the very samples gRPC gives
            np.testing.assert_allclose(samples, reference, rtol=0, atol=PCM_STEP)
        if response_format != "aac":
            with soundfile.SoundFile(io.BytesIO(data)) as sound:
                read = sound.read(dtype="float32")
                assert read.shape[0] / sound.samplerate == pytest.approx(expected, abs=tolerance)
                if data is whole or response_format != "wav":  # a streamed WAV's header says "unknown"
                    assert sound.frames / sound.samplerate == pytest.approx(expected, abs=tolerance)
            if lossless:
                np.testing.assert_allclose(read, reference, rtol=0, atol=PCM_STEP)


def test_a_wav_is_one_complete_file_unless_the_client_streams_it(client, idle):
    """A WAV that is not streamed to a player opens in Python's wave with its length in the header;
    the openai package's streaming response, SSE and ``"stream": true`` get the same samples behind
    the one-header streaming form (sizes 0xFFFFFFFF), which a player reads to the end; ``"stream":
    false`` asks for the complete file whatever the client."""
    import wave

    frames = grpc_samples(idle, seed=3, sample_rate=24000).size
    request = dict(model="tts-1", voice="alloy", input=TEXT, response_format="wav")
    whole = client.audio.speech.create(**request, extra_body={"seed": 3}).content
    with wave.open(io.BytesIO(whole)) as reader:
        assert (reader.getnframes(), reader.getframerate(), reader.getnchannels()) == (frames, 24000, 1)
        assert len(reader.readframes(frames + 1)) == 2 * frames
    url, body = f"{idle.http_url}/v1/audio/speech", {"input": TEXT, "response_format": "wav", "seed": 3}
    assert httpx.post(url, json=body, timeout=120).content == whole  # curl -o, a browser: complete too
    with client.audio.speech.with_streaming_response.create(**request, extra_body={"seed": 3}) as response:
        streamed = b"".join(response.iter_bytes())
    asked = httpx.post(url, json={**body, "stream": True}, timeout=120).content
    for data in (streamed, asked):
        assert data[4:8] == data[40:44] == b"\xff\xff\xff\xff" and data[44:] == whole[44:]
    with client.audio.speech.with_streaming_response.create(**request, extra_body={"seed": 3, "stream": False}) as response:
        assert b"".join(response.iter_bytes()) == whole
    refused = httpx.post(url, json={**body, "stream": "yes"}, timeout=120)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream"


def test_flac_over_server_sent_events_is_one_complete_file(idle):
    """SSE with FLAC: one delta holding the whole file (readable by soundfile), then the usage."""
    import base64
    import json as jsonlib

    import httpx
    import soundfile

    response = httpx.post(f"{idle.http_url}/v1/audio/speech", timeout=120,
                          json={"input": TEXT, "response_format": "flac", "stream_format": "sse", "seed": 3})
    events = [jsonlib.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events] == ["speech.audio.delta", "speech.audio.done"]
    reference = grpc_result(idle, seed=3, sample_rate=24000)
    with soundfile.SoundFile(io.BytesIO(base64.b64decode(events[0]["audio"]))) as sound:
        assert (sound.frames, sound.samplerate) == (reference.samples.size, 24000)  # its header holds the length
        np.testing.assert_allclose(sound.read(dtype="float32"), reference.samples, rtol=0, atol=PCM_STEP)
    usage = reference.usage
    assert (events[1]["usage"]["input_tokens"], events[1]["usage"]["output_tokens"]) == (usage.prompt_tokens,
                                                                                          usage.generated_tokens)
