"""What crosses between the front end and the engine core's process, over two pyzmq PUSH/PULL
sockets on ``ipc://`` paths in a private directory (mode 0700): front end -> core (submit, cancel,
calls, stop) and core -> front end (ready, events, replies).

Each message is a multipart zmq message: a msgspec/msgpack header, then raw buffers. The audio of
many streams goes in one message (one frame of float32 PCM per chunk, sent and received without a
copy). A request's prepared context and a call's arguments are pickled: both ends are this program,
the same version, on one machine, and the sockets live in a directory only this user can open; a
context holds layout-specific objects (an alignment, a text track, tensors) that a schema would have
to spell out family by family.
"""

from __future__ import annotations

import pickle
from typing import Any

import msgspec
import numpy as np

from audio_pipeline.core.assembly import CoreFacts
from audio_pipeline.core.engine_core import AudioEvent, Usage
from audio_pipeline.core.stop import StopReason


# --- front end -> core ------------------------------------------------------------------------

class Submit(msgspec.Struct, tag=True):
    request_id: str
    #: The prepared context's fields (pickled; see context_fields).
    context: bytes


class Cancel(msgspec.Struct, tag=True):
    request_id: str


class Extend(msgspec.Struct, tag=True):
    """More words for a running text-stream request (pickled), and whether they are its last."""

    request_id: str
    words: bytes
    close: bool


class Call(msgspec.Struct, tag=True):
    """A call into the core that needs the model or the decoder (encode a recording, its speaker
    embedding, check a voice's codes, the metrics' text): run on the core's call thread, never on
    its loop. ``args`` is pickled."""

    call_id: int
    method: str
    args: bytes


class Stop(msgspec.Struct, tag=True):
    """Stop accepting, cancel what is left after ``timeout`` seconds, exit."""

    timeout: float


# --- core -> front end ------------------------------------------------------------------------

class Ready(msgspec.Struct, tag=True):
    facts: CoreFacts


class StartFailed(msgspec.Struct, tag=True):
    """The core could not be built: the exception's class name and message (the server fails with it)."""

    kind: str
    error: str


class EventHead(msgspec.Struct, array_like=True):
    kind: str
    request_id: str
    #: The index of this event's PCM frame among the message's buffers; -1: no audio.
    frame: int = -1
    chunk_index: int = 0
    final: bool = False
    #: prompt, generated tokens, audio samples, seconds to first audio, seconds in all.
    usage: tuple[int, int, int, float, float] | None = None
    stop_reason: str | None = None
    error: str | None = None
    error_kind: str | None = None
    #: A text stream's words read (AudioEvent.read).
    read: list[tuple[int, int]] | None = None


class Events(msgspec.Struct, tag=True):
    events: list[EventHead]
    #: Arrival time (monotonic clock, shared by the processes on one machine) of the oldest waiting
    #: request that starts a stream; None: none waits (the front end's at-capacity check).
    oldest_waiting: float | None = None


class Reply(msgspec.Struct, tag=True):
    call_id: int
    #: The pickled result, or the error's class name and message.
    result: bytes = b""
    error_kind: str | None = None
    error: str | None = None


class Unhealthy(msgspec.Struct, tag=True):
    """The core's loop failed repeatedly and stopped."""


ToCore = Submit | Cancel | Extend | Call | Stop
ToFrontEnd = Ready | StartFailed | Events | Reply | Unhealthy

to_core_decoder = msgspec.msgpack.Decoder(ToCore)
to_front_end_decoder = msgspec.msgpack.Decoder(ToFrontEnd)
encoder = msgspec.msgpack.Encoder()


#: The context fields a submission carries (the core rebuilds the context with its own layout).
CONTEXT_FIELDS = ("request_id", "prompt_ids", "sampling", "voice", "stream_id", "continuation",
                  "prompt_speech_codes", "alignment", "text_track", "text_rule", "prompt_frames", "arrival_time")


def pack_context(context: Any) -> bytes:
    return pickle.dumps({name: getattr(context, name) for name in CONTEXT_FIELDS}, protocol=5)


def unpack(data: bytes) -> Any:
    return pickle.loads(data)


def pack(value: Any) -> bytes:
    return pickle.dumps(value, protocol=5)


def event_frames(events: list[AudioEvent]) -> tuple[list[EventHead], list[np.ndarray]]:
    """Each event's header, and the audio buffers they point into (sent without a copy)."""
    heads, frames = [], []
    for event in events:
        frame = -1
        if event.samples is not None:
            frame = len(frames)
            frames.append(np.ascontiguousarray(event.samples, dtype=np.float32))
        usage = event.usage
        heads.append(EventHead(
            event.kind, event.request_id, frame, event.chunk_index, event.final,
            None if usage is None else (usage.prompt_tokens, usage.generated_tokens, usage.audio_samples,
                                        usage.time_to_first_audio_seconds, usage.generation_seconds),
            None if event.stop_reason is None else event.stop_reason.value, event.error,
            event.error_kind, event.read))
    return heads, frames


def audio_event(head: EventHead, buffers: list) -> AudioEvent:
    """The AudioEvent a header describes (its audio a view of the received buffer)."""
    samples = None if head.frame < 0 else np.frombuffer(buffers[head.frame], dtype=np.float32)
    usage = None if head.usage is None else Usage(*head.usage)
    return AudioEvent(head.kind, head.request_id, samples=samples, chunk_index=head.chunk_index, final=head.final,
                      usage=usage, stop_reason=None if head.stop_reason is None else StopReason(head.stop_reason),
                      error=head.error, error_kind=head.error_kind,
                      read=None if head.read is None else [tuple(pair) for pair in head.read])
