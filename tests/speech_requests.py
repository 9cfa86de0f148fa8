"""Test helpers for requests through a real gRPC server: a reference recording (WAV bytes), a
SynthesizeRequest, a whole streamed answer and its audio chunks."""

from __future__ import annotations

import io

import grpc
import numpy as np
import soundfile as sf

TRANSCRIPT = "This is my voice, please copy it."
#: SynthesizeRequest fields that go in its sampling settings.
SAMPLING_FIELDS = ("seed", "max_tokens", "min_tokens", "temperature")


def recording(seconds=1.0, rate=16000, pitch=180.0) -> bytes:
    """A WAV of a warbling tone: something an encoder can turn into codes."""
    t = np.arange(int(seconds * rate)) / rate
    wave = 0.3 * np.sin(2 * np.pi * pitch * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))
    buffer = io.BytesIO()
    sf.write(buffer, wave.astype(np.float32), rate, format="WAV")
    return buffer.getvalue()


def grpc_request(text, **fields):
    """A SynthesizeRequest; ``reference`` (WAV bytes) is spoken with TRANSCRIPT."""
    from audio_pipeline_client._proto import tts_pb2

    reference = fields.pop("reference", None)
    if reference is not None:
        fields["reference"] = tts_pb2.VoiceReference(audio=reference, transcript=TRANSCRIPT)
    sampling = tts_pb2.SamplingParams(**{k: fields.pop(k) for k in SAMPLING_FIELDS if k in fields})
    return tts_pb2.SynthesizeRequest(text=text, sampling=sampling, **fields)


def synthesize(target, text, **fields):
    """Every message of one streamed Synthesize call."""
    from audio_pipeline_client._proto import tts_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        return list(tts_pb2_grpc.TextToSpeechStub(channel).Synthesize(grpc_request(text, **fields), timeout=120))


def audio_of(chunks):
    """The int16 samples of each audio chunk of a streamed answer."""
    return [np.frombuffer(c.audio.data, "<i2") for c in chunks if c.HasField("audio") and c.audio.num_samples]


def alone_and_together(speak, count):
    """``speak(i)`` for i < count one after the other, then all at once (a thread each): the two
    lists of answers, index for index."""
    import threading

    alone = [speak(i) for i in range(count)]
    together = [None] * count
    threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, speak(i))) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return alone, together
