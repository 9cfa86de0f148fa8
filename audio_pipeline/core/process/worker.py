"""The engine core's process: builds the core (core/assembly.py), then serves the front end.

Three kinds of threads, so that the engine's loop never touches a socket: the input thread (this
process's main thread) receives submissions, cancellations and calls and hands them to the core;
the output thread batches whatever the core's sinks produced since its last send (the audio of
many streams, each chunk a zero-copy frame) into one message; the call thread runs the calls
that need the model or the decoder (encoding a reference recording), beside the loop.

The process exits when the front end tells it to stop, and on its own when the front end is gone
(its parent process changes: checked every POLL_SECONDS).
"""

from __future__ import annotations

import importlib
import logging
import os
import queue
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import zmq

from audio_pipeline.core.engine_core import LOGGED, AudioEvent
from audio_pipeline.core.process import messages as m
from audio_pipeline.errors import RequestError

logger = logging.getLogger(__name__)

#: Seconds between two checks that the front end is alive (and between two heartbeats sent).
POLL_SECONDS = 0.2
#: The interpreter's thread switch interval in this process (Python's default is 5 ms). The core's
#: threads (the loop, the step's worker or the device's completion, the decoder, the output thread)
#: each hold the interpreter only briefly, but a thread that wakes (a step done, audio decoded) waits
#: up to the whole interval for the one running Python code. Emulated device (bench.serve, 9.6 ms
#: steps, 256 streams of 28-token chunks, overlap on, 2 cores): 5 ms: 72-76 passes a second and
#: 0-408 of 1024 streams holding real time; 1 ms: 79, 512; 0.5 ms: 86, 1024; 0.2 ms: 83, 1024;
#: 0.1 ms: 82, 1010.
SWITCH_INTERVAL_S = 0.0005
#: The calls a front end may make (CoreAssembly's methods of those names, and the metrics' text).
CALLS = ("encode", "speaker_embedding", "check_codes", "settle", "holdings", "metrics_text")


def main(config: Any, directory: str, parent_pid: int, hooks: list, log_level: int) -> None:
    """The process's entry point (its arguments come pickled on standard input: client.py's CoreChild)."""
    # The front end handles Ctrl-C and SIGTERM (a drain: the core must go on serving the streams it
    # drains) and stops this process itself; a service manager may signal the whole process group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Not the kernel's parent-death signal: it fires when the *thread* that started this process
    # ends (a restart's thread), not the front end; the input thread checks the parent instead.
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s [engine-core] %(name)s: %(message)s")
    context = zmq.Context()
    out = context.socket(zmq.PUSH)
    out.setsockopt(zmq.SNDHWM, 0)  # never drop or block on audio: the front end reads it at once
    out.connect(f"ipc://{directory}/from-core")
    inbox = context.socket(zmq.PULL)
    inbox.setsockopt(zmq.RCVHWM, 0)
    inbox.connect(f"ipc://{directory}/to-core")
    try:
        for module, function, args in hooks:  # (the emulated device of a benchmark)
            getattr(importlib.import_module(module), function)(*args)
        from audio_pipeline.core.assembly import CoreAssembly

        assembly = CoreAssembly(config)
    except BaseException as exc:  # noqa: BLE001 - the front end fails with this error
        if not isinstance(exc, (ValueError, OSError)):  # a setting's error: the front end says it, once
            logger.exception("the engine core could not start")
        out.send(m.encoder.encode(m.StartFailed(type(exc).__name__, str(exc))))
        out.close(linger=5000)
        inbox.close(linger=0)  # the context's term waits for every socket: an open one held it forever
        context.term()
        os._exit(1)
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    CoreServer(assembly, inbox, out, parent_pid).serve()
    out.close(linger=5000)
    inbox.close(linger=0)
    context.term()
    os._exit(0)  # the engine's threads are stopped; nothing else needs an orderly exit


class CoreServer:
    """Serves one front end: its submissions go to the core, the core's events back to it."""

    def __init__(self, assembly: Any, inbox: zmq.Socket, out: zmq.Socket, parent_pid: int):
        self.assembly = assembly
        self.core = assembly.core
        self.inbox, self.out = inbox, out
        self.parent_pid = parent_pid
        #: What the output thread sends: AudioEvents, replies, notices; None ends it.
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.calls = ThreadPoolExecutor(1, thread_name_prefix="core-calls")
        self.core.on_unhealthy = lambda: self.outbox.put(m.Unhealthy())
        #: Set once the ready message is sent: the output thread sends nothing before it (one
        #: thread at a time on the socket).
        self.ready = threading.Event()

    def serve(self) -> None:
        sender = threading.Thread(target=self._send_loop, name="core-output", daemon=True)
        sender.start()
        self.core.start()
        self.out.send(m.encoder.encode(m.Ready(self.assembly.facts)))  # before the sender's first message
        self.ready.set()
        try:
            self._receive_loop()
        finally:
            self.calls.shutdown(wait=True)
            self.outbox.put(None)
            sender.join()

    # --- input --------------------------------------------------------------------------------

    def _receive_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        while True:
            if not poller.poll(POLL_SECONDS * 1000):
                if os.getppid() != self.parent_pid:  # the front end is gone
                    logger.error("the front end has exited; the engine core exits")
                    os._exit(1)
                continue
            message = m.to_core_decoder.decode(self.inbox.recv(copy=False).buffer)
            if isinstance(message, m.Submit):
                self._submit(message)
            elif isinstance(message, m.Cancel):
                self.core.cancel(message.request_id)
            elif isinstance(message, m.Extend):
                self.core.extend(message.request_id, m.unpack(message.words), message.close)
            elif isinstance(message, m.Call):
                self.calls.submit(self._call, message)
            elif isinstance(message, m.Stop):
                self.core.stop(message.timeout)
                return

    def _submit(self, message: m.Submit) -> None:
        from audio_pipeline.core.request import TTSContext

        try:
            context = TTSContext(layout=self.assembly.layout, **m.unpack(message.context))
            self.core.submit(context, self.outbox.put)
        except RequestError as error:  # refused here (a race past the front end's own checks)
            self.outbox.put(AudioEvent("error", message.request_id, error=str(error),
                                       error_kind=type(error).__name__))
        except Exception:  # noqa: BLE001 - one bad submission must not end the process
            logger.exception("request %s could not be submitted", message.request_id)
            self.outbox.put(AudioEvent("error", message.request_id, error=f"generation failed ({LOGGED})"))

    def _call(self, message: m.Call) -> None:
        try:
            if message.method not in CALLS:
                raise ValueError(f"no call {message.method!r}")
            if message.method == "metrics_text":
                import prometheus_client

                result = prometheus_client.generate_latest(self.assembly.metrics.registry)
            else:
                result = getattr(self.assembly, message.method)(*m.unpack(message.args))
            reply = m.Reply(message.call_id, m.pack(result))
        except Exception as error:  # noqa: BLE001 - the caller gets it
            reply = m.Reply(message.call_id, error_kind=type(error).__name__, error=str(error))
        self.outbox.put(reply)

    # --- output -------------------------------------------------------------------------------

    def _send_loop(self) -> None:
        self.ready.wait()
        while True:
            try:
                first = self.outbox.get(timeout=POLL_SECONDS)
            except queue.Empty:
                self._send_events([])  # a heartbeat: the queue's state, and that the core lives
                continue
            batch = [first]
            while True:  # everything the core produced meanwhile goes in one message
                try:
                    batch.append(self.outbox.get_nowait())
                except queue.Empty:
                    break
            events = [item for item in batch if isinstance(item, AudioEvent)]
            if events:
                self._send_events(events)
            for item in batch:
                if item is None:
                    return
                if not isinstance(item, AudioEvent):
                    self.out.send(m.encoder.encode(item))

    def _send_events(self, events: list[AudioEvent]) -> None:
        heads, frames = m.event_frames(events)
        waited = self.core.queue_wait()
        header = m.encoder.encode(m.Events(heads, time.monotonic() - waited if waited > 0 else None))
        self.out.send_multipart([header, *frames], copy=False)


if __name__ == "__main__":
    import pickle

    main(*pickle.loads(sys.stdin.buffer.read()))
