"""What the tests share, written once and imported one way: ``from helpers import ...`` (pytest puts
tests/ on the path; conftest.py holds fixtures only, and no test imports another test module).

- an engine on a test model: its config, starting it, running requests until they end, its idle state;
- ports: a free one, a served subprocess's, its health;
- PCM16: bytes to samples, a streamed answer's audio;
- a reference recording for voice cloning, and its transcript;
- requests to a real server: gRPC Synthesize, the websocket session.
"""

from __future__ import annotations

import io
import json
import os
import queue
import re
import socket
import threading
import time

import grpc
import numpy as np

# --------------------------------------------------------------------------------------------
# the engine on a test model

#: Small enough to keep tests fast, large enough for several chunks.
TEST_MAX_TOKENS = 140
#: Texts of a batch of engine requests: short and long prompts, punctuation, numbers.
TEXTS = ["Hello there.", "A much longer sentence that makes a longer prompt for the model.", "Hi!",
         "Numbers: one two three four five.", "Short.", "Another prompt, of middling length."]
#: Greedy settings that speak several chunks.
GREEDY = dict(temperature=0.0, max_tokens=70)

#: Every test's voices folder (saved cloned voices) lies under one root, removed when the process exits.
_VOICES_ROOT = None


def scratch_voices_dir() -> str:
    """An empty voices folder of its own, removed with the others when the process exits."""
    import atexit
    import shutil
    import tempfile

    global _VOICES_ROOT
    if _VOICES_ROOT is None:
        _VOICES_ROOT = tempfile.mkdtemp(prefix="audio-pipeline-test-voices-")
        atexit.register(shutil.rmtree, _VOICES_ROOT, ignore_errors=True)
    return tempfile.mkdtemp(prefix="voices-", dir=_VOICES_ROOT)


def make_config(model_dir, *flags, **overrides):
    """The test config of ``model_dir``: short chunks, TEST_MAX_TOKENS, a short grace period, the
    engine core in process, a voices folder of its own; ``flags`` and ``overrides`` (``model=`` for
    model settings) on top."""
    from audio_pipeline.config import AudioGenerationConfig

    # AUDIO_PIPELINE_TEST_DEVICE=cuda runs the engine tests on a GPU (the CPU is the default), and
    # AUDIO_PIPELINE_TEST_DTYPE=float32 keeps them in float32 there (auto would be bfloat16), so the
    # tests that compare with a float32 reference hold their tolerances on the CUDA code path.
    device = os.environ.get("AUDIO_PIPELINE_TEST_DEVICE", "cpu")
    dtype = os.environ.get("AUDIO_PIPELINE_TEST_DTYPE", "auto")
    model = {"model_path": str(model_dir), "device": device, "dtype": dtype, **overrides.pop("model", {})}
    overrides.setdefault("voices_dir", scratch_voices_dir())
    # The engine core in process (tests read its parts: engine.core, engine.scheduler); the servers
    # of test_engine_process.py, test_cli.py and the Quick start run it in its own, the default.
    return AudioGenerationConfig.load(env={}, audio_flags=["chunk_size=28,56", f"sampling.max_tokens={TEST_MAX_TOKENS}",
                                                           "grace_period_s=5", "engine_process=in_process", *flags],
                                      model=model, **overrides)


def start_engine(model_dir, *flags, **overrides):
    """A started TTSEngine on ``make_config(model_dir, *flags, **overrides)``; the caller stops it."""
    from audio_pipeline.service.engine import TTSEngine

    engine = TTSEngine(make_config(model_dir, *flags, **overrides))
    engine.start()
    return engine


def run_to_completion(engine, contexts, timeout: float = 120.0) -> list[list[np.ndarray]]:
    """Submits ``contexts`` to a started engine at once and waits until every one has ended, each
    completed (an error event fails the test), then until the engine holds nothing (wait_idle).
    Returns each one's audio chunks, in order."""
    events: queue.Queue = queue.Queue()
    chunks = {context.request_id: [] for context in contexts}
    for context in contexts:
        engine.submit(context, events.put)
    ended = set()
    while len(ended) < len(contexts):
        event = events.get(timeout=timeout)
        assert event.kind != "error", event.error
        if event.kind == "audio":
            chunks[event.request_id].append(event.samples)
        else:
            ended.add(event.request_id)
    wait_idle(engine)
    return [chunks[context.request_id] for context in contexts]


def run_texts(engine, texts, **settings) -> list:
    """A context for each of ``texts`` (with the same ``settings``), run together to completion."""
    contexts = [engine.create_context(text, **settings) for text in texts]
    run_to_completion(engine, contexts)
    return contexts


def run_requests(engine, requests: list[dict], texts: list[str]) -> list:
    """A context for each text with its own settings (``requests``), run together to completion."""
    contexts = [engine.create_context(text, **request) for request, text in zip(requests, texts)]
    run_to_completion(engine, contexts)
    return contexts


def speech(engine, context, timeout: float = 120.0) -> np.ndarray:
    """The audio the engine speaks for ``context`` (run alone to completion), as float samples."""
    [chunks] = run_to_completion(engine, [context], timeout)
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.float32)


def forced_logits(engine, sequence: list[int], prompt_length: int, frames=None):
    """The engine's model over ``sequence`` (with its positions' ``frames`` for a layout whose
    positions carry frames) in its own paged cache: the prompt's last logits, then each later
    token's, a token per step."""
    import torch

    model, kv = engine.model, engine.kv_cache
    kv.claim("forced")
    kv.block_manager.alloc("forced", len(sequence))
    device = model.devices[0]
    tokens = torch.tensor(sequence, device=device)
    hidden = []
    try:
        with torch.inference_mode():
            for start, end in [(0, prompt_length), *((p, p + 1) for p in range(prompt_length, len(sequence)))]:
                batch = kv.batch(["forced"], [start], [end - start])
                extra = {} if frames is None else {"frames": frames[start:end].to(device)}
                hidden.append(model.model(tokens[start:end], torch.arange(start, end, device=device), batch,
                                          **extra)[-1:])
            return model.model.compute_logits(torch.cat(hidden))  # one product: the output layer read once
    finally:
        kv.release("forced")


def wait_idle(engine, timeout: float = 60.0) -> None:
    """Waits until the engine holds nothing (no request, no KV block); fails naming what is still held."""
    deadline = time.monotonic() + timeout
    while True:
        queued, running, sequences, blocks = engine.holdings()  # in the engine core, wherever it runs
        if (queued, running, sequences, blocks) == (0, 0, 0, 0):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle: (queued, running)={(queued, running)}, KV sequences={sequences}, "
                                 f"blocks used={blocks}")
        time.sleep(0.02)


# --------------------------------------------------------------------------------------------
# ports and served processes


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at ``host`` right now."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def listening_port(server) -> int:
    """The port from a served subprocess's 'listening on 127.0.0.1:PORT' line (``server``: a Popen
    whose stderr is a text pipe, read up to that line)."""
    for line in server.stderr:
        if match := re.search(r"listening on 127\.0\.0\.1:(\d+)", line):
            return int(match.group(1))
    raise AssertionError("the server never printed its port")


def wait_serving(channel, timeout: float = 120) -> None:
    """Waits until the standard health service on ``channel`` reports SERVING."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    while health.Check(health_pb2.HealthCheckRequest(), timeout=10).status != health_pb2.HealthCheckResponse.SERVING:
        assert time.monotonic() < deadline, "never became SERVING"
        time.sleep(0.1)


# --------------------------------------------------------------------------------------------
# PCM16

#: A float sample sent as PCM16 comes back within a rounding step (and the 32767/32768 scale).
PCM_STEP = 1.5 / 32768


def pcm16(data: bytes) -> np.ndarray:
    """The int16 samples of little-endian PCM16 bytes."""
    return np.frombuffer(data, dtype="<i2")


def pcm16_to_float(data: bytes) -> np.ndarray:
    """The samples of little-endian PCM16 bytes as float32 in [-1, 1)."""
    return pcm16(data).astype(np.float32) / 32768


def audio_of(chunks) -> list[np.ndarray]:
    """The int16 samples of each audio chunk of a streamed gRPC answer (PCM16)."""
    return [pcm16(c.audio.data) for c in chunks if c.HasField("audio") and c.audio.num_samples]


def pcm_bytes(chunks) -> bytes:
    """The audio bytes of a streamed gRPC answer, joined."""
    return b"".join(c.audio.data for c in chunks if c.HasField("audio"))


def pcm_of(chunks) -> np.ndarray:
    """All the int16 samples of a streamed gRPC answer (PCM16), in order."""
    return np.concatenate(audio_of(chunks) or [np.zeros(0, dtype="<i2")])


# --------------------------------------------------------------------------------------------
# a reference recording

#: What the reference recording "says" (its transcript for voice cloning).
TRANSCRIPT = "This is my voice, please copy it."


def warble(seconds: float = 1.0, rate: int = 16000, pitch: float = 180.0) -> np.ndarray:
    """A warbling tone (float32): something an encoder can turn into codes."""
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * pitch * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)


def recording(seconds: float = 1.0, rate: int = 16000, pitch: float = 180.0, fmt: str = "WAV",
              channels: int = 1) -> bytes:
    """The warbling tone as an audio file (``fmt``: a soundfile format) of ``channels`` channels."""
    import soundfile as sf

    wave = warble(seconds, rate, pitch)
    wave = np.stack([wave] * channels, axis=1) if channels > 1 else wave
    buffer = io.BytesIO()
    sf.write(buffer, wave, rate, format=fmt)
    return buffer.getvalue()


# --------------------------------------------------------------------------------------------
# requests to a real server

def grpc_request(text, **fields):
    """A SynthesizeRequest: ``fields`` of SamplingParams go in its sampling settings, the others in
    the request; a ``reference`` given as audio bytes is spoken with TRANSCRIPT."""
    from audio_pipeline_client._proto import tts_pb2

    reference = fields.get("reference")
    if isinstance(reference, bytes):
        fields["reference"] = tts_pb2.VoiceReference(audio=reference, transcript=TRANSCRIPT)
    sampling_fields = tts_pb2.SamplingParams.DESCRIPTOR.fields_by_name
    sampling = tts_pb2.SamplingParams(**{k: fields.pop(k) for k in list(fields) if k in sampling_fields})
    return tts_pb2.SynthesizeRequest(text=text, sampling=sampling, **fields)


def synthesize(target, text, **fields):
    """Every message of one streamed Synthesize call."""
    from audio_pipeline_client._proto import tts_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        return list(tts_pb2_grpc.TextToSpeechStub(channel).Synthesize(grpc_request(text, **fields), timeout=120))


def alone_and_together(speak, count):
    """``speak(i)`` for i < count one after the other, then all at once (a thread each): the two
    lists of answers, index for index."""
    alone = [speak(i) for i in range(count)]
    together = [None] * count
    threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, speak(i))) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return alone, together


def socket_session(server, messages, *, until_done=1, timeout=120):
    """Sends ``messages`` over /v1/audio/stream and collects what comes back until ``until_done``
    utterances have finished (done, interrupted or error): (JSON messages, binary frames by context)."""
    from websockets.sync.client import connect

    received, audio, current = [], {}, None
    finished = 0
    with connect(f"ws://127.0.0.1:{server.http_port}/v1/audio/stream", open_timeout=30) as connection:
        for message in messages:
            connection.send(json.dumps(message))
        while finished < until_done:
            frame = connection.recv(timeout=timeout)
            if isinstance(frame, bytes):
                audio.setdefault(current, []).append(frame)
                continue
            event = json.loads(frame)
            received.append(event)
            if event["type"] == "started":
                current = event["context_id"]
            if event["type"] in ("done", "interrupted", "error"):
                finished += 1
    return received, {k: b"".join(v) for k, v in audio.items()}


def fail_core_start(message: str) -> None:
    """A hook for an engine core process (CoreProcess.hooks) that fails its start-up with ``message``."""
    raise ValueError(message)
