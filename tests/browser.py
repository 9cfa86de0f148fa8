"""A headless Chromium driven over the DevTools protocol (a WebSocket; no driver to install), for
the playground's browser tests. Debian's ``chromium`` package is the browser: scripts/test.sh
installs it where it is missing and the machine allows (apt as root)."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from websockets.sync.client import connect

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "chrome")


def chromium_path() -> str | None:
    return next((path for name in CANDIDATES if (path := shutil.which(name))), None)


class Browser:
    """One headless Chromium with one page; ``evaluate`` runs JavaScript in it; ``console_errors``
    holds every error the page logged (console.error, uncaught exceptions, failed loads, CSP)."""

    def __init__(self, executable: str):
        self.profile = tempfile.mkdtemp(prefix="chromium-")
        self.process = subprocess.Popen(
            [executable, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--no-default-browser-check", "--remote-debugging-port=0", f"--user-data-dir={self.profile}",
             "--autoplay-policy=no-user-gesture-required", "--window-size=1100,1000", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.is_file() and port_file.read_text().strip()):
            if time.monotonic() > deadline or self.process.poll() is not None:
                self.close()
                raise RuntimeError("chromium did not start its DevTools endpoint")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as reply:
            page = next(t for t in json.load(reply) if t["type"] == "page")
        self.socket = connect(page["webSocketDebuggerUrl"], max_size=64 * 2 ** 20).__enter__()
        self._next = 0
        self.events: list[dict] = []
        self.console_errors: list[str] = []
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable")

    def _record(self, message: dict) -> None:
        method, params = message.get("method"), message.get("params", {})
        self.events.append(message)
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            self.console_errors.append(" ".join(str(a.get("value", a.get("description", ""))) for a in params["args"]))
        elif method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            self.console_errors.append(details.get("exception", {}).get("description", details.get("text", "")))
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            self.console_errors.append(f"{params['entry']['text']} {params['entry'].get('url', '')}")

    def call(self, method: str, **params) -> dict:
        self._next += 1
        ident = self._next
        self.socket.send(json.dumps({"id": ident, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv(timeout=120))
            if message.get("id") == ident:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self._record(message)

    def pump(self, seconds: float) -> None:
        """Takes the page's events for ``seconds``."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                self._record(json.loads(self.socket.recv(timeout=left)))
            except TimeoutError:
                return

    def open(self, url: str) -> None:
        self.events.clear()
        self.call("Page.navigate", url=url)
        deadline = time.monotonic() + 60
        while not any(e.get("method") == "Page.loadEventFired" for e in self.events):
            assert time.monotonic() < deadline, "the page never loaded"
            self.pump(0.2)

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(result["exceptionDetails"].get("exception", {}).get("description", str(result)))
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 120):
        """Polls ``expression`` until it is truthy; returns its value."""
        deadline = time.monotonic() + timeout
        while not (value := self.evaluate(expression)):
            assert time.monotonic() < deadline, f"timed out waiting for {expression}"
            self.pump(0.1)
        return value

    def screenshot(self, path: Path) -> Path:
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))
        return path

    def set_files(self, selector: str, files: list[str]) -> None:
        root = self.call("DOM.getDocument")["root"]["nodeId"]
        node = self.call("DOM.querySelector", nodeId=root, selector=selector)["nodeId"]
        self.call("DOM.setFileInputFiles", nodeId=node, files=files)

    def close(self) -> None:
        try:
            if getattr(self, "socket", None) is not None:
                self.socket.close()
        finally:
            self.process.kill()
            self.process.wait(timeout=30)
            shutil.rmtree(self.profile, ignore_errors=True)
