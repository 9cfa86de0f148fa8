"""The audio generation engine: queue, admission, the generation loop, chunked decoding, delivery.

One background thread owns the model, the KV cache and the decoder. Callers submit a context with
a sink (a thread-safe callback) and receive AudioEvents through it; cancel() may come from any
thread. Every request ends with exactly one `complete` or `error` event, and whatever it held is
released before that event is sent.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from audio_pipeline.context import StopReason, TTSContext
from audio_pipeline.decoders.base import AudioDecoder
from audio_pipeline.decoders.chunker import ChunkSchedule, DecodeWindow
from audio_pipeline.errors import ResourceExhausted, Unavailable
from audio_pipeline.pipelines.text_generation import TextGenerationInputs, TextGenerationPipeline

logger = logging.getLogger(__name__)


@dataclass
class Usage:
    prompt_tokens: int
    generated_tokens: int
    audio_samples: int
    time_to_first_audio_seconds: float
    generation_seconds: float


@dataclass
class AudioEvent:
    """What the engine tells a request's sink: audio, completion, or failure."""

    kind: str  # "audio" | "complete" | "error"
    request_id: str
    samples: np.ndarray | None = None
    chunk_index: int = 0
    final: bool = False
    usage: Usage | None = None
    stop_reason: StopReason | None = None
    error: str | None = None


Sink = Callable[[AudioEvent], None]


@dataclass
class _Request:
    context: TTSContext
    sink: Sink
    audio_samples: int = 0


class AudioGenerationEngine:
    """Continuous batching of speech-token generation plus chunked, batched audio decoding."""

    def __init__(self, pipeline: TextGenerationPipeline, decoder: AudioDecoder, schedule: ChunkSchedule, *,
                 max_batch_size: int, max_queue_size: int, max_batch_input_tokens: int,
                 on_step: Callable[["AudioGenerationEngine"], None] | None = None):
        self.pipeline = pipeline
        self.decoder = decoder
        self.schedule = schedule
        self.max_batch_size = max_batch_size
        self.max_queue_size = max_queue_size
        self.max_batch_input_tokens = max_batch_input_tokens
        self.on_step = on_step
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._cancelled: set[str] = set()
        self._lock = threading.Condition()
        self._accepting = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        #: Finished requests by stop reason, since start (cancellations included).
        self.stop_reasons: Counter[StopReason] = Counter()

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            self._accepting = True
            self._thread = threading.Thread(target=self._run, name="audio-generation", daemon=True)
            self._thread.start()

    def stop_accepting(self) -> None:
        """New submissions get Unavailable; work already queued or running goes on."""
        with self._lock:
            self._accepting = False

    def stop(self, timeout: float | None = None) -> None:
        """Stops accepting work, cancels whatever is left after ``timeout`` seconds, ends the thread."""
        self.stop_accepting()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while (self._waiting or self._running) and (deadline is None or time.monotonic() < deadline):
                self._lock.wait(timeout=0.05 if deadline is None else max(0.0, min(0.05, deadline - time.monotonic())))
            for request in [*self._waiting, *self._running]:
                self._cancelled.add(request.context.request_id)
            self._stopping = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    @property
    def load(self) -> tuple[int, int]:
        """(queued, running) request counts."""
        with self._lock:
            return len(self._waiting), len(self._running)

    # --- requests --------------------------------------------------------------------------------

    def submit(self, context: TTSContext, sink: Sink) -> None:
        """Queues a request; ResourceExhausted when the queue is full, Unavailable when not accepting."""
        with self._lock:
            if not self._accepting:
                raise Unavailable("the server is not accepting requests (starting up or shutting down)")
            if len(self._waiting) >= self.max_queue_size:
                raise ResourceExhausted(f"the request queue is full ({self.max_queue_size} waiting); retry later")
            if any(r.context.request_id == context.request_id for r in [*self._waiting, *self._running]):
                raise ValueError(f"request_id {context.request_id!r} is already in flight")
            self._waiting.append(_Request(context, sink))
            self._lock.notify_all()

    def cancel(self, request_id: str) -> None:
        """Stops a queued or running request; its sink gets a `complete` event with CANCELLED."""
        with self._lock:
            self._cancelled.add(request_id)
            self._lock.notify_all()

    # --- the loop --------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                while not (self._waiting or self._running or self._stopping):
                    self._lock.wait()
                if self._stopping and not (self._waiting or self._running):
                    return
                self._drop_cancelled()
                self._admit()
                batch = list(self._running)
            if batch:
                self._step(batch)
            with self._lock:
                self._lock.notify_all()
            if self.on_step is not None:
                self.on_step(self)

    def _drop_cancelled(self) -> None:
        if not self._cancelled:
            return
        for queue in (self._waiting, self._running):
            for request in [r for r in queue if r.context.request_id in self._cancelled]:
                queue.remove(request)
                request.context.stop_reason = StopReason.CANCELLED
                self._finish(request, event_kind="complete")
        live = {r.context.request_id for r in [*self._waiting, *self._running]}
        self._cancelled &= live

    def _admit(self) -> None:
        kv = self.pipeline.kv_manager
        input_tokens = len(self._running)
        while self._waiting and len(self._running) < self.max_batch_size:
            context = self._waiting[0].context
            prompt = len(context.prompt_ids)
            if input_tokens + prompt > self.max_batch_input_tokens and self._running:
                break
            if not kv.can_claim(context.max_length):
                break
            request = self._waiting.popleft()
            kv.claim(context.request_id, context.max_length, initial_length=prompt + 64)
            self._running.append(request)
            input_tokens += prompt

    def _step(self, batch: list[_Request]) -> None:
        try:
            self.pipeline.execute(TextGenerationInputs([r.context for r in batch]))
            windows = [(r, self._next_window(r)) for r in batch]
            self._decode([(r, w) for r, w in windows if w is not None])
            # A request may need several windows at the end (a long remainder after the last chunk).
            while pending := [(r, w) for r in batch if r.context.is_done and (w := self._next_window(r))]:
                self._decode(pending)
        except Exception as exc:  # noqa: BLE001 - one bad batch must not take the engine down
            logger.exception("generation step failed; failing its %d request(s)", len(batch))
            with self._lock:
                for request in batch:
                    if request in self._running:
                        self._running.remove(request)
                        request.context.stop_reason = StopReason.FAILED
                        self._finish(request, event_kind="error", error=f"generation failed: {exc}")
            return
        with self._lock:
            for request in batch:
                context = request.context
                if context.is_done and context.decoded_index == len(context.generated) and request in self._running:
                    self._running.remove(request)
                    self._finish(request, event_kind="complete")

    def _next_window(self, request: _Request) -> DecodeWindow | None:
        context = request.context
        return self.schedule.next_window(len(context.generated), context.decoded_index,
                                         context.chunks_decoded, finished=context.is_done)

    def _decode(self, jobs: list[tuple[_Request, DecodeWindow]]) -> None:
        if not jobs:
            return
        codes = [r.context.speech_codes(w.start, w.end) for r, w in jobs]
        waves = self.decoder.decode_batch(codes)
        frame = self.decoder.tokens_per_frame
        for (request, window), wave in zip(jobs, waves):
            context = request.context
            drop = window.context_tokens // frame * self.decoder.samples_per_frame
            samples = wave[drop:].detach().to("cpu", torch.float32).numpy()
            context.decoded_index = window.end
            context.chunks_decoded += 1
            if context.first_audio_time is None:
                context.first_audio_time = time.monotonic()
            request.audio_samples += samples.shape[0]
            self._deliver(request, AudioEvent("audio", context.request_id, samples=samples,
                                              chunk_index=window.chunk_index, final=window.final))

    def _finish(self, request: _Request, *, event_kind: str, error: str | None = None) -> None:
        context = request.context
        self.pipeline.release(context.request_id)
        context.finish_time = time.monotonic()
        self.stop_reasons[context.stop_reason] += 1
        first_audio = context.first_audio_time or context.finish_time
        usage = Usage(prompt_tokens=len(context.prompt_ids), generated_tokens=len(context.generated),
                      audio_samples=request.audio_samples,
                      time_to_first_audio_seconds=first_audio - context.arrival_time,
                      generation_seconds=context.finish_time - context.arrival_time)
        self._deliver(request, AudioEvent(event_kind, context.request_id, usage=usage,
                                          stop_reason=context.stop_reason, error=error))

    def _deliver(self, request: _Request, event: AudioEvent) -> None:
        try:
            request.sink(event)
        except Exception:  # noqa: BLE001 - a broken sink only affects its own request
            logger.exception("delivering %s event for %s failed", event.kind, event.request_id)
            self._cancelled.add(request.context.request_id)
