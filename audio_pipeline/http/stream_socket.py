"""The HTTP front door's WebSocket for live text, ``/v1/audio/stream``: text in as it is made (an
LLM's tokens), audio out as binary frames, several utterances on one connection.

Client -> server, JSON text frames (``context_id`` names an utterance within the connection):

- ``{"type": "start", "context_id": "a", "voice": ..., "response_format": "pcm", "sample_rate": ...,
  "normalize_text": ..., "seed": ..., "language": ..., "pronunciations": [...]}``: a new utterance
  (every field but the id optional; each as POST /v1/audio/speech's, ``response_format``'s default
  ``pcm``; a language the model does not speak is refused at the start). With ``input``
  (a whole text, or an SSML document; ``ssml`` as POST /v1/audio/speech) the utterance is complete:
  no text, flush or end follows. Live text is plain text;
- ``{"type": "text", "context_id": "a", "text": "..."}``: more of its text (a sentence is spoken
  once complete);
- ``{"type": "flush", "context_id": "a"}``: speak what has come so far;
- ``{"type": "end", "context_id": "a"}``: no more text for it;
- ``{"type": "interrupt", "context_id": "a"}``: stop it at once (barge-in).

Server -> client: utterances are spoken in the order they started, one after another. For each:
``{"type": "started", "context_id", "format", "sample_rate"}``, then its audio as binary frames,
each followed by ``{"type": "words", "context_id", "words": [...]}`` when it carries word timings
(text, text_start/text_end in the utterance's text, start/end in seconds and samples, spoken,
precision), then ``{"type": "done", "context_id", "usage"}``, or ``{"type": "interrupted",
"context_id"}``, or ``{"type": "error", "context_id", "message", "param"}`` (a bad message names
its field and leaves the connection open).
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from dataclasses import dataclass

from starlette.websockets import WebSocket, WebSocketDisconnect

from audio_pipeline.errors import InvalidArgument, RequestError, echo
from audio_pipeline.http.openai_speech import OpenAISpeech, error_fields
from audio_pipeline.service.request import SpeechAudio
from audio_pipeline.service.speech import LiveSpeechStream, SpeechStream

logger = logging.getLogger(__name__)

#: Utterances one connection may have started and not finished.
MAX_OPEN_CONTEXTS = 8
MAX_CONTEXT_ID_CHARS = 128


@dataclass
class Utterance:
    context_id: str
    stream: LiveSpeechStream | SpeechStream
    interrupted: bool = False
    ended: bool = False
    #: Its whole text came in the start message (``input``): already started, no text to follow.
    whole: bool = False
    #: Some text has come.
    had_text: bool = False


def word_json(timing, rate: int) -> dict:
    return {"text": timing.text, "text_start": timing.text_start, "text_end": timing.text_end,
            "start": round(timing.start_sample / rate, 4), "end": round(timing.end_sample / rate, 4),
            "start_sample": timing.start_sample, "end_sample": timing.end_sample, "spoken": timing.spoken,
            "precision": timing.precision}


class StreamSocket:
    """One connection."""

    def __init__(self, websocket: WebSocket, running):
        self.websocket = websocket
        self.service = running.service
        self.engine = running.engine
        self.utterances: dict[str, Utterance] = {}
        self.queue: asyncio.Queue[Utterance] = asyncio.Queue()
        self._send_lock = asyncio.Lock()

    async def send(self, message: dict | bytes) -> None:
        async with self._send_lock:
            if isinstance(message, bytes):
                await self.websocket.send_bytes(message)
            else:
                await self.websocket.send_json(message)

    async def error(self, context_id: str | None, error: RequestError | str, param: str | None = None,
                    kind: str | None = None) -> None:
        if isinstance(error, RequestError) and kind == "text" and error.field == "text":
            message, param = f"text: {error.detail}", "text"  # the text message's own field, not a start's input
        else:
            message, param = error_fields(error) if isinstance(error, RequestError) else (error, param)
        await self.send({"type": "error", "context_id": context_id, "message": message, "param": param})

    async def run(self) -> None:
        speaker = asyncio.create_task(self._speak())
        try:
            while True:
                try:
                    message = await self.websocket.receive_json()
                except WebSocketDisconnect:
                    return
                except ValueError:
                    await self.error(None, "a message that is not JSON", "message")
                    continue
                try:
                    await self._handle(message)
                except RequestError as error:
                    is_object = isinstance(message, dict)
                    await self.error(message.get("context_id") if is_object else None, error,
                                     kind=message.get("type") if is_object else None)
        finally:
            speaker.cancel()
            for utterance in self.utterances.values():
                utterance.stream.close()

    async def _handle(self, message) -> None:
        if not isinstance(message, dict):
            raise InvalidArgument("must be a JSON object", field="message")
        kind = message.get("type")
        if kind not in ("start", "text", "flush", "end", "interrupt"):
            raise InvalidArgument(f"{echo(str(kind))} is not start, text, flush, end or interrupt", field="type")
        context_id = message.get("context_id")
        if not isinstance(context_id, str) or not context_id or len(context_id) > MAX_CONTEXT_ID_CHARS:
            raise InvalidArgument(f"is required: a name of up to {MAX_CONTEXT_ID_CHARS} characters for the "
                                  "utterance", field="context_id")
        if kind == "start":
            if context_id in self.utterances:
                raise InvalidArgument(f"{echo(context_id)} is already open on this connection", field="context_id")
            if len(self.utterances) >= MAX_OPEN_CONTEXTS:
                raise InvalidArgument(f"over {MAX_OPEN_CONTEXTS} open utterances on one connection",
                                      field="context_id")
            whole = message.get("input") is not None
            settings = {key: value for key, value in message.items() if key not in ("type", "context_id")}
            try:
                wanted = OpenAISpeech(settings, [v.name for v in self.engine.voice_catalogue.listed], self.engine.manifest.default_voice,
                                      {}, default_format="pcm", takes_instructions=self.engine.layout.acts_on_instructions)
            except RequestError:
                self.service.count("invalid")
                raise
            if whole:  # a whole text (or SSML document) in one message: opened (and refused) here
                utterance = Utterance(context_id, await self.service.open(wanted.request), ended=True, whole=True)
            else:
                utterance = Utterance(context_id, self.service.open_live(wanted.request))
            self.utterances[context_id] = utterance
            self.queue.put_nowait(utterance)
            return
        utterance = self.utterances.get(context_id)
        if utterance is None:
            raise InvalidArgument(f"{echo(context_id)} is not an open utterance (send start first)", field="context_id")
        if kind == "text":
            text = message.get("text")
            if not isinstance(text, str):
                raise InvalidArgument("must be a string", field="text")
            if utterance.ended:
                raise InvalidArgument("came after the utterance's end", field="text")
            if not utterance.had_text and text.lstrip().startswith("<speak"):
                raise InvalidArgument("SSML comes whole, as the start message's input (live text is plain text)",
                                      field="text")
            utterance.had_text = utterance.had_text or bool(text.strip())
            await utterance.stream.text.add(text)
        elif utterance.whole and kind != "interrupt":
            raise InvalidArgument(f"{kind}: this utterance's whole text came with its start", field="type")
        elif kind == "flush":
            await utterance.stream.text.flush()
        elif kind == "end":
            if not utterance.ended:
                utterance.ended = True
                await utterance.stream.text.end()
        else:  # interrupt
            utterance.interrupted = True
            utterance.stream.cancel()
            if not utterance.ended:
                utterance.ended = True
                utterance.stream.end_input()

    async def _speak(self) -> None:
        """Speaks the utterances in the order they started."""
        while True:
            utterance = await self.queue.get()
            try:
                await self._speak_one(utterance)
            except asyncio.CancelledError:
                raise
            except RequestError as error:
                await self.error(utterance.context_id, error)
            except Exception:  # noqa: BLE001 - one utterance's failure must not end the connection
                logger.exception("utterance %s failed", utterance.stream.request_id)
                await self.error(utterance.context_id, "internal error")
            finally:
                utterance.stream.close()
                self.utterances.pop(utterance.context_id, None)

    async def _speak_one(self, utterance: Utterance) -> None:
        context_id, stream = utterance.context_id, utterance.stream
        if not utterance.interrupted and not utterance.whole:
            await stream.start()  # waits for its first sentence; returns at once if interrupted
        if utterance.interrupted:
            await self.send({"type": "interrupted", "context_id": context_id})
            return
        await self.send({"type": "started", "context_id": context_id, "format": stream.output.format,
                         "sample_rate": stream.sample_rate})
        async with aclosing(stream.events()) as events:
            async for event in events:
                if isinstance(event, SpeechAudio):
                    if event.data:
                        await self.send(event.data)
                    if event.words:
                        await self.send({"type": "words", "context_id": context_id,
                                         "words": [word_json(w, stream.sample_rate) for w in event.words]})
                    continue
                usage = event.usage
                await self.send({"type": "done", "context_id": context_id, "usage": {
                    "input_tokens": usage.prompt_tokens, "output_tokens": usage.generated_tokens,
                    "audio_seconds": round(event.audio_seconds, 3)}})
                return
        await self.send({"type": "interrupted", "context_id": context_id})  # the client stopped it
