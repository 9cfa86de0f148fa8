"""The client library and tts-client end to end, against a real server on the tiny model."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import grpc
import numpy as np
import pytest
import soundfile

from audio_pipeline_client import AsyncTTSClient, TTSClient, TTSError
from audio_pipeline_client.cli import main
from audio_pipeline.core.stop import StopReason
from audio_pipeline_client.protocol import float_to_pcm16
from helpers import free_port, pcm16, wait_idle

TEXT = "Hello from the client tests."
SEED = 11


@pytest.fixture(scope="module")
def target(request):
    """The address of the real server of tests/conftest.py (``tts_server``); the test is skipped without it."""
    try:
        server = request.getfixturevalue("tts_server")
    except pytest.FixtureLookupError:
        pytest.skip("no `tts_server` fixture in tests/conftest.py: these tests need a real audio-pipeline server")
    return server.target


@pytest.fixture(scope="module")
def reference(target):
    """The PCM16 audio of TEXT with SEED at the native rate, through the library."""
    with TTSClient(target, timeout=120) as client:
        return client.synthesize(TEXT, seed=SEED)


@pytest.fixture
def closed_port():
    """A port nothing listens on."""
    return free_port()


def one_error_line(captured_err: str) -> str:
    lines = captured_err.strip().splitlines()
    assert len(lines) == 1, captured_err
    assert lines[0].startswith("tts-client: error: ") and "Traceback" not in captured_err
    return lines[0]


@pytest.mark.slow
def test_stream_and_synthesize_give_the_same_samples(target, reference):
    # The tiny model's SNAC decoder: 2048 samples for each whole 7-token frame generated.
    assert reference.samples.dtype == np.float32
    assert reference.samples.size == reference.usage.generated_tokens // 7 * 2048 > 0
    assert np.abs(reference.samples).max() <= 1.0
    assert reference.stop_reason in ("end_of_speech", "max_tokens") and reference.request_id
    assert reference.usage.audio_seconds == pytest.approx(reference.duration_seconds)
    with TTSClient(target, timeout=120) as client:
        chunks = list(client.stream(TEXT, seed=SEED))
    audio, final = chunks[:-1], chunks[-1]
    assert [chunk.index for chunk in chunks] == list(range(len(chunks)))
    assert not any(chunk.final for chunk in audio) and final.final and final.samples.size == 0
    assert final.stop_reason == reference.stop_reason
    assert final.usage.audio_seconds == pytest.approx(reference.duration_seconds)
    np.testing.assert_array_equal(np.concatenate([chunk.samples for chunk in audio]), reference.samples)


@pytest.mark.slow
def test_float32_encoding_matches_pcm16_within_quantization(target, reference):
    with TTSClient(target, timeout=120) as client:
        result = client.synthesize(TEXT, seed=SEED, encoding="f32")
    assert result.sample_rate == reference.sample_rate and result.samples.size == reference.samples.size
    np.testing.assert_allclose(result.samples, reference.samples, atol=1.5 / 32768)


@pytest.mark.slow
def test_list_voices_and_wait_ready(target, tiny_model_dir):
    from audio_pipeline.layouts.manifest import ModelManifest

    with TTSClient(target, timeout=30) as client:
        client.wait_ready(timeout=30)
        voices = client.list_voices()
    # The model's voices, in its order, its default marked as the one default.
    manifest = ModelManifest.read(tiny_model_dir)
    assert [voice.name for voice in voices if not voice.registered] == [v.name for v in manifest.voices]
    assert [voice.name for voice in voices if voice.is_default] == [manifest.default_voice]


@pytest.mark.slow
def test_async_client_matches_the_sync_client(target, reference):
    async def run():
        async with AsyncTTSClient(target, timeout=120) as client:
            await client.wait_ready(timeout=30)
            voices = await client.list_voices()
            result = await client.synthesize(TEXT, seed=SEED)
            chunks = [chunk async for chunk in client.stream(TEXT, seed=SEED)]
            with pytest.raises(TTSError) as caught:
                await client.synthesize("")
            return voices, result, chunks, caught.value

    voices, result, chunks, error = asyncio.run(run())
    with TTSClient(target, timeout=30) as client:
        assert voices == client.list_voices()
    np.testing.assert_array_equal(result.samples, reference.samples)
    np.testing.assert_array_equal(np.concatenate([chunk.samples for chunk in chunks[:-1]]), reference.samples)
    assert chunks[-1].final and chunks[-1].usage is not None
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and "text" in str(error)


def cancelled_count(server):
    return server.engine.core.stop_reasons[StopReason.CANCELLED]


@pytest.mark.slow
def test_leaving_a_stream_early_cancels_generation(idle_server, reference):
    before = cancelled_count(idle_server)
    with TTSClient(idle_server.target, timeout=120) as client:
        stream = client.stream(TEXT, seed=SEED, max_tokens=4000, min_tokens=4000)
        first = next(stream)
        assert first.index == 0 and not first.final
        stream.close()
        wait_idle(idle_server.engine)
        assert cancelled_count(idle_server) == before + 1
        # The server is still usable afterwards: the same request gives the same speech as before.
        np.testing.assert_array_equal(client.synthesize(TEXT, seed=SEED).samples, reference.samples)


@pytest.mark.slow
def test_async_stream_closed_early_cancels_generation(idle_server):
    before = cancelled_count(idle_server)

    async def run():
        async with AsyncTTSClient(idle_server.target, timeout=120) as client:
            stream = client.stream(TEXT, seed=SEED, max_tokens=4000, min_tokens=4000)
            async for chunk in stream:
                break
            await stream.aclose()
            return chunk

    assert asyncio.run(run()).index == 0
    wait_idle(idle_server.engine)
    assert cancelled_count(idle_server) == before + 1


@pytest.mark.slow
def test_cli_waits_for_the_server_to_be_ready(target, tmp_path, capsys):
    out = tmp_path / "ready.wav"
    assert main(["--server", target, "--wait-ready", "30", "--text", TEXT, "--max-tokens", "14", "--output",
                 str(out), "--quiet"]) == 0
    assert soundfile.info(str(out)).frames == 2 * 2048


def test_cli_wait_ready_gives_up_with_one_line(closed_port, tmp_path, capsys):
    code = main(["--server", f"127.0.0.1:{closed_port}", "--wait-ready", "0.5", "--text", TEXT, "--output",
                 str(tmp_path / "x.wav")])
    assert code == 1 and "not ready" in one_error_line(capsys.readouterr().err)


@pytest.mark.slow
def test_server_errors_raise_tts_error(target):
    with TTSClient(target, timeout=60) as client:
        with pytest.raises(TTSError) as caught:
            client.synthesize("   ")
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT and "text" in caught.value.details
        with pytest.raises(TTSError) as caught:
            client.synthesize(TEXT, voice="no-such-voice-anywhere")
        assert caught.value.code == grpc.StatusCode.NOT_FOUND


@pytest.mark.slow
def test_cli_writes_a_wav_at_the_advertised_rate(target, reference, tmp_path, capsys):
    output = tmp_path / "hello.wav"
    assert main(["--server", target, "--text", TEXT, "--seed", str(SEED), "--output", str(output)]) == 0
    info = soundfile.info(str(output))
    assert (info.samplerate, info.channels, info.subtype) == (reference.sample_rate, 1, "PCM_16")
    samples, _ = soundfile.read(str(output), dtype="int16")
    np.testing.assert_array_equal(samples, float_to_pcm16(reference.samples))
    summary = capsys.readouterr().err
    assert str(output) in summary and "first audio after" in summary
    assert sorted(path.name for path in tmp_path.iterdir()) == ["hello.wav"]


@pytest.mark.slow
def test_cli_resamples_and_writes_float_wav(target, reference, tmp_path, capsys):
    output = tmp_path / "hello16k.wav"
    assert main(["--server", target, "--text", TEXT, "--seed", str(SEED), "--sample-rate", "16000",
                 "--format", "f32", "--quiet", "--output", str(output)]) == 0
    from scipy.signal import resample_poly

    info = soundfile.info(str(output))
    assert (info.samplerate, info.subtype) == (16000, "FLOAT")
    assert info.duration == pytest.approx(reference.duration_seconds, abs=0.01)
    # The speech itself, resampled: the 24 kHz reference through an independent polyphase resampler.
    samples, _ = soundfile.read(str(output), dtype="float32")
    expected = resample_poly(reference.samples, 2, 3)[:samples.size]
    snr = 10 * np.log10(np.sum(expected ** 2) / np.sum((samples[:expected.size] - expected) ** 2))
    assert snr > 40, f"{snr:.1f} dB"
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_cli_raw_writes_pcm16_to_stdout(target, reference, capsysbinary):
    assert main(["--server", target, "--text", TEXT, "--seed", str(SEED), "--raw", "--quiet"]) == 0
    raw = capsysbinary.readouterr().out
    assert len(raw) == reference.samples.size * 2
    np.testing.assert_array_equal(pcm16(raw), float_to_pcm16(reference.samples))


@pytest.mark.slow
def test_cli_voices_prints_a_table(target, capsys):
    with TTSClient(target) as client:
        names = [voice.name for voice in client.list_voices()]
    assert main(["voices", "--server", target]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "LANGUAGE", "DEFAULT", "DESCRIPTION"]
    assert [line.split()[0] for line in lines[1:]] == names


@pytest.mark.slow
def test_cli_empty_text_is_one_line_mentioning_text(target, tmp_path, capsys):
    output = tmp_path / "empty.wav"
    assert main(["--server", target, "--text", "", "--output", str(output)]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert "INVALID_ARGUMENT" in line and "text" in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_cli_reads_text_from_a_file(target, tmp_path, capsys):
    text_file = tmp_path / "speech.txt"
    text_file.write_text(TEXT + "\n", encoding="utf-8")
    output = tmp_path / "from-file.wav"
    assert main(["--server", target, "--input", str(text_file), "--seed", str(SEED), "--max-tokens", "28",
                 "--output", str(output)]) == 0
    # The file's text is what was spoken: the library's speech of TEXT with the same settings.
    with TTSClient(target, timeout=120) as client:
        expected = client.synthesize(TEXT, seed=SEED, max_tokens=28).samples
    samples, _ = soundfile.read(str(output), dtype="int16")
    np.testing.assert_array_equal(samples, float_to_pcm16(expected))


def test_cli_unreachable_server_is_one_line(closed_port, tmp_path, capsys):
    output = tmp_path / "never.wav"
    assert main(["--server", f"127.0.0.1:{closed_port}", "--text", TEXT, "--output", str(output)]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert "UNAVAILABLE" in line and str(closed_port) in line
    assert list(tmp_path.iterdir()) == []


def test_cli_missing_input_file_is_one_line(closed_port, tmp_path, capsys):
    missing = tmp_path / "missing.txt"
    assert main(["--server", f"127.0.0.1:{closed_port}", "--input", str(missing), "--output",
                 str(tmp_path / "out.wav")]) == 1
    assert str(missing) in one_error_line(capsys.readouterr().err)


def test_cli_empty_input_file_is_one_line(closed_port, tmp_path, capsys):
    blank = tmp_path / "blank.txt"
    blank.write_text(" \n", encoding="utf-8")
    assert main(["--server", f"127.0.0.1:{closed_port}", "--input", str(blank), "--output",
                 str(tmp_path / "out.wav")]) == 1
    assert "no text" in one_error_line(capsys.readouterr().err)


def test_cli_unwritable_output_is_one_line(closed_port, tmp_path, capsys):
    output = tmp_path / "no-such-dir" / "out.wav"
    assert main(["--server", f"127.0.0.1:{closed_port}", "--text", TEXT, "--output", str(output)]) == 1
    assert str(output) in one_error_line(capsys.readouterr().err)


def test_cli_usage_errors_exit_2(capsys):
    assert main(["--text", TEXT]) == 2
    assert main(["--text", TEXT, "--output", "x.wav", "--format", "wma"]) == 2
    assert main(["--input", "a.txt", "--text", TEXT, "--raw"]) == 2
    assert "usage: tts-client" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_as_a_subprocess(target, tmp_path, closed_port):
    output = tmp_path / "sub.wav"
    command = [sys.executable, "-m", "audio_pipeline_client.cli"]
    environment = {**os.environ, "AUDIO_PIPELINE_SERVER": target}
    done = subprocess.run([*command, "--text", TEXT, "--seed", str(SEED), "--max-tokens", "28", "--output",
                           str(output)], capture_output=True, text=True, env=environment, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "wrote" in done.stderr
    # AUDIO_PIPELINE_SERVER named the server: the file holds its speech of TEXT.
    with TTSClient(target, timeout=120) as client:
        expected = client.synthesize(TEXT, seed=SEED, max_tokens=28).samples
    samples, _ = soundfile.read(str(output), dtype="int16")
    np.testing.assert_array_equal(samples, float_to_pcm16(expected))
    failed = subprocess.run([*command, "--server", f"127.0.0.1:{closed_port}", "--text", TEXT, "--raw"],
                            capture_output=True, text=True, timeout=120)
    assert failed.returncode == 1 and failed.stdout == ""
    one_error_line(failed.stderr)


@pytest.mark.parametrize("output, message", [
    ("folder", "cannot write {tmp}/folder: it is a directory"),
    ("missing/hello.wav", "cannot write the output {tmp}/missing/hello.wav: No such file or directory"),
    ("missing/hello.mp3", "cannot write the output {tmp}/missing/hello.mp3: No such file or directory"),
])
def test_an_output_that_cannot_be_written_fails_before_the_call(tmp_path, capsys, output, message):
    from audio_pipeline_client.cli import main

    (tmp_path / "folder").mkdir()
    # No server listens on port 1: the failure must come from the output, before any call.
    assert main(["--server", "127.0.0.1:1", "--text", TEXT, "--output", str(tmp_path / output)]) == 1
    assert message.format(tmp=tmp_path) in capsys.readouterr().err
    assert not list(tmp_path.rglob("*.part"))


def test_timings_that_cannot_be_written_fail_before_the_call(tmp_path, capsys):
    from audio_pipeline_client.cli import main

    assert main(["--server", "127.0.0.1:1", "--text", TEXT, "--output", str(tmp_path / "a.wav"),
                 "--timings", str(tmp_path / "missing" / "a.vtt")]) == 1
    assert f"cannot write the timings {tmp_path}/missing/a.vtt" in capsys.readouterr().err
    assert not list(tmp_path.rglob("*.part"))
