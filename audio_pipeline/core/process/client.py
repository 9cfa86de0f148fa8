"""The front end's side of the engine core's process (``engine_process = subprocess``).

:class:`CoreProcess` starts the core's process (multiprocessing's spawn: a fresh interpreter, no
forked CUDA or thread state), waits for its ready message (the facts a front end needs: sample
rate, limits, capacity) and then offers what core/local.py's LocalCore offers: submit, cancel,
admission, calls into the model (encode a recording), health. One reader thread per core receives
its messages and hands each event to its request's sink.

Admission is counted here: the requests submitted and not yet ended against the core's queue and
admission limit (the core's own checks stay, for a race); the core reports its oldest waiting
request with every message and a heartbeat, for the at-capacity check.

Faults: when the core's process ends unasked (killed, crashed) or reports its loop failed for good,
every request in flight ends at once with an Unavailable error, health turns NOT_SERVING, and a new
core is started (up to RESTART_ATTEMPTS tries, each logged); once it is ready the server serves
again. A core that fails at start-up fails the caller with its error.
"""

from __future__ import annotations

import itertools
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, ClassVar

import zmq

from audio_pipeline.core.assembly import CoreFacts
from audio_pipeline.core.engine_core import AudioEvent, Sink
from audio_pipeline.core.local import refuse_when_full
from audio_pipeline.core.process import messages as m
from audio_pipeline.errors import AlreadyExists, Unavailable, error_of_kind

logger = logging.getLogger(__name__)

#: Tries at starting a new core after one ended unasked (each logged), before the server stays NOT_SERVING.
RESTART_ATTEMPTS = 3
#: What the requests in flight read when the core ends under them.
CORE_LOST = "the engine stopped unexpectedly and is being restarted; retry"
#: Seconds a call into the core (encode a recording, the metrics) may take.
CALL_TIMEOUT = 120.0


class StartupError(RuntimeError):
    """The engine core's process ended before it was ready."""


#: The core's errors that keep their class here (a setting's: the server fails with them as it
#: would in process); another is the request error it names, or the caller's ``otherwise``.
SETTING_ERRORS = {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError, "OSError": OSError}


def error_from_core(kind: str, message: str, otherwise: Callable[[str], Exception] | None = None) -> Exception:
    if kind in SETTING_ERRORS:
        return SETTING_ERRORS[kind](message)
    return otherwise(message) if otherwise is not None else error_of_kind(kind, message)


class CoreChild:
    """The engine core's process: a fresh interpreter running core/process/worker.py (not
    multiprocessing's spawn, which would import the caller's main module again), its arguments
    pickled on its standard input, the caller's import path its own."""

    def __init__(self, config: Any, directory: str, hooks: list, log_level: int):
        environment = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.popen = subprocess.Popen([sys.executable, "-m", "audio_pipeline.core.process.worker"],
                                      stdin=subprocess.PIPE, env=environment)
        self.pid = self.popen.pid
        self.popen.stdin.write(pickle.dumps((config, directory, os.getpid(), hooks, log_level), protocol=5))
        self.popen.stdin.close()
        # A descriptor that turns readable when the process ends (Linux 5.3+); else polled.
        try:
            self.sentinel: int | None = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            self.sentinel = None

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        self.popen.kill()

    def close(self) -> None:
        if self.sentinel is not None:
            os.close(self.sentinel)
            self.sentinel = None


def _poller(socket: zmq.Socket, process: CoreChild) -> zmq.Poller:
    poller = zmq.Poller()
    poller.register(socket, zmq.POLLIN)
    if process.sentinel is not None:
        poller.register(process.sentinel, zmq.POLLIN)
    return poller


#: Milliseconds between two checks that the core lives where its process has no descriptor to watch.
LIVENESS_POLL_MS = 100


class _Connection:
    """One core process and the two sockets to it."""

    def __init__(self, config: Any, hooks: list, log_level: int):
        self.directory = tempfile.mkdtemp(prefix="tts-core-")  # mode 0700: this user's alone
        self.context = zmq.Context()
        self.to_core = self.context.socket(zmq.PUSH)
        self.to_core.setsockopt(zmq.SNDHWM, 0)
        self.to_core.setsockopt(zmq.LINGER, 0)
        self.to_core.bind(f"ipc://{self.directory}/to-core")
        self.from_core = self.context.socket(zmq.PULL)
        self.from_core.setsockopt(zmq.RCVHWM, 0)
        self.from_core.setsockopt(zmq.LINGER, 0)
        self.from_core.bind(f"ipc://{self.directory}/from-core")
        self.process = CoreChild(config, self.directory, hooks, log_level)
        #: The thread that reads the core's messages, once it is ready.
        self.reader: threading.Thread | None = None
        #: Set when the front end ends this connection itself (a stop, a replaced core).
        self.closing = False
        self.closed = False

    def wait_ready(self) -> CoreFacts:
        """The core's facts once it is built; its start-up error (re-raised as the class it names
        where that is a ValueError or OSError, else StartupError) if it fails or exits first."""
        poller = _poller(self.from_core, self.process)
        while True:
            ready = dict(poller.poll(LIVENESS_POLL_MS))
            if self.from_core in ready:
                message = m.to_front_end_decoder.decode(self.from_core.recv())
                if isinstance(message, m.Ready):
                    return message.facts
                if isinstance(message, m.StartFailed):
                    self.process.join(10)
                    raise error_from_core(message.kind, message.error, StartupError)
            elif not self.process.is_alive():
                self.process.join()
                raise StartupError(f"the engine core's process exited with code {self.process.exitcode} while "
                                   "starting (its log is above)")

    def close(self, kill: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        if kill and self.process.is_alive():
            self.process.kill()
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.process.close()
        self.to_core.close(0)
        self.from_core.close(0)
        self.context.term()
        shutil.rmtree(self.directory, ignore_errors=True)


class CoreProcess:
    """The engine core in a process of its own; what core/local.py's LocalCore offers, over sockets."""

    #: (module, function, args) each new core's process calls before it builds the core (a
    #: benchmark's emulated device: testing/emulated_device.py).
    hooks: ClassVar[list[tuple[str, str, tuple]]] = []

    def __init__(self, config: Any):
        self.config = config
        self._lock = threading.Lock()
        self._sinks: dict[str, Sink] = {}
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count()
        self._accepting = False
        self._started = False
        self._stopping = False
        self._healthy = True
        #: Arrival time of the core's oldest waiting request that starts a stream (None: none waits).
        self._oldest_waiting: float | None = None
        self._on_unhealthy: Callable[[], None] | None = None
        self._on_healthy: Callable[[], None] | None = None
        #: New cores started after one ended unasked (the tests' and the log's count).
        self.restarts = 0
        self._connection = _Connection(config, list(self.hooks), logging.getLogger().getEffectiveLevel())
        self.facts: CoreFacts | None = None

    def wait_ready(self) -> CoreFacts:
        """Waits for the first core to be built (the caller loads its own half meanwhile)."""
        try:
            self.facts = self._connection.wait_ready()
        except BaseException:
            self._connection.close(kill=True)
            raise
        self._start_reader(self._connection)
        return self.facts

    @property
    def pid(self) -> int | None:
        """The core's process id."""
        return self._connection.process.pid

    # --- requests -----------------------------------------------------------------------------

    def submit(self, context: Any, sink: Sink) -> None:
        message = m.encoder.encode(m.Submit(context.request_id, m.pack_context(context)))
        with self._lock:
            if not self._accepting:
                raise self.unavailable()
            if context.request_id in self._sinks:
                raise AlreadyExists(f"{context.request_id!r} is already in flight", field="request_id")
            self._sinks[context.request_id] = sink
            # Under the lock: the threads that submit and cancel share the socket.
            self._connection.to_core.send(message)

    def cancel(self, request_id: str) -> None:
        with self._lock:
            if request_id in self._sinks and self._healthy:
                self._connection.to_core.send(m.encoder.encode(m.Cancel(request_id)))

    def extend(self, request_id: str, words: list, close: bool = False) -> None:
        message = m.encoder.encode(m.Extend(request_id, m.pack(words), close))
        with self._lock:
            if request_id in self._sinks and self._healthy:
                self._connection.to_core.send(message)

    def unavailable(self) -> Unavailable:
        if not self._healthy:
            return Unavailable("the engine stopped unexpectedly and is being restarted; retry shortly")
        return Unavailable("the server is not accepting requests (starting up or shutting down)")

    def check_room(self, pending: int = 0) -> None:
        """Raises what a submission now would get: Unavailable while not accepting, ResourceExhausted
        when the core's queue would be full (counted here: the requests in flight against its queue
        and admission limit) or it is past its capacity (max_queue_wait_ms)."""
        facts = self.facts
        with self._lock:
            if not self._accepting:
                raise self.unavailable()
            in_flight = len(self._sinks)
            oldest = self._oldest_waiting
        limit = self.config.max_queue_wait_ms
        waited = time.monotonic() - oldest if oldest is not None else 0.0
        refuse_when_full(in_flight + pending < facts.max_queue_size + facts.admission_limit,
                         waited if limit is not None and waited * 1000 > limit else None)

    # --- calls into the core --------------------------------------------------------------------

    def call(self, method: str, *args: Any, timeout: float = CALL_TIMEOUT) -> Any:
        """``method(*args)`` run in the core (its call thread, beside the loop); its result."""
        future: Future = Future()
        with self._lock:
            if not self._healthy:
                raise self.unavailable()
            call_id = next(self._call_ids)
            self._calls[call_id] = future
            self._connection.to_core.send(m.encoder.encode(m.Call(call_id, method, m.pack(args))))
        try:
            return future.result(timeout)
        finally:
            with self._lock:
                self._calls.pop(call_id, None)

    def encode(self, samples):
        return self.call("encode", samples)

    def speaker_embedding(self, samples):
        return self.call("speaker_embedding", samples)

    def check_codes(self, codes) -> None:
        self.call("check_codes", codes)

    def settle(self) -> None:
        self.call("settle")

    def holdings(self) -> tuple[int, int, int, int]:
        return self.call("holdings", timeout=10.0)

    def metrics_text(self) -> bytes:
        return self.call("metrics_text", timeout=5.0)

    # --- lifecycle ------------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        return self._healthy

    def on_health(self, unhealthy: Callable[[], None], healthy: Callable[[], None] | None = None) -> None:
        """``unhealthy()`` runs when the core ends unasked, ``healthy()`` once a new one is ready."""
        self._on_unhealthy, self._on_healthy = unhealthy, healthy

    def start(self) -> None:
        with self._lock:
            self._started = self._accepting = True

    def stop_accepting(self) -> None:
        with self._lock:
            self._accepting = False

    def stop(self, timeout: float | None = None) -> None:
        """Stops accepting; the core cancels what is left after ``timeout`` seconds and exits."""
        with self._lock:
            self._accepting = False
            self._stopping = True
            connection = self._connection
            connection.closing = True
            if connection.process.is_alive():
                connection.to_core.send(m.encoder.encode(m.Stop(1e9 if timeout is None else timeout)))
        connection.process.join(None if timeout is None else timeout + 30)
        if connection.reader is not None:
            connection.reader.join()
        connection.close(kill=True)
        self._fail_all("the server is shutting down", "Unavailable")

    def abort(self) -> None:
        """Ends a core that has not served (its front end failed while both were starting): killed
        at once. A stop would wait for it to finish loading first, up to 30 s, since its loop reads
        nothing before it is built."""
        with self._lock:
            self._accepting = False
            self._stopping = True
            connection = self._connection
            connection.closing = True
        connection.close(kill=True)
        if connection.reader is not None:
            connection.reader.join()

    # --- the reader -----------------------------------------------------------------------------

    def _start_reader(self, connection: _Connection) -> None:
        connection.reader = threading.Thread(target=self._read, args=(connection,), name="core-reader", daemon=True)
        connection.reader.start()

    def _read(self, connection: _Connection) -> None:
        poller = _poller(connection.from_core, connection.process)
        healthy = True
        while healthy:
            poller.poll(LIVENESS_POLL_MS)
            # What the core sent before it ended is handled first (its last events, a stop's cancellations).
            while connection.from_core.poll(0):
                healthy = self._handle(connection.from_core.recv_multipart(copy=False)) and healthy
            if not connection.process.is_alive():
                break
        if connection.closing:
            return
        connection.process.join(1)
        logger.error("the engine core %s; failing its %d requests in flight and starting a new one",
                     "reported that its loop failed for good" if not healthy
                     else f"process ended unasked (exit code {connection.process.exitcode})", len(self._sinks))
        self._core_lost(connection)

    def _handle(self, frames: list) -> bool:
        """Handles one message; False when the core reports its loop failed for good."""
        message = m.to_front_end_decoder.decode(frames[0].buffer)
        if isinstance(message, m.Events):
            self._oldest_waiting = message.oldest_waiting
            buffers = [frame.buffer for frame in frames[1:]]
            for head in message.events:
                event = m.audio_event(head, buffers)
                with self._lock:
                    sink = (self._sinks.pop(head.request_id, None) if head.kind != "audio"
                            else self._sinks.get(head.request_id))
                if sink is not None:
                    self._deliver(sink, event)
        elif isinstance(message, m.Reply):
            with self._lock:
                future = self._calls.pop(message.call_id, None)
            if future is not None:
                if message.error_kind is None:
                    future.set_result(m.unpack(message.result))
                else:
                    future.set_exception(error_from_core(message.error_kind, message.error or "failed"))
        elif isinstance(message, m.Unhealthy):
            return False
        return True

    @staticmethod
    def _deliver(sink: Sink, event: AudioEvent) -> None:
        try:
            sink(event)
        except Exception:  # noqa: BLE001 - a broken sink only affects its own request
            logger.exception("delivering %s event for %s failed", event.kind, event.request_id)

    def _fail_all(self, error: str, kind: str) -> None:
        with self._lock:
            sinks, self._sinks = self._sinks, {}
            calls, self._calls = self._calls, {}
        for request_id, sink in sinks.items():
            self._deliver(sink, AudioEvent("error", request_id, error=error, error_kind=kind))
        for future in calls.values():
            future.set_exception(Unavailable(error))

    def _core_lost(self, connection: _Connection) -> None:
        """The core ended unasked: end its requests (Unavailable), go NOT_SERVING, start a new one."""
        with self._lock:
            self._healthy = False
            self._accepting = False
        if self._on_unhealthy is not None:  # first: a client told UNAVAILABLE finds health NOT_SERVING
            self._on_unhealthy()
        self._fail_all(CORE_LOST, "Unavailable")
        connection.closing = True
        connection.close(kill=True)
        threading.Thread(target=self._restart, name="core-restart", daemon=True).start()

    def _restart(self) -> None:
        for attempt in range(1, RESTART_ATTEMPTS + 1):
            if self._stopping:
                return
            logger.warning("starting a new engine core (try %d of %d)", attempt, RESTART_ATTEMPTS)
            connection = _Connection(self.config, list(self.hooks), logging.getLogger().getEffectiveLevel())
            try:
                self.facts = connection.wait_ready()
            except Exception:  # noqa: BLE001 - logged; the next try follows
                logger.exception("the new engine core failed to start (try %d of %d)", attempt, RESTART_ATTEMPTS)
                connection.closing = True
                connection.close(kill=True)
                time.sleep(min(10.0, 0.5 * 2 ** attempt))
                continue
            with self._lock:
                if self._stopping:
                    connection.closing = True
                else:
                    self._connection = connection
                    self._healthy = True
                    self._accepting = self._started
                    self.restarts += 1
            if connection.closing:
                connection.close(kill=True)
                return
            self._start_reader(connection)
            logger.warning("a new engine core is serving (process %d)", connection.process.pid)
            if self._on_healthy is not None:
                self._on_healthy()
            return
        logger.error("the engine core could not be restarted after %d tries; the server stays NOT_SERVING",
                     RESTART_ATTEMPTS)
