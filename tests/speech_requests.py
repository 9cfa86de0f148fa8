"""Moved to helpers.py, which every test imports (``from helpers import ...``). Kept only for
tests/test_playground.py, whose owner moves its import of TRANSCRIPT and recording to helpers;
then this module goes."""

from helpers import TRANSCRIPT, recording  # noqa: F401
