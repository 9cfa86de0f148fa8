"""Runs the server on its own thread and event loop: for tests, benchmarks and embedding."""

from __future__ import annotations

import asyncio
import threading

from audio_pipeline.config import AudioGenerationConfig
from audio_pipeline.service.engine import TTSEngine
from audio_pipeline.server.app import ServerOptions, serve
from audio_pipeline.service.auth import AuthTokens
from audio_pipeline.server.tls import TLSFiles


class BackgroundServer:
    """``with BackgroundServer(config) as server: TTSClient(server.target) ...``"""

    def __init__(self, config: AudioGenerationConfig, *, host: str = "127.0.0.1", port: int = 0,
                 engine: TTSEngine | None = None, metrics_port: int | None = None, metrics_host: str | None = None,
                 tls: TLSFiles | None = None, auth: AuthTokens | None = None, http_port: int | None = None):
        self.config = config
        self.engine = engine
        self.port: int | None = None
        #: The HTTP front door's port (with ``http_port`` given; 0 picks a free one).
        self.http_port: int | None = None
        self._options = ServerOptions(host=host, port=port, metrics_port=metrics_port, metrics_host=metrics_host,
                                      tls=tls, auth=auth, http_port=http_port,
                                      on_http_listening=self._http_listening,
                                      on_listening=self._listening, install_signal_handlers=False)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        self._listening_event = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tts-server", daemon=True)

    def _http_listening(self, port: int) -> None:
        self.http_port = port

    @property
    def http_url(self) -> str:
        return f"http://{self._options.host}:{self.http_port}"

    def _listening(self, port: int) -> None:
        self.port = port
        self._listening_event.set()

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self._main())
        except BaseException as exc:  # noqa: BLE001 - reported to the starting thread
            self._error = exc
            self._options.ready.set()
            self._listening_event.set()
        finally:
            self._loop.close()

    async def _main(self) -> None:
        self._options.stop_event = asyncio.Event()
        if self.engine is None:
            config = self.config
            self.engine = await asyncio.get_running_loop().run_in_executor(
                None, lambda: TTSEngine(config, engine_process=config.engine_process.value))
        await serve(self.config, self._options, self.engine)

    @property
    def target(self) -> str:
        return f"{self._options.host}:{self.port}"

    def start(self, timeout: float = 300.0, *, wait_ready: bool = True) -> "BackgroundServer":
        """Starts the server; waits until it serves (or, with wait_ready=False, until it listens)."""
        self._thread.start()
        event = self._options.ready if wait_ready else self._listening_event
        if not event.wait(timeout):
            raise TimeoutError(f"server not {'ready' if wait_ready else 'listening'} after {timeout} s")
        self._raise_if_failed()
        return self

    def wait_ready(self, timeout: float = 300.0) -> None:
        if not self._options.ready.wait(timeout):
            raise TimeoutError(f"server not ready after {timeout} s")
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"server failed to start: {self._error}") from self._error

    def stop(self) -> None:
        if self._loop is not None and self._thread.is_alive() and self._options.stop_event is not None:
            try:
                self._loop.call_soon_threadsafe(self._options.stop_event.set)
            except RuntimeError:  # the server thread closed its loop meanwhile (a failed start): nothing to stop
                pass
        self._thread.join()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
