"""Why a request ended: its own module, free of torch, so that the scheduler (which ends requests),
the request state and the front doors (which name the reason to clients) all import it from here."""

from __future__ import annotations

import enum


class StopReason(str, enum.Enum):
    """Why a request ended (set by the scheduler, which ends requests; named by the doors)."""

    END_OF_SPEECH = "end_of_speech"
    MAX_TOKENS = "max_tokens"
    CANCELLED = "cancelled"
    FAILED = "failed"
