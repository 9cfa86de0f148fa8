"""The HTTP front door's WebSocket for live text, ``/v1/audio/stream``: text in as it is made (an
LLM's tokens), audio out as binary frames, several utterances on one connection.

Client -> server, JSON text frames (``context_id`` names an utterance within the connection):

- ``{"type": "start", "context_id": "a", "voice": ..., "response_format": "pcm", "sample_rate": ...,
  "normalize_text": ..., "seed": ...}``: a new utterance (every field but the id optional;
  ``response_format`` as POST /v1/audio/speech, default ``pcm``);
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
from dataclasses import dataclass, field

from starlette.websockets import WebSocket, WebSocketDisconnect

from audio_pipeline.audio.encoders import StreamEncoder
from audio_pipeline.context import StopReason
from audio_pipeline.errors import InvalidArgument, RequestError, echo

logger = logging.getLogger(__name__)

#: Utterances one connection may have started and not finished.
MAX_OPEN_CONTEXTS = 8


@dataclass
class Utterance:
    context_id: str
    request_id: str
    synthesis: object
    live: object
    output: object
    encoder: StreamEncoder
    interrupted: bool = False
    ended: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)


def word_json(timing, engine_rate: int, output_rate: int) -> dict:
    timing = timing.resampled(engine_rate, output_rate)
    return {"text": timing.text, "text_start": timing.text_start, "text_end": timing.text_end,
            "start": round(timing.start_sample / output_rate, 4), "end": round(timing.end_sample / output_rate, 4),
            "start_sample": timing.start_sample, "end_sample": timing.end_sample, "spoken": timing.spoken,
            "precision": timing.precision}


class StreamSocket:
    """One connection."""

    def __init__(self, websocket: WebSocket, running):
        self.websocket = websocket
        self.servicer = running.servicer
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

    async def error(self, context_id: str | None, error: RequestError | str, param: str | None = None) -> None:
        message = str(error)
        param = getattr(error, "field", None) if isinstance(error, RequestError) else param
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
                    await self.error(message.get("context_id") if isinstance(message, dict) else None, error)
        finally:
            speaker.cancel()
            for utterance in self.utterances.values():
                utterance.synthesis.cancel()
                utterance.encoder.close()

    async def _handle(self, message) -> None:
        from audio_pipeline.service.live_text import LiveText
        from audio_pipeline.http.app import SpeechRequest
        from audio_pipeline.service.output import StreamAudioOutput
        from audio_pipeline.server.servicer import SpeechSettings

        if not isinstance(message, dict):
            raise InvalidArgument("must be a JSON object", field="message")
        kind = message.get("type")
        if kind not in ("start", "text", "flush", "end", "interrupt"):
            raise InvalidArgument(f"{echo(str(kind))} is not start, text, flush, end or interrupt", field="type")
        context_id = message.get("context_id")
        if not isinstance(context_id, str) or not context_id or len(context_id) > 128:
            raise InvalidArgument("is required: a name of up to 128 characters for the utterance",
                                  field="context_id")
        if kind == "start":
            if context_id in self.utterances:
                raise InvalidArgument(f"{echo(context_id)} is already open on this connection", field="context_id")
            if len(self.utterances) >= MAX_OPEN_CONTEXTS:
                raise InvalidArgument(f"over {MAX_OPEN_CONTEXTS} open utterances on one connection",
                                      field="context_id")
            settings = dict(message)
            settings.setdefault("response_format", "pcm")
            settings["input"] = "-"  # the text comes later
            voices = [v.name for v in self.engine.voices]
            wanted = SpeechRequest(settings, voices, self.engine.manifest.default_voice, {})
            output = StreamAudioOutput(self.engine.sample_rate, wanted.sample_rate, 0)
            try:
                encoder = StreamEncoder(wanted.response_format, output.sample_rate)
            except ValueError as error:
                raise InvalidArgument(str(error), field="sample_rate") from None
            request_id, _ = self.servicer.admit("", "context_id")
            normalize = message.get("normalize_text")
            if normalize is not None and not isinstance(normalize, bool):
                encoder.close()
                raise InvalidArgument("must be true or false", field="normalize_text")
            speech = SpeechSettings(voice=wanted.voice, normalize_text=normalize, speed=wanted.speed,
                                    overrides={} if wanted.seed is None else {"seed": wanted.seed})
            synthesis = self.servicer.synthesis(speech, request_id)
            live = LiveText(synthesis, max_chars=self.engine.config.sampling.max_text_chars,
                            max_segment_chars=self.engine.config.max_segment_chars)
            utterance = Utterance(context_id, request_id, synthesis, live, output, encoder)
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
            utterance.live.add(text)
        elif kind == "flush":
            utterance.live.flush()
        elif kind == "end":
            if not utterance.ended:
                utterance.ended = True
                utterance.live.end()
        else:  # interrupt
            utterance.interrupted = True
            utterance.synthesis.cancel()
            if not utterance.ended:
                utterance.ended = True
                utterance.synthesis.close()

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
                logger.exception("utterance %s failed", utterance.request_id)
                await self.error(utterance.context_id, "internal error")
            finally:
                utterance.synthesis.cancel()
                utterance.encoder.close()
                self.utterances.pop(utterance.context_id, None)

    async def _speak_one(self, utterance: Utterance) -> None:
        context_id = utterance.context_id
        if utterance.interrupted:
            await self.send({"type": "interrupted", "context_id": context_id})
            return
        await utterance.synthesis.start()  # waits for its first sentence; returns at once if interrupted
        if utterance.interrupted:
            await self.send({"type": "interrupted", "context_id": context_id})
            return
        await self.send({"type": "started", "context_id": context_id, "format": utterance.encoder.name,
                         "sample_rate": utterance.output.sample_rate})
        rates = (self.engine.sample_rate, utterance.output.sample_rate)
        async with aclosing(utterance.synthesis.events()) as events:
            async for event in events:
                words = [word_json(w, *rates) for w in event.words or ()]
                if event.kind == "audio":
                    data = utterance.encoder.encode(utterance.output.convert(event.samples))
                elif event.kind == "complete":
                    if event.stop_reason == StopReason.CANCELLED:
                        await self.send({"type": "interrupted", "context_id": context_id})
                        return
                    data = utterance.encoder.encode(utterance.output.finish()) + utterance.encoder.finish()
                else:
                    await self.error(context_id, event.error or "generation failed")
                    return
                if data:
                    await self.send(data)
                if words:
                    await self.send({"type": "words", "context_id": context_id, "words": words})
                if event.kind == "complete":
                    usage = event.usage
                    self.servicer.metrics.requests.labels("ok").inc()
                    await self.send({"type": "done", "context_id": context_id, "usage": {
                        "input_tokens": usage.prompt_tokens, "output_tokens": usage.generated_tokens,
                        "audio_seconds": round(usage.audio_samples / self.engine.sample_rate, 3)}})
                    return
