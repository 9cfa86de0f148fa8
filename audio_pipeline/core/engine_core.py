"""The engine core: queue, admission, the generation loop (schedule -> run -> update, written once),
chunked decoding, delivery.

One background thread owns the scheduler, the model runner, the KV cache and the decoder. Callers submit a context with
a sink (a thread-safe callback) and receive AudioEvents through it; cancel() may come from any
thread. Every request ends with exactly one `complete` or `error` event, and whatever it held is
released before that event is sent.

The scheduler ends requests (their tokens' stop conditions in its update; cancellations and
failures through its finish, at the start of a round or where the failure happens) and hands back
the ones it let go; the engine only delivers their last events, once their audio is decoded, and
frees what it holds of them (decoder stream, model runner state, sink).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from audio_pipeline.core.deadlines import Listeners
from audio_pipeline.core.request import TTSContext
from audio_pipeline.decoders.base import AudioDecoder
from audio_pipeline.decoders.chunker import DecodeWindow
from audio_pipeline.decoders.streaming import DecoderStream, decode_windows
from audio_pipeline.errors import AlreadyExists, InvalidArgument, ResourceExhausted, Unavailable, echo
from audio_pipeline.core.metrics import EngineMetrics
from audio_pipeline.core.runtime import configure_cpu_runtime
from audio_pipeline.core.model_runner import ModelRunner, PendingStep
from audio_pipeline.core.step_timing import StepTimer
from audio_pipeline.core.scheduler import AudioGenerationScheduler, Finished, QueueFull, SchedulerOutput, StepResult
from audio_pipeline.core.stop import StopReason

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
    #: The class of request error an `error` event stands for, by name ("Unavailable": the engine
    #: core stopped; "ResourceExhausted", "InvalidArgument": refused on submission in the engine
    #: core's process); None: the generation failed (GenerationFailed). errors.error_of_kind.
    error_kind: str | None = None
    #: Word timings that go with this event (see SegmentedSynthesis.events).
    words: list | None = None
    #: A text stream's words read, as its model read them: (index among the request's words read,
    #: the sample of its audio where the word starts), each once, with the audio it starts in.
    read: list | None = None


Sink = Callable[[AudioEvent], None]


@dataclass
class StreamSettings:
    """How each request's audio is chunked and decoded (see decoders/streaming.py)."""

    chunk_size: list[int] | None = None
    buffer: int = 0
    block_causal: bool = False
    prepend: str = "never"
    prepend_causal: bool = False

    @classmethod
    def from_config(cls, config) -> "StreamSettings":
        return cls(config.chunk_size, config.buffer, config.block_causal,
                   str(getattr(config.prepend_prompt_speech_tokens, "value", config.prepend_prompt_speech_tokens)),
                   config.prepend_prompt_speech_tokens_causal)


@dataclass
class _Request:
    context: TTSContext
    sink: Sink
    stream: DecoderStream
    audio_samples: int = 0
    #: How it ended, once the scheduler let it go (sent with its last event once its audio is decoded).
    finished: Finished | None = None
    #: A window of it is being decoded on the decoder thread (its next one waits for that one).
    decoding: bool = False
    #: A text stream's words read that its events have carried.
    read_sent: int = 0


#: Consecutive failed rounds of the engine loop after which it stops and reports unhealthy.
MAX_LOOP_FAILURES = 3
#: A failed request's error in place of the exception that failed it (no internal names in what a
#: client reads; the exception and its traceback are in the log).
LOGGED = "the server's log has the details"


class EngineCore:
    """Continuous batching of speech-token generation plus chunked, batched audio decoding.

    ``runner``: the model runner, or a function that builds it, called once on the engine's thread
    when it starts (on the CPU its buffers are then that thread's: measured faster through the
    server). ``overlap``: launch each step before reading the one before's result (the runner
    takes the sampled tokens from the device)."""

    def __init__(self, runner: ModelRunner | Callable[[], ModelRunner], decoder: AudioDecoder,
                 streaming: StreamSettings, scheduler: AudioGenerationScheduler, *, overlap: bool = False,
                 timer: StepTimer | None = None, metrics: EngineMetrics | None = None,
                 on_step: Callable[["EngineCore"], None] | None = None, num_threads: int | None = None,
                 decode_stream: torch.cuda.Stream | None = None, decode_thread: bool | None = None):
        self._runner = runner if isinstance(runner, ModelRunner) else None
        self._make_runner = None if isinstance(runner, ModelRunner) else runner
        self.overlap = overlap
        #: Seconds per step phase (the runner's too); flushed into the metrics after each round.
        self.timer = timer or StepTimer()
        self.decoder = decoder
        self.streaming = streaming
        self.scheduler = scheduler
        self.metrics = metrics or EngineMetrics()
        self.on_step = on_step
        #: Intra-op threads set on the engine thread (None leaves torch's setting alone).
        self.num_threads = num_threads
        #: CUDA: the decoder's own stream, so audio decoding neither waits behind the model's queued
        #: steps nor holds them up (its output comes back to the host on this stream alone).
        self.decode_stream = decode_stream
        #: Audio is decoded on a thread of its own (the default with a decode stream: on CUDA the loop
        #: would otherwise wait for the decoder's kernels and the audio's copy back on every chunk,
        #: while the GPU could run the next steps). On the CPU the decoder shares the loop's cores and
        #: runs in the loop. Each request has at most one window in decoding; batches are delivered in
        #: the order they were started.
        self.decode_thread = decode_stream is not None if decode_thread is None else decode_thread
        self._decoder: ThreadPoolExecutor | None = None
        #: Windows being decoded on the decoder thread: (their requests and windows, the result).
        self._decoding: deque[tuple[list[tuple[_Request, DecodeWindow]], Future]] = deque()
        self._requests: dict[str, _Request] = {}
        #: Requests not yet given their first token, with how many tokens they held when submitted:
        #: the first-token notes read these few, not every row of every step.
        self._awaiting_first: dict[str, tuple[_Request, int]] = {}
        #: The requests the scheduler let go, until their last event is sent.
        self._ended: dict[str, _Request] = {}
        self._cancelled: set[str] = set()
        self._lock = threading.Condition()
        self._accepting = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        #: Launched forward passes whose results are not applied yet: (their output, the pass, whether it
        #: is the output's last). With overlap, the last round's stay here while the next one runs.
        self._pending: list[tuple[SchedulerOutput, PendingStep, bool]] = []
        self._prefix_seen = (0, 0)
        self._load_membership = -1  # the scheduler's membership the load gauges were counted at
        #: Finished requests by stop reason, since start (cancellations included).
        self.stop_reasons: Counter[StopReason] = Counter()
        self.metrics.kv_blocks_total.set(scheduler.block_manager.total_num_blocks)
        #: False once the loop has failed repeatedly and stopped: health reports NOT_SERVING.
        self.healthy = True
        #: Called (from the engine thread) when the loop stops for good.
        self.on_unhealthy: Callable[[], None] | None = None
        self._last_step = time.monotonic()
        self.metrics.last_step_age.set_function(self._step_age)
        #: Each stream as its listener hears it, for the scheduler's deadlines.
        self.listeners = Listeners()
        #: The running requests that read a text stream (their rule's): paced while they wait for words.
        self._text_streams: dict[str, _Request] = {}

    def _step_age(self) -> float:
        """Seconds since the loop last came round (0 while it has nothing to do)."""
        with self._lock:
            busy = bool(self._requests)
        return time.monotonic() - self._last_step if busy else 0.0

    @property
    def runner(self) -> ModelRunner:
        """The model runner, built on first use (the engine's first step, on its thread, unless it
        was given built)."""
        if self._runner is None:
            self._runner = self._make_runner()
        return self._runner

    def wait_for_steps(self) -> None:
        """Waits until every launched step has run (before the KV cache's tensors are replaced)."""
        if self._runner is not None:
            self._runner.wait()

    # --- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            self._accepting = True
            self._stopping = False
            if self.decode_thread and self._decoder is None:
                self._decoder = ThreadPoolExecutor(1, thread_name_prefix="audio-decode",
                                                   initializer=self._on_model_device)
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
            while self._requests and (deadline is None or time.monotonic() < deadline):
                self._lock.wait(timeout=0.05 if deadline is None else max(0.0, min(0.05, deadline - time.monotonic())))
            self._cancelled.update(self._requests)
            self._stopping = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._decoder is not None:
            self._decoder.shutdown(wait=True)
            self._decoder = None
            self._decoding.clear()  # only requests that ended before their audio (cancelled, failed)
        if self._runner is not None:
            self._runner.close()  # waits for the steps in flight; stops the CPU worker

    @property
    def load(self) -> tuple[int, int]:
        """(queued, running) request counts."""
        with self._lock:
            return self.scheduler.num_waiting, self.scheduler.num_running

    def holdings(self) -> tuple[int, int, int, int]:
        """(queued, running) requests, the KV cache's sequences and its blocks in use: all 0 once the
        engine holds nothing (the tests' leak check)."""
        with self._lock:
            blocks = self.scheduler.block_manager
            return (self.scheduler.num_waiting, self.scheduler.num_running, len(blocks.sequences),
                    blocks.num_used_blocks)

    @property
    def idle(self) -> bool:
        """No request queued or running, and no KV block held."""
        with self._lock:
            return not self._requests and self.scheduler.block_manager.num_used_blocks == 0

    # --- requests --------------------------------------------------------------------------------

    def submit(self, context: TTSContext, sink: Sink) -> None:
        """Queues a request; ResourceExhausted when the queue is full, Unavailable when not accepting."""
        with self._lock:
            if not self._accepting:
                raise self.unavailable()
            if context.request_id in self._requests:
                raise AlreadyExists(f"{echo(context.request_id)} is already in flight", field="request_id")
            try:
                self.scheduler.add(context)
            except QueueFull as exc:
                raise ResourceExhausted(str(exc)) from None
            except ValueError as exc:
                raise InvalidArgument(str(exc), field="sampling.max_tokens") from None
            settings = self.streaming
            stream = DecoderStream(self.decoder, chunk_size=settings.chunk_size, buffer=settings.buffer,
                                   block_causal=settings.block_causal, prepend=settings.prepend,
                                   prepend_causal=settings.prepend_causal, prompt_codes=context.prompt_speech_codes)
            self._requests[context.request_id] = request = _Request(context, sink, stream)
            if context.text_rule is not None:
                self._text_streams[context.request_id] = request
            self._awaiting_first[context.request_id] = (request, len(context.generated))
            self.listeners.add(context.request_id, context.stream_id)
            self._update_load()
            self._lock.notify_all()

    @property
    def accepting(self) -> bool:
        return self._accepting

    def unavailable(self) -> Unavailable:
        """The error for a submission while not accepting."""
        return Unavailable("the server is not accepting requests (starting up or shutting down)" if self.healthy
                           else "the engine has failed and stopped; the server needs a restart")

    def has_room(self, pending: int = 0) -> bool:
        """Whether a request submitted now would be queued (not refused as over capacity), with
        ``pending`` others being prepared for submission."""
        with self._lock:
            return self.scheduler.has_room(pending)

    def queue_wait(self) -> float:
        """Seconds the oldest waiting request that starts a stream has waited; 0 when none waits."""
        with self._lock:
            return self.scheduler.queue_wait()

    def at_capacity(self) -> float | None:
        """Seconds the oldest new request has waited for admission, where that is over
        ``max_queue_wait_ms`` (the server is past its capacity: the queue is not moving); else None."""
        limit = self.scheduler.config.max_queue_wait_ms
        with self._lock:
            waited = self.scheduler.queue_wait()
        return waited if limit is not None and waited * 1000 > limit else None

    def extend(self, request_id: str, words: list, close: bool = False) -> None:
        """More words for a running text-stream request (its rule takes them at its next step),
        and with ``close`` the end of its words. Nothing for a request that has ended."""
        with self._lock:
            request = self._requests.get(request_id)
            rule = request.context.text_rule if request is not None else None
            if rule is None:
                return
            if words:
                rule.state.add_words(words)
            if close:
                rule.state.close()
            self._lock.notify_all()  # a request that sat out waiting for words goes on now

    def cancel(self, request_id: str) -> None:
        """Stops a queued or running request; its sink gets a `complete` event with CANCELLED."""
        with self._lock:
            if request_id in self._requests:
                self._cancelled.add(request_id)
                self._lock.notify_all()

    # --- the loop --------------------------------------------------------------------------------

    def _run(self) -> None:
        if self.num_threads is not None:
            configure_cpu_runtime(self.num_threads)
        self._on_model_device()
        failures = 0
        while True:
            try:
                if not self._iterate():
                    return
                failures = 0
            except Exception:  # noqa: BLE001 - the loop must outlive any one failure
                failures += 1
                logger.exception("engine loop failed (%d in a row); failing the requests it held", failures)
                self._fail_all(f"internal error ({LOGGED})")
                if failures >= MAX_LOOP_FAILURES:
                    self._give_up()
                    return

    def _iterate(self) -> bool:
        """One round of the loop: schedule -> run (the scheduler's update applies what is due) ->
        decode the audio that is due -> deliver. False once the engine has stopped."""
        started = time.monotonic()
        output = self._schedule()
        if output is None:
            return False
        if not (output.items or self._pending or self._decode_ready()):
            self._idle(output)
            return True
        try:
            self._note_first_tokens(self._run_model(output))
            self._decode_due()
        except Exception as exc:  # noqa: BLE001 - one bad batch must not take the engine down
            logger.exception("generation step failed; failing its %d request(s)", len(output.items))
            self._recover_from_failure([item.request for item in output.items], exc)
        self._end_round(output)
        now = time.monotonic()
        # How fast the rows in decode gain audio, all the round's work counted (the admission's measure).
        self.scheduler.pass_rate.observe(now, now - started, output.num_steps if output.kind in ("tg", "mixed") else 0)
        if self.scheduler.config.deadline_scheduling:  # only deadlines read what steps cost
            self._learn_costs(output, now - started)
        return True

    def _learn_costs(self, output: SchedulerOutput, seconds: float) -> None:
        """What the round took, for the scheduler's estimates of what steps take (its deadlines)."""
        if not output.items:
            return
        costs = self.scheduler.costs
        if output.kind == "tg":
            costs.observe_decode(len(output.items), seconds / output.num_steps)
            return
        prompt = sum(item.num_tokens for item in output.items if item.start < len(item.request.prompt_ids))
        costs.observe_prefill(prompt, sum(item.start >= len(item.request.prompt_ids) for item in output.items), seconds)

    def _mark_deadlines(self) -> None:
        """Each running request's deadline, whether it has been heard and the decode passes to its
        next chunk, where the scheduler reads them (core/scheduler.py, deadline scheduling)."""
        target = self.scheduler.config.first_audio_target_ms / 1000.0
        listeners = self.listeners
        for request_id, request in self._requests.items():
            context = request.context
            deadline = listeners.deadline(request_id)
            context.heard = deadline is not None
            if deadline is None and not listeners.follows(request_id):
                deadline = context.arrival_time + target
            context.deadline = deadline
            stream = request.stream
            length = stream.schedule.chunk_length(stream.chunks_decoded)
            pending = context.speech_code_count - stream.decoded_index
            need = (length - pending) if length is not None else context.token_budget * context.layout.codes_per_token
            context.passes_to_chunk = max(0, -(-need // context.layout.codes_per_token))

    def _waiting_for_words(self) -> frozenset[str]:
        """Text-stream requests that have read every word they have, more may come, and whose
        listener has more than text_wait_lead_ms of audio left: they sit out the rounds until it has
        less or words come (the model pads as fast as it runs: a pause in live text would be heard
        many times as long)."""
        lead = self.scheduler.config.text_wait_lead_ms
        if lead is None or not self._text_streams:
            return frozenset()
        latest = time.monotonic() + lead / 1000.0
        held = []
        for request_id, request in self._text_streams.items():
            rule = request.context.text_rule
            if rule.waiting:
                plays_until = self.listeners.deadline(request_id)
                # A later request of its stream is not due before the earlier ones play out: it waits
                # once the audio of the words it read is made.
                behind = (self.listeners.follows(request_id)
                          and rule.frames_since_word > request.context.layout.frames_after_end)
                if behind or (plays_until is not None and plays_until > latest):
                    held.append(request_id)
        return frozenset(held)

    def _schedule(self) -> SchedulerOutput | None:
        """Waits for work; applies cancellations, schedules the round and ends what it let go.
        None once the engine is stopping with nothing left."""
        with self._lock:
            while not (self._requests or self._stopping or self._pending):
                self._lock.wait()
            self._last_step = time.monotonic()
            if self._stopping and not self._requests and not self._pending:
                return None
            self._apply_cancellations()
            started = time.perf_counter()
            if self.scheduler.config.deadline_scheduling:
                self._mark_deadlines()
            self.scheduler.hold(self._waiting_for_words())
            output = self.scheduler.schedule()
            self.timer.add("schedule", time.perf_counter() - started)
            self._take_ended(output.finished)
            self._deliver_ended()
            self._update_load()
        if output.preempted:
            self.metrics.preemptions.inc(len(output.preempted))
        return output

    def _idle(self, output: SchedulerOutput) -> None:
        """Nothing to compute or decode this round: wait for the audio being decoded, else for work
        (at most as long as the scheduler asks, e.g. to gather prompts)."""
        if self._decoding:
            self._collect_decoded(wait=True)
            with self._lock:
                self._deliver_ended()
                self._update_load()
            return
        with self._lock:
            if not self._deliver_ended() and not self._cancelled:
                self._lock.wait(timeout=output.wait_s or 0.005)

    def _note_first_tokens(self, results: list[StepResult]) -> None:
        """Times the first token of each request the results applied one to (the update appended
        it): only requests still waiting for one are looked at."""
        if not results or not self._awaiting_first:
            return
        now = time.monotonic()
        requests = self._requests
        for request_id, (request, held) in list(self._awaiting_first.items()):
            context = request.context
            if requests.get(request_id) is not request:  # ended without a token
                del self._awaiting_first[request_id]
            elif len(context.generated) > held:
                del self._awaiting_first[request_id]
                if context.first_token_time is None:
                    context.first_token_time = now
                    self.metrics.time_to_first_token.observe(now - context.arrival_time)

    def _decode_due(self) -> None:
        """Delivers the decoder thread's finished audio, and decodes the windows now due (in one
        batch; with the decoder thread, once its batch in flight is done)."""
        self._collect_decoded()
        if self._decoder_busy:
            return
        with self._lock:
            # A running stream's next window is due once its codes reach the stream's due_at (its
            # chunk's end): one comparison a row; ended ones ask their stream (the final chunk).
            active = [r for r in self._requests.values()
                      if r.context.stop_reason is not None
                      or r.context.speech_code_count >= r.stream.due_at]
        self._decode([(r, w) for r in active if (w := self._next_window(r)) is not None])
        # A request may need several windows at the end (a long remainder after the last chunk);
        # on the decoder thread they come one batch after another.
        while self._decoder is None and (
                pending := [(r, w) for r in active if r.context.is_done and (w := self._next_window(r))]):
            self._decode(pending)

    def _end_round(self, output: SchedulerOutput) -> None:
        with self._lock:
            self._deliver_ended()
            self._update_load()
        self._record_step(output)
        with self._lock:
            self._lock.notify_all()
        if self.on_step is not None:
            self.on_step(self)

    def _record_step(self, output: SchedulerOutput) -> None:
        forwards = self.timer.forwards
        seconds = self.timer.flush()
        for phase, value in seconds.items():
            self.metrics.step_phase_seconds.labels(phase).inc(value)
        if output.items:
            self.metrics.steps.labels(output.kind).inc()
            self.metrics.forward_passes.labels(output.kind).inc(forwards)
            if output.kind == "tg":
                self.metrics.decode_step_seconds.inc(sum(seconds.values()))

    def _apply_cancellations(self) -> None:
        for request_id in self._cancelled:
            request = self._requests.get(request_id)
            if request is not None:
                self._take_ended(self.scheduler.finish(request.context, StopReason.CANCELLED))
        self._cancelled.clear()

    def _take_ended(self, finished: list[Finished]) -> None:
        """Takes the requests the scheduler let go; _deliver_ended sends their last events."""
        for done in finished:
            request = self._requests.get(done.request.request_id)
            if request is not None:
                request.finished = done
                self._ended[done.request.request_id] = request

    def _deliver_ended(self) -> bool:
        """Sends the last event of each ended request whose audio is all decoded and frees what
        it held; True if any."""
        delivered = False
        for request in list(self._ended.values()):
            context = request.context
            if request.finished.reason in (StopReason.END_OF_SPEECH, StopReason.MAX_TOKENS) and \
                    context.decoded_index < context.speech_code_count:
                continue  # audio still to decode
            self._finish(request)
            delivered = True
        return delivered

    def _run_model(self, output: SchedulerOutput) -> list[StepResult]:
        """Launches ``output``'s forward passes (a multi-step decode's back to back: each takes what
        the one before sampled from the device) and applies the results that are due through the
        scheduler's update, the one writer of requests: these passes' own, or with overlap the
        previous round's, while these run. Takes what the updates let go; returns the results applied."""
        # Everything launched stays in _pending until applied, so that a failure anywhere leaves
        # nothing running unseen (_drop_pending waits for it).
        due = len(self._pending)
        if output.items:
            self.metrics.batch_size.labels(output.kind).observe(output.batch_size)
            if output.kind != "tg":  # a decode step's rows compute what they sampled: no input tokens
                for item in output.items:
                    if not item.sample or item.start < len(item.request.prompt_ids):
                        self.metrics.input_tokens.inc(item.num_tokens)
            runner = self.runner
            steps = output.steps
            for index, items in enumerate(steps):
                self._pending.append((output, runner.launch(items), index == len(steps) - 1))
        if not self.overlap:
            due = len(self._pending)
        applied = []
        for _ in range(due):
            step, pending, last = self._pending[0]
            result = pending.result()
            with self.timer.phase("update"), self._lock:
                self._take_ended(self.scheduler.update(step, result, last=last))
            self._pending.pop(0)
            applied.append(result)
        return applied

    def _drop_pending(self) -> list[SchedulerOutput]:
        """Waits for the launched passes (their results, or errors, go unused) and tells the
        scheduler they are over; returns their outputs."""
        pending, self._pending = self._pending, []
        outputs = []
        for step, launched, last in pending:
            try:
                launched.result()
            except Exception:  # noqa: BLE001 - a failed pass's result is the failure being handled
                pass
            if last:
                self._take_ended(self.scheduler.update(step))
                outputs.append(step)
        return outputs

    def _fail_all(self, error: str) -> None:
        """Fails every request the engine holds (after an error no one request can be blamed for)."""
        with self._lock:
            self._drop_pending()
            for request in list(self._requests.values()):
                self._take_ended(self.scheduler.finish(request.context, StopReason.FAILED, error, stopped=True))
            self._deliver_ended()
            self._update_load()

    def _give_up(self) -> None:
        """The loop keeps failing: stop taking work and say so (health goes NOT_SERVING)."""
        logger.error("engine loop failed %d times in a row; the engine stops (health: NOT_SERVING)",
                     MAX_LOOP_FAILURES)
        with self._lock:
            self.healthy = False
            self._accepting = False
        if self.on_unhealthy is not None:
            self.on_unhealthy()

    def _recover_from_failure(self, batch: list[TTSContext], exc: Exception) -> None:
        with self._lock:
            for failed in self._drop_pending():
                batch.extend(item.request for item in failed.items)
            for context in batch:
                if context.request_id in self._requests:
                    self._take_ended(self.scheduler.finish(context, StopReason.FAILED, f"generation failed ({LOGGED})",
                                                           stopped=True))
            self._deliver_ended()
            self._update_load()

    @property
    def _decoder_busy(self) -> bool:
        """The decoder thread is decoding a batch: windows ready meanwhile wait for it, and go
        together in the next one (so that streams whose chunks fall due on different passes still
        share decoder calls, and calls never queue up behind each other)."""
        return bool(self._decoding)

    def _decode_ready(self) -> bool:
        if self._decoder_busy:
            return False
        with self._lock:
            return any(self._next_window(r) is not None for r in self._requests.values())

    def _next_window(self, request: _Request) -> DecodeWindow | None:
        context = request.context
        if request.decoding or context.stop_reason in (StopReason.CANCELLED, StopReason.FAILED):
            return None
        return request.stream.next_window(context.speech_code_count, finished=context.is_done)

    def _decode(self, jobs: list[tuple[_Request, DecodeWindow]]) -> None:
        """Decodes the jobs' windows in one batch: here, or started on the decoder thread (their audio
        is delivered by _collect_decoded once it is done)."""
        if not jobs:
            return
        work = [(r.stream, w, r.context.speech_codes(w.start, w.end)) for r, w in jobs]
        if self._decoder is None:
            waves, seconds = self._decode_work(work)
            self.timer.add("decode", seconds)
            self._deliver_audio(jobs, waves)
            return
        for request, _ in jobs:
            request.decoding = True
        self._decoding.append((jobs, self._decoder.submit(self._decode_work, work)))

    def _decode_work(self, work: list) -> tuple[list, float]:
        """(Each window's audio as a CPU tensor, or the exception that failed it; the seconds taken)."""
        started = time.perf_counter()
        try:
            with self._on_decode_stream():
                waves: list = decode_windows(self.decoder, work)
        except Exception as exc:  # noqa: BLE001 - one request's bad codes must not fail its batch mates
            # Decode each alone: only the windows that fail on their own fail.
            waves = [self._decode_work([job])[0][0] for job in work] if len(work) > 1 else [exc]
        return waves, time.perf_counter() - started

    def _collect_decoded(self, wait: bool = False) -> bool:
        """Delivers the audio of the decoder thread's finished batches, in the order they started;
        with ``wait``, waits for the oldest first. True if any."""
        collected = False
        while self._decoding and (wait or self._decoding[0][1].done()):
            jobs, future = self._decoding.popleft()
            waves, seconds = future.result()
            self.timer.add("decode", seconds)
            self._deliver_audio(jobs, waves)
            collected, wait = True, False
        return collected

    def _deliver_audio(self, jobs: list[tuple[_Request, DecodeWindow]], waves: list) -> None:
        started = time.perf_counter()
        for (request, window), wave in zip(jobs, waves):
            request.decoding = False
            context = request.context
            if self._requests.get(context.request_id) is not request or request.stream.closed:
                continue  # it ended while its audio was decoded (cancelled, failed): nothing to send
            if isinstance(wave, Exception):
                logger.warning("request %s: audio decoding failed: %s", context.request_id, wave, exc_info=wave)
                with self._lock:  # let go once no step of it is in flight
                    self._take_ended(self.scheduler.finish(context, StopReason.FAILED,
                                                           f"audio decoding failed ({LOGGED})"))
                continue
            samples = wave.numpy()
            lead = context.layout.lead_in_frames * self.decoder.tokens_per_frame
            if lead and window.start + window.context_tokens < lead:  # the lead-in is decoded, never heard
                skip = min(window.end, lead) - window.start - window.context_tokens
                samples = samples[skip // self.decoder.tokens_per_frame * self.decoder.samples_per_frame:]
            context.decoded_index = window.end
            if context.first_audio_time is None:
                context.first_audio_time = time.monotonic()
                self.metrics.time_to_first_audio.observe(context.first_audio_time - context.arrival_time)
            read = self._words_read(request, samples.shape[0], window.final) if context.text_rule else None
            request.audio_samples += samples.shape[0]
            with self._lock:
                self.listeners.delivered(context.request_id, time.monotonic(), samples.shape[0] / self.decoder.sample_rate)
            self.metrics.audio_seconds.inc(samples.shape[0] / self.decoder.sample_rate)
            self._deliver(request, AudioEvent("audio", context.request_id, samples=samples,
                                              chunk_index=window.chunk_index, final=window.final, read=read))
        self.timer.add("deliver", time.perf_counter() - started)

    def _words_read(self, request: _Request, samples: int, final: bool) -> list[tuple[int, int]]:
        """The words a text stream's model read that start in the audio delivered up to now plus
        ``samples`` (all of them with the final audio): a word read at frame s sounds from frame
        s less the lead-in (the audio trails the text by the audio delay, which the heard audio's
        start already skips)."""
        context = request.context
        read = context.text_rule.state.transcript
        per_frame = self.decoder.samples_per_frame
        heard = request.audio_samples + samples
        out = []
        while request.read_sent < len(read):
            start = max(0, (read[request.read_sent][1] - context.layout.lead_in_frames) * per_frame)
            if start >= heard and not final:
                break
            out.append((request.read_sent, start))
            request.read_sent += 1
        return out

    def _on_model_device(self) -> None:
        """A thread's CUDA calls (events, streams) go to the model's GPU: once per thread, at its start."""
        if self.decode_stream is not None:
            torch.cuda.set_device(self.decode_stream.device)

    def _on_decode_stream(self):
        return torch.cuda.stream(self.decode_stream) if self.decode_stream is not None else nullcontext()

    def _update_load(self) -> None:
        metrics, scheduler = self.metrics, self.scheduler
        # Client requests, not contexts: a long text's next piece is prepared and queued while its
        # current one runs (and may still wait a moment after that one ends): the request counts
        # once, as running. Counted again only when the scheduler's sets changed (twice a round
        # they walked every running row).
        if scheduler.membership != self._load_membership:
            self._load_membership = scheduler.membership
            running = {request.stream_id for request in scheduler.running}
            running |= {request.stream_id for request in scheduler.waiting if request.continuation}
            queued = {request.stream_id for request in scheduler.waiting} - running
            metrics.requests_queued.set(len(queued))
            metrics.requests_running.set(len(running))
        manager = scheduler.block_manager
        metrics.kv_blocks_used.set(manager.num_used_blocks)
        metrics.kv_blocks_total.set(manager.total_num_blocks)  # it grows on demand on the CPU
        stats = manager.prefix_stats
        queried, hits = self._prefix_seen
        if stats.queried_tokens > queried:
            metrics.prefix_cache_queried_tokens.inc(stats.queried_tokens - queried)
        if stats.hit_tokens > hits:
            metrics.prefix_cache_hit_tokens.inc(stats.hit_tokens - hits)
        self._prefix_seen = (stats.queried_tokens, stats.hit_tokens)
        metrics.prefix_cache_hit_rate.set(stats.hit_rate)

    def _finish(self, request: _Request) -> None:
        """Frees what the engine holds of an ended request and sends its last event."""
        context, done = request.context, request.finished
        request.stream.close()
        self._requests.pop(context.request_id, None)
        self._text_streams.pop(context.request_id, None)
        self._ended.pop(context.request_id, None)
        with self._lock:
            self.listeners.ended(context.request_id, time.monotonic())
        if self._runner is not None:
            self._runner.release(context.request_id)  # its repetition counts and latest sample
        context.finish_time = time.monotonic()
        self.stop_reasons[done.reason] += 1
        self.metrics.requests.labels(done.reason.value).inc()
        # Counted once, from what the updates kept (a pass may sample for a request already finished).
        self.metrics.output_tokens.inc(len(context.generated))
        first_audio = context.first_audio_time or context.finish_time
        usage = Usage(prompt_tokens=len(context.prompt_ids), generated_tokens=len(context.generated),
                      audio_samples=request.audio_samples,
                      time_to_first_audio_seconds=first_audio - context.arrival_time,
                      generation_seconds=context.finish_time - context.arrival_time)
        kind = "error" if done.reason is StopReason.FAILED else "complete"
        self._deliver(request, AudioEvent(kind, context.request_id, usage=usage, stop_reason=done.reason,
                                          error=done.error))

    def _deliver(self, request: _Request, event: AudioEvent) -> None:
        try:
            request.sink(event)
        except Exception:  # noqa: BLE001 - a broken sink only affects its own request
            logger.exception("delivering %s event for %s failed", event.kind, event.request_id)
            with self._lock:
                self._cancelled.add(request.context.request_id)
