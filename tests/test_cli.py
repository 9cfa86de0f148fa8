"""The `audio-pipeline` command: config, synthesize (in-process) and serve (a real subprocess)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
import soundfile as sf

from audio_pipeline.cli import main
from audio_pipeline_client._proto import tts_pb2, tts_pb2_grpc
from helpers import listening_port, wait_serving


def run_cli(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "audio_pipeline.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_config_prints_the_resolved_configuration_from_every_source(tmp_path, capsys):
    config_file = tmp_path / "tts.yaml"
    config_file.write_text("production:\n  buffer: 28\n  sampling:\n    temperature: 0.3\n")
    code = main(["config", "--config-file", str(config_file), "--section-name", "production",
                 "--task-arg", "chunk_size=28,56", "--task-arg", "sampling.top-k=50", "--dtype", "float32"])
    assert code == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["chunk_size"] == [28, 56] and shown["buffer"] == 28
    assert shown["sampling"]["temperature"] == 0.3 and shown["sampling"]["top_k"] == 50
    assert shown["model"]["dtype"] == "float32" and shown["model"]["model_path"] == "builtin:slt-en-v5"
    assert shown["audio_decoder"] == "mcep"  # not set: the decoder the built-in voice names
    assert shown["prepend_prompt_speech_tokens"] == "never"


@pytest.mark.parametrize("flag, named", [("no_such_field=1", "no_such_field"), ("buffer=lots", "buffer"),
                                         ("chunk_size=28,x", "chunk_size"), ("block_causal=maybe", "block_causal")])
def test_a_bad_task_arg_exits_non_zero_with_one_line_naming_it(flag, named, capsys):
    assert main(["config", "--task-arg", flag]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("audio-pipeline: error:") and named in err


@pytest.mark.slow
def test_synthesize_writes_a_wav_with_the_built_in_default_model(tmp_path):
    out = tmp_path / "hello.wav"
    result = run_cli("synthesize", "--text", "Hello there.", "--output", str(out), "--max-tokens", "17",
                     "--seed", "3", "--sample-rate", "16000")
    assert result.returncode == 0, result.stderr
    audio, rate = sf.read(out, dtype="float32")
    # The built-in voice: one token per 20 ms frame at 16 kHz, so 17 tokens make 17 frames.
    assert rate == 16000 and len(audio) == 17 * 320
    assert "max_tokens" in result.stderr
    # The same speech as the built-in model's engine makes in this process for the same request
    # (one sentence: one segment, spoken with the seed as given).
    from audio_pipeline.config import AudioGenerationConfig
    from audio_pipeline.service.engine import TTSEngine

    engine = TTSEngine(AudioGenerationConfig.load())
    engine.start()
    try:
        reference = engine.synthesize("Hello there.", seed=3, max_tokens=17)
    finally:
        engine.stop(0.0)
    assert reference.sample_rate == 16000
    np.testing.assert_allclose(audio, reference.samples, rtol=0, atol=1.5 / 32768)  # the WAV's PCM16


def test_synthesize_reports_a_missing_model_directory(tmp_path, capsys):
    code = main(["synthesize", "--model", str(tmp_path / "nope"), "--text", "Hi", "--output", str(tmp_path / "x.wav")])
    err = capsys.readouterr().err.strip()
    assert code == 1 and "model.model_path" in err and "\n" not in err
    assert not (tmp_path / "x.wav").exists()


#: A text of several sentences: the service speaks it segment by segment, each submitted to the
#: engine as the one before it plays out.
LONG_TEXT = ("The morning train left the station on time. It crossed the river and the fields beyond it. "
             "By noon it had reached the coast, where the wind was cold. The passengers walked along the "
             "harbour and watched the boats come in. Later that day they found a small cafe near the old lighthouse.")


@pytest.mark.slow
def test_sigterm_lets_every_admitted_multi_segment_stream_finish(tmp_path):
    """SIGTERM while eight long texts stream: the server takes no new request, but every stream it
    admitted is spoken to its end (all its segments, each submitted after the signal too) within
    the grace period, and the process exits 0."""
    import threading

    assert len(LONG_TEXT) > 280
    server = subprocess.Popen([sys.executable, "-m", "audio_pipeline.cli", "serve", "--host", "127.0.0.1",
                               "--port", "0", "--device", "cpu", "--task-arg", "grace_period_s=120"],
                              stderr=subprocess.PIPE, text=True)
    try:
        port = listening_port(server)
        threading.Thread(target=server.stderr.read, daemon=True).start()  # keep its pipe drained
        target = f"127.0.0.1:{port}"
        with grpc.insecure_channel(target) as channel:
            wait_serving(channel)
            stub = tts_pb2_grpc.TextToSpeechStub(channel)
            first_audio = threading.Barrier(9)
            results: list = [None] * 8

            def speak(index):
                messages = []
                try:
                    for message in stub.Synthesize(tts_pb2.SynthesizeRequest(text=LONG_TEXT), timeout=300):
                        messages.append(message)
                        if message.HasField("audio") and sum(m.HasField("audio") for m in messages) == 1:
                            first_audio.wait(timeout=120)
                    results[index] = messages
                except grpc.RpcError as error:
                    results[index] = error

            threads = [threading.Thread(target=speak, args=(i,)) for i in range(8)]
            for thread in threads:
                thread.start()
            first_audio.wait(timeout=120)
            signalled = time.monotonic()
            server.send_signal(signal.SIGTERM)
            # A new request after the signal is refused.
            time.sleep(0.5)
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Synthesize(tts_pb2.SynthesizeRequest(text="Too late."), timeout=30))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            for thread in threads:
                thread.join(timeout=200)
        errors = [r for r in results if not isinstance(r, list)]
        assert not errors, [f"{e.code()}: {e.details()}" for e in errors]
        for messages in results:
            usage = messages[-1].complete.usage
            assert messages[-1].HasField("complete") and usage.generated_tokens > 0
            heard = sum(m.audio.num_samples for m in messages if m.HasField("audio"))
            assert heard / 16000 > 10  # the whole text: five sentences, not the first one or two
        assert server.wait(timeout=60) == 0
        assert time.monotonic() - signalled < 120
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        server.stderr.close()


@pytest.mark.slow
@pytest.mark.parametrize("engine_process", ["in_process", "subprocess"])
def test_serve_drains_an_in_flight_stream_on_sigterm(tiny_model_dir, engine_process):
    """SIGTERM mid-stream: the stream is spoken to its end and the server exits 0; with the engine
    core in its own process, also when the signal goes to the whole process group (as a service
    manager sends it): the core goes on serving the drain."""
    server = subprocess.Popen([sys.executable, "-m", "audio_pipeline.cli", "serve", "--host", "127.0.0.1",
                               "--port", "0", "--model", str(tiny_model_dir), "--device", "cpu",
                               "--task-arg", "chunk_size=28", "--task-arg", "grace_period_s=60",
                               "--task-arg", f"engine_process={engine_process}"],
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        port = listening_port(server)
        target = f"127.0.0.1:{port}"
        with grpc.insecure_channel(target) as channel:
            wait_serving(channel)
            stream = tts_pb2_grpc.TextToSpeechStub(channel).Synthesize(tts_pb2.SynthesizeRequest(
                text="A longer sentence to keep the server busy.",
                sampling=tts_pb2.SamplingParams(max_tokens=700, min_tokens=700)), timeout=300)
            assert next(stream).HasField("format")
            first = next(stream)
            assert first.HasField("audio")
            if engine_process == "subprocess":
                os.killpg(server.pid, signal.SIGTERM)
            else:
                server.send_signal(signal.SIGTERM)
            rest = list(stream)
        assert rest[-1].HasField("complete") and rest[-1].complete.usage.generated_tokens == 700
        # All its audio came: a frame of samples for each 7 tokens of the tiny model's SNAC decoder.
        import math

        from audio_pipeline.testing.random_decoders import TINY_SNAC_CONFIG

        samples_per_frame = math.prod(TINY_SNAC_CONFIG["encoder_rates"]) * TINY_SNAC_CONFIG["vq_strides"][0]
        assert samples_per_frame == 2048
        audio = [m.audio for m in [first, *rest[:-1]]]
        assert sum(a.num_samples for a in audio) == sum(len(a.data) // 2 for a in audio) == 700 // 7 * samples_per_frame
        assert server.wait(timeout=60) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        server.stderr.close()
