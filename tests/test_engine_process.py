"""The engine core in a process of its own (engine_process = subprocess, core/process/): the same
audio as in process, requests, cancels, cloning and metrics across the boundary, and faults: a
core killed mid-stream ends its streams UNAVAILABLE within a second and is replaced, a front end
that dies takes its core with it, a core that cannot start fails the caller with its error."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from audio_pipeline.service.engine import TTSEngine, resolve_engine_process
from audio_pipeline.testing.background import BackgroundServer
from audio_pipeline_client._proto import tts_pb2, tts_pb2_grpc
from helpers import TRANSCRIPT, make_config, pcm_of, recording, wait_idle, wait_serving

#: Real servers and processes: left out of the quick subset (scripts/test.sh -m "not slow").
pytestmark = pytest.mark.slow


def request(text="The core runs in a process of its own.", max_tokens=56, **sampling):
    return tts_pb2.SynthesizeRequest(text=text, sampling=tts_pb2.SamplingParams(
        max_tokens=max_tokens, **sampling))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (ended, not yet reaped by its parent) counts as ended.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_auto_is_a_process_of_its_own_and_a_program_s_engine_runs_in_process(tiny_model_dir):
    assert resolve_engine_process("auto") == "subprocess"
    assert resolve_engine_process("auto") == "subprocess"
    from audio_pipeline.config import AudioGenerationConfig

    assert AudioGenerationConfig().engine_process.value == "auto"
    assert resolve_engine_process("in_process") == "in_process"
    with pytest.raises(ValueError, match="engine_process"):
        resolve_engine_process("threads")


def test_bad_setting_names_the_field(tiny_model_dir):
    with pytest.raises(ValueError, match="engine_process"):
        make_config(tiny_model_dir, "engine_process=elsewhere")


def test_greedy_and_seeded_audio_are_the_same_in_both_modes(tiny_model_dir):
    config = make_config(tiny_model_dir)
    results = {}
    for mode in ("in_process", "subprocess"):
        engine = TTSEngine(config, engine_process=mode)
        engine.start()
        try:
            results[mode] = [engine.synthesize("Hello there.", temperature=0.0, max_tokens=84).samples,
                             engine.synthesize("Hello there.", temperature=0.9, seed=7, max_tokens=84).samples]
        finally:
            engine.stop(1.0)
    for inside, outside in zip(results["in_process"], results["subprocess"]):
        assert inside.size > 0
        np.testing.assert_array_equal(inside, outside)


def started_cores(monkeypatch) -> tuple[list, list]:
    """The core processes started from here on, and the ones the front end had to kill."""
    from audio_pipeline.core.process.client import CoreChild

    started, killed = [], []
    init, kill = CoreChild.__init__, CoreChild.kill

    def record(self, *args, **kwargs):
        init(self, *args, **kwargs)
        started.append(self)

    def record_kill(self):
        killed.append(self.pid)
        kill(self)

    monkeypatch.setattr(CoreChild, "__init__", record)
    monkeypatch.setattr(CoreChild, "kill", record_kill)
    return started, killed


def test_a_core_that_cannot_start_fails_the_caller_with_its_error(tiny_model_dir, monkeypatch):
    from audio_pipeline.core.process.client import CoreProcess

    started, killed = started_cores(monkeypatch)
    monkeypatch.setattr(CoreProcess, "hooks", [("helpers", "fail_core_start", ("no GPU left for the core",))])
    with pytest.raises(ValueError, match="no GPU left for the core"):
        TTSEngine(make_config(tiny_model_dir), engine_process="subprocess")
    # Having said why, the core's process exited by itself (an open socket once held it until the
    # front end gave up waiting and killed it).
    assert len(started) == 1 and killed == [] and started[0].exitcode == 1


def test_a_front_end_that_fails_while_its_core_loads_ends_the_core(tmp_path, monkeypatch):
    """A model path that is not there fails the front end's half at once: the core it started is
    ended then, not waited for (a stop would wait for it to finish loading)."""
    started, killed = started_cores(monkeypatch)
    with pytest.raises(FileNotFoundError, match="model.model_path"):
        TTSEngine(make_config(tmp_path / "no-such-model"), engine_process="subprocess")
    assert len(started) == 1 and killed == [started[0].pid] and not started[0].is_alive()


@pytest.fixture
def server(tiny_model_dir, tmp_path):
    running = BackgroundServer(make_config(tiny_model_dir, "engine_process=subprocess",
                                           voices_dir=str(tmp_path / "voices"))).start()
    yield running
    running.stop()


def test_streams_cancels_cloning_and_metrics_cross_the_boundary(server):
    engine = server.engine
    assert engine.engine_process == "subprocess" and engine.backend.pid != os.getpid()
    with grpc.insecure_channel(server.target) as channel:
        stub = tts_pb2_grpc.TextToSpeechStub(channel)
        chunks = list(stub.Synthesize(request(temperature=0.0), timeout=120))
        assert pcm_of(chunks).size > 0
        assert chunks[-1].complete.usage.audio_seconds == pytest.approx(pcm_of(chunks).size / 24000)
        # A voice cloned: the reference is encoded in the core (a call beside its loop).
        stub.RegisterVoice(tts_pb2.RegisterVoiceRequest(name="copy", reference=tts_pb2.VoiceReference(
            audio=recording(), transcript=TRANSCRIPT)), timeout=120)
        assert "copy" in [v.name for v in stub.ListVoices(tts_pb2.ListVoicesRequest(), timeout=10).voices]
        cloned = list(stub.Synthesize(tts_pb2.SynthesizeRequest(text="In the copied voice.", voice="copy",
                      sampling=tts_pb2.SamplingParams(max_tokens=28, temperature=0.0)), timeout=120))
        assert pcm_of(cloned).size > 0
        # A stream the client leaves is stopped in the core and lets go of all it held.
        stream = stub.Synthesize(request(max_tokens=2000), timeout=120)
        next(stream)
        stream.cancel()
        wait_idle(engine, timeout=10)  # no request, KV sequence or block left in the core
    text = engine.metrics.render().decode()
    # Both processes on one page: the front end's RPC outcomes and the core's engine metrics.
    assert 'tts_rpc_requests_total{outcome="ok"}' in text
    assert 'tts_engine_requests_finished_total{reason="cancelled"} 1.0' in text
    assert "tts_kv_cache_blocks_used 0.0" in text


def test_a_killed_core_ends_its_streams_unavailable_and_is_replaced(server):
    engine = server.engine
    first_core = engine.backend.pid
    with grpc.insecure_channel(server.target) as channel:
        stub = tts_pb2_grpc.TextToSpeechStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        streams = [stub.Synthesize(request(max_tokens=4000), timeout=120) for _ in range(3)]
        for stream in streams:
            next(stream)
        os.kill(first_core, signal.SIGKILL)
        killed = time.monotonic()
        for stream in streams:
            with pytest.raises(grpc.RpcError) as error:
                for _ in stream:
                    pass
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE, error.value.details()
        assert time.monotonic() - killed < 1.0
        status = health.Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        # A request meanwhile is refused, not left hanging.
        try:
            list(stub.Synthesize(request(), timeout=60))
        except grpc.RpcError as refused:
            assert refused.code() == grpc.StatusCode.UNAVAILABLE
        wait_serving(channel, timeout=120)
        assert engine.backend.pid != first_core and engine.backend.restarts == 1
        assert not alive(first_core)
        assert pcm_of(list(stub.Synthesize(request(temperature=0.0), timeout=120))).size > 0


def test_the_core_exits_when_its_front_end_dies(tiny_model_dir, tmp_path):
    script = tmp_path / "front.py"
    script.write_text(
        "import sys, time\n"
        "sys.path[:0] = %r\n"
        "from helpers import make_config\n"
        "from audio_pipeline.service.engine import TTSEngine\n"
        "engine = TTSEngine(make_config(%r), engine_process='subprocess')\n"
        "print(engine.backend.pid, flush=True)\n"
        "time.sleep(600)\n" % (sys.path, str(tiny_model_dir)))
    front = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        core = int(front.stdout.readline())
        assert alive(core)
        front.send_signal(signal.SIGKILL)
        front.wait()
        deadline = time.monotonic() + 5
        while alive(core) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(core)
    finally:
        front.kill()


def test_multiprocess_metrics_show_both_processes(tiny_model_dir, tmp_path):
    """prometheus_metrics_mode = launch_multiproc_server: the core's process writes its metrics into
    the front end's multiprocess directory, so the one exposition aggregates both (in a process of
    its own: the mode switches prometheus_client's storage for the whole process)."""
    script = tmp_path / "multiproc.py"
    script.write_text(
        "import sys\n"
        "sys.path[:0] = %r\n"
        "from helpers import make_config\n"
        "from audio_pipeline.server.metrics import ServerMetrics\n"
        "from audio_pipeline.service.engine import TTSEngine\n"
        "config = make_config(%r, 'prometheus_metrics_mode=launch_multiproc_server')\n"
        "engine = TTSEngine(config, engine_process='subprocess')\n"
        "server = ServerMetrics(engine.metrics)\n"
        "engine.start()\n"
        "engine.synthesize('Counted in both processes.', temperature=0.0, max_tokens=28)\n"
        "server.count('ok')\n"
        "print(engine.metrics.render().decode())\n"
        "engine.stop(1.0)\n" % (sys.path, str(tiny_model_dir)))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         env={k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert 'tts_rpc_requests_total{outcome="ok"} 1.0' in out.stdout
    assert 'tts_engine_requests_finished_total{reason="max_tokens"} 1.0' in out.stdout


def test_serve_fails_with_the_core_s_start_up_error_and_no_traceback(tmp_path):
    """A setting that only the engine core's process can check (the decoder's weights are read
    there): `serve` exits non-zero with the setting's error, said once, without a traceback."""
    result = subprocess.run([sys.executable, "-m", "audio_pipeline.cli", "serve", "--host", "127.0.0.1", "--port", "0",
                             "--device", "cpu", "--audio-decoder-weights", str(tmp_path / "missing")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert f"audio_decoder_weights: {tmp_path / 'missing'} does not exist" in result.stderr
    assert "Traceback" not in result.stderr
