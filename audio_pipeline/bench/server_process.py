"""`audio-pipeline serve` in a subprocess for the benchmarks: this tree's code, free ports, its log
kept when it fails, and its readiness."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerStartError(RuntimeError):
    """The server exited, or did not get ready within the start-up limit; the message names its log."""


#: The server runs the very code this benchmark imported (the tree holding this audio_pipeline, its
#: kernels and client), whatever the working directory: ``python -m`` would put the working directory
#: first, so a benchmark of another checkout (a git worktree on PYTHONPATH) run from this one would
#: time this checkout's server.
_TREE = Path(__file__).resolve().parents[2]
SERVE_THIS_TREE = (f"import sys; sys.path[:0] = {[str(_TREE), str(_TREE / 'kernels'), str(_TREE / 'clients')]!r}; "
                   "from audio_pipeline.cli import main; sys.argv[0] = 'audio-pipeline'; sys.exit(main())")


class Server:
    """`audio-pipeline serve` in a subprocess, on free ports, with /metrics (and HTTP with ``http``).
    Its stderr goes to ``log_path`` (else a temporary file). ``start_timeout``: seconds it may take to listen."""

    def __init__(self, model: str | None, task_args: list[str], log_level: str = "INFO", device: str | None = None,
                 log_path: str | None = None, start_timeout: float = 600.0, http: bool = False,
                 emulate: tuple[float, float] | None = None):
        self.metrics_port = free_port()
        self.start_timeout = start_timeout
        self.log = (open(log_path, "w") if log_path else
                    tempfile.NamedTemporaryFile(prefix="bench-serve-", suffix=".log", delete=False, mode="w"))
        # ``emulate``: (step ms, decoder ms) of an emulated device (testing/emulated_device.py).
        serve = SERVE_THIS_TREE if emulate is None else SERVE_THIS_TREE.replace(
            "from audio_pipeline.cli import main;",
            "from audio_pipeline.testing.emulated_device import install_in_every_engine; "
            f"install_in_every_engine({float(emulate[0])!r}, {float(emulate[1])!r}); from audio_pipeline.cli import main;")
        command = [sys.executable, "-c", serve, "serve", "--host", "127.0.0.1", "--port", "0",
                   "--metrics-port", str(self.metrics_port), "--log-level", log_level]
        if http:
            command += ["--http-port", "0"]
        if model:
            command += ["--model", model]
        if device:
            command += ["--device", device]
        for arg in task_args:
            command += ["--task-arg", arg]
        self.command = command
        self.started = time.monotonic()
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=self.log)
        try:
            self.port = self._read_port()
            #: The HTTP port (with ``http``), else None.
            self.http_port = self._read_port("HTTP ") if http else None
        except BaseException:
            self.stop()
            raise

    def _failed(self, what: str) -> ServerStartError:
        return ServerStartError(f"the server {what}; its log is kept at {self.log.name}; its end:\n"
                                + Path(self.log.name).read_text()[-4000:])

    def _read_port(self, door: str = "") -> int:
        """The port from the server's '[HTTP ]listening on HOST:PORT' line (on its stderr), within the
        start-up limit."""
        pattern = rf"{door}listening on [\d.]+:(\d+)" if door else r"(?<!HTTP )listening on [\d.]+:(\d+)"
        while self.process.poll() is None:
            match = re.search(pattern, Path(self.log.name).read_text())
            if match:
                return int(match.group(1))
            if time.monotonic() - self.started > self.start_timeout:
                raise self._failed(f"did not listen within {self.start_timeout:.0f} s (--start-timeout)")
            time.sleep(0.2)
        raise self._failed(f"exited (code {self.process.returncode}) before listening")

    def wait_ready(self) -> None:
        """Waits for the server's health check to report SERVING, within what is left of the start-up limit."""
        left = self.start_timeout - (time.monotonic() - self.started)
        try:
            asyncio.run(wait_ready(self.target, timeout=max(1.0, left)))
        except Exception as exc:
            raise self._failed(f"did not report SERVING within {self.start_timeout:.0f} s (--start-timeout): "
                               f"{type(exc).__name__}: {exc}") from None

    def kv_cache_dtype(self) -> str | None:
        """The KV cache dtype the server's start-up log names ("KV cache: ... MiB), float16, attention
        native"; logged at INFO), or None where its log has no such line."""
        match = re.search(r"KV cache: [^\n]*?\), (\w+), attention", Path(self.log.name).read_text())
        return match.group(1) if match else None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def metrics(self) -> dict[str, float]:
        """The server's /metrics as {'name{labels}': value}."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as response:
            text = response.read().decode()
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values

    def stop(self) -> None:
        self.log.close()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def finish(self, succeeded: bool, *, keep_log: bool = False, model_dir: str | None = None) -> None:
        """Stops the server after a benchmark: its log is removed after a run that succeeded (unless
        ``keep_log``: the user named it) and kept, and said where, after one that failed; a random
        model written for the run (``model_dir``) goes."""
        self.stop()
        if succeeded and not keep_log:
            os.unlink(self.log.name)
        elif not succeeded:
            print(f"the server's log is kept at {self.log.name}", file=sys.stderr)
        if model_dir is not None:
            shutil.rmtree(model_dir, ignore_errors=True)


async def wait_ready(target: str, timeout: float) -> None:
    from audio_pipeline_client import AsyncTTSClient

    async with AsyncTTSClient(target) as client:
        await client.wait_ready(timeout=timeout)
