"""Hostile Synthesize requests for the reliability suite, as raw request bytes.

Every case is bytes on the wire, so corrupt messages, invalid UTF-8 and field values the client
library would refuse to build all go through the same call. A case's ``kind`` says what it tries;
none of them may get UNKNOWN or INTERNAL, harm another request, or leave anything behind.
"""

from __future__ import annotations

import io
import math
import random
from dataclasses import dataclass

import numpy as np
import soundfile as sf

from audio_pipeline_client._proto import tts_pb2

SENTENCES = ["Hello there.", "The train leaves at nine.", "Is it raining?", "We met on the fourth of May.",
             "Call me back, please!", "Numbers like 42 and 3.5 are fine."]
FLOATS = [0.0, -0.0, 1e-45, 1e-40, 1e-6, 0.01, 0.5, 1.0, 2.0, 100.0, 1e6, 1e38, -1.0, -1e38,
          math.inf, -math.inf, math.nan]
INTS = [-(2 ** 31), -1, 0, 1, 4, 7, 8, 28, 64, 140, 4096, 5000, 2 ** 31 - 1]
SAMPLE_RATES = [0, 1, 7999, 8000, 16000, 22050, 24000, 44100, 192000, 192001, 2 ** 32 - 1]
ENCODINGS = [0, 1, 2, 3, 99, 2 ** 31 - 1]
FLOAT_FIELDS = ("temperature", "top_p", "repetition_penalty", "min_p", "frequency_penalty", "presence_penalty")
INT_FIELDS = ("top_k", "max_tokens", "min_tokens")


@dataclass(frozen=True)
class FuzzCase:
    kind: str
    payload: bytes


def _odd_text(rng: random.Random) -> str:
    choice = rng.randrange(12)
    if choice == 0:
        return ""
    if choice == 1:
        return " \t\n " * rng.randrange(1, 50)
    if choice == 2:  # any code points but surrogates (not encodable), controls included
        return "".join(chr(c) for c in (rng.randrange(0x110000) for _ in range(rng.randrange(1, 300)))
                       if not 0xD800 <= c <= 0xDFFF)
    if choice == 3:
        return "".join(rng.choice("\u200b\u200d\u202e\ufeff\u0301\U0001F600\u05d0\u0627") for _ in range(80))
    if choice == 4:
        return "." * rng.randrange(1, 3000)
    if choice == 5:
        return "a" * rng.randrange(100, 3000)
    if choice == 6:
        return str(rng.randrange(10 ** 40))
    if choice == 7:  # over any sane limit
        return rng.choice(SENTENCES) * rng.randrange(100, 4000)
    if choice == 8:
        return "\x00\x01\x02 hello \x7f"
    return " ".join(rng.choice(SENTENCES) for _ in range(rng.randrange(1, 4)))


def _odd_string(rng: random.Random) -> str:
    return rng.choice(["", "default", "../../etc/passwd", "a/b", "x" * 200, "v" * 100_000, "line\nbreak",
                       "\u202eevil", "alloy", "".join(chr(rng.randrange(32, 0x3000)) for _ in range(20))])


def _wav(rng: random.Random) -> bytes:
    rate = rng.choice([8000, 16000, 24000, 44100])
    seconds = rng.choice([0.05, 1.0, 3.0])
    t = np.arange(int(rate * seconds)) / rate
    buffer = io.BytesIO()
    sf.write(buffer, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), rate, format="WAV")
    return buffer.getvalue()


def _reference(rng: random.Random) -> tts_pb2.VoiceReference:
    choice = rng.randrange(5)
    audio = [b"", rng.randbytes(rng.randrange(1, 2000)), _wav(rng)[:rng.randrange(1, 60)], _wav(rng),
             b"RIFF\xff\xff\xff\xffWAVE"][choice]
    return tts_pb2.VoiceReference(audio=audio, transcript=rng.choice(["", "Hello there.", "x" * 5000]))


def random_request(rng: random.Random) -> tts_pb2.SynthesizeRequest:
    """A request with random, often extreme, field values."""
    request = tts_pb2.SynthesizeRequest(text=_odd_text(rng) if rng.random() < 0.6 else rng.choice(SENTENCES))
    if rng.random() < 0.3:
        request.voice = _odd_string(rng)
    if rng.random() < 0.3:
        request.request_id = _odd_string(rng)
    if rng.random() < 0.3:
        request.encoding = rng.choice(ENCODINGS)
    if rng.random() < 0.3:
        request.sample_rate = rng.choice(SAMPLE_RATES)
    sampling = request.sampling
    for name in FLOAT_FIELDS:
        if rng.random() < 0.25:
            setattr(sampling, name, rng.choice(FLOATS))
    for name in INT_FIELDS:
        if rng.random() < 0.25:
            setattr(sampling, name, rng.choice(INTS))
    if rng.random() < 0.2:
        sampling.seed = rng.choice([0, 1, 2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1])
    if rng.random() < 0.15:
        sampling.stop_token_ids.extend(rng.randrange(2 ** 32) if rng.random() < 0.5 else rng.randrange(5000)
                                       for _ in range(rng.choice([1, 3, 64, 65, 1000])))
    if rng.random() < 0.08:
        request.reference.CopyFrom(_reference(rng))
    return request


def _invalid_utf8(rng: random.Random) -> bytes:
    """A request whose text or voice field holds bytes that are not UTF-8."""
    junk = rng.choice([b"\xff\xfe", b"\xc3\x28", b"\xed\xa0\x80", b"ok\x80ok", b"\xf8\x88\x80\x80\x80"])
    field = rng.choice([1, 2, 6])  # text, voice, request_id
    good = tts_pb2.SynthesizeRequest(text="Hello there.").SerializeToString() if field != 1 else b""
    return good + bytes([field << 3 | 2, len(junk)]) + junk


def _corrupt(rng: random.Random) -> bytes:
    valid = random_request(rng).SerializeToString() or b"\x0a\x02hi"
    choice = rng.randrange(4)
    if choice == 0:
        return rng.randbytes(rng.randrange(1, 300))
    if choice == 1:
        return valid[:max(1, rng.randrange(len(valid)))] + b"\x0a\x7f"  # a field longer than the message
    if choice == 2:
        data = bytearray(valid)
        for _ in range(rng.randrange(1, 8)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        return bytes(data)
    return b"\xff" * rng.randrange(1, 20)  # an unterminated varint


def fuzz_cases(count: int, seed: int = 0) -> list[FuzzCase]:
    """``count`` cases: about half random field values, the rest corrupt bytes and invalid UTF-8."""
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        roll = rng.random()
        if roll < 0.5:
            cases.append(FuzzCase("fields", random_request(rng).SerializeToString()))
        elif roll < 0.8:
            cases.append(FuzzCase("corrupt", _corrupt(rng)))
        else:
            cases.append(FuzzCase("utf8", _invalid_utf8(rng)))
    return cases
