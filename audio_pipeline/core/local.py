"""The engine core in the caller's own process: what a TTSEngine talks to with ``engine_process =
in_process`` (tests, a user's program, the CPU server by default). core/process/client.py is the
same surface over a process boundary."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from audio_pipeline.core.assembly import CoreAssembly, CoreFacts
from audio_pipeline.core.engine_core import Sink
from audio_pipeline.core.request import TTSContext
from audio_pipeline.errors import ResourceExhausted


def check_room(core, pending: int = 0) -> None:
    """Raises the error a request submitted to ``core`` (an EngineCore) now would get: Unavailable
    while it does not accept work, ResourceExhausted when its queue is full or the server is past
    its capacity (max_queue_wait_ms), with ``pending`` others being prepared for submission."""
    if not core.accepting:
        raise core.unavailable()
    refuse_when_full(core.has_room(pending), core.at_capacity())


def refuse_when_full(room: bool, waited: float | None) -> None:
    """ResourceExhausted when the queue has no ``room``, or when the oldest waiting request has
    ``waited`` past max_queue_wait_ms (None: it has not); the refusals of both sides of the process
    boundary."""
    if not room:
        raise ResourceExhausted("the request queue is full; retry later")
    if waited is not None:
        raise ResourceExhausted(f"the server is at capacity: the oldest waiting request has waited {waited:.1f} s "
                                f"for a place (max_queue_wait_ms); retry later")


class LocalCore:
    """An assembled engine core (core/assembly.py), run on threads of this process."""

    def __init__(self, assembly: CoreAssembly):
        self.assembly = assembly
        self.core = assembly.core
        self.facts: CoreFacts = assembly.facts
        self.metrics = assembly.metrics

    def submit(self, context: TTSContext, sink: Sink) -> None:
        self.core.submit(context, sink)

    def cancel(self, request_id: str) -> None:
        self.core.cancel(request_id)

    def extend(self, request_id: str, words: list, close: bool = False) -> None:
        self.core.extend(request_id, words, close)

    def check_room(self, pending: int = 0) -> None:
        check_room(self.core, pending)

    @property
    def healthy(self) -> bool:
        return self.core.healthy

    def on_health(self, unhealthy: Callable[[], None], healthy: Callable[[], None] | None = None) -> None:
        """``unhealthy()`` runs when the loop stops for good (an in-process core is not restarted)."""
        self.core.on_unhealthy = unhealthy

    def start(self) -> None:
        self.core.start()

    def stop(self, timeout: float | None = None) -> None:
        self.core.stop(timeout)

    def encode(self, samples: np.ndarray) -> torch.Tensor:
        return self.assembly.encode(samples)

    def speaker_embedding(self, samples: np.ndarray) -> torch.Tensor | None:
        return self.assembly.speaker_embedding(samples)

    def check_codes(self, codes: torch.Tensor) -> None:
        self.assembly.check_codes(codes)

    def holdings(self) -> tuple[int, int, int, int]:
        return self.assembly.holdings()

    def settle(self) -> None:
        self.assembly.settle()
