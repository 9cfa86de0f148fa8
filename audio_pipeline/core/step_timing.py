"""Where an engine step's time goes: seconds per phase, accumulated and flushed into the metrics.

Phases: ``schedule`` (the scheduler), ``inputs`` (step tensors), ``model`` (the forward pass),
``sample`` (candidate logits to ids), ``update`` (tokens into the requests), ``decode`` (audio),
``deliver`` (sinks). The serving benchmark reads them from /metrics.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

PHASES = ("schedule", "inputs", "model", "sample", "update", "decode", "deliver")


class StepTimer:
    """Seconds per phase since the last ``flush``; cheap enough for every step."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        #: Forward passes since the last flush (a multi-step decode step runs several).
        self.forwards = 0

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - started

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] += seconds

    def flush(self) -> dict[str, float]:
        """The seconds gathered since the last flush (and starts over)."""
        seconds, self.seconds = self.seconds, dict.fromkeys(PHASES, 0.0)
        self.forwards = 0
        return seconds
