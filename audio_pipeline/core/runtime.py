"""Process settings that make small-batch CPU inference fast: intra-op threads and the allocator.

Measured on 2 cores with the built-in voice (python -m audio_pipeline.bench.serve): a step of this
engine is a few milliseconds of many small operations, so

- one intra-op thread beats two: with two, OpenMP's barriers and spinning cost more than the
  split saves, and the second core is left to the gRPC threads and audio decoding;
- glibc's default of mmap-ing every allocation over 128 KiB (and unmapping it when freed) makes
  each step's gathered keys and values fault in fresh pages; keeping large blocks in the heap
  made the same 16-stream run about 1.5x faster.
"""

from __future__ import annotations

import ctypes
import logging
import sys

import torch

logger = logging.getLogger(__name__)

#: glibc's mallopt parameters.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_allocator_tuned = False


def default_num_threads(device: torch.device) -> int:
    """Intra-op threads when the configuration leaves them open: 1 on CPU, torch's choice elsewhere
    (the GPU does the work there)."""
    return 1 if device.type == "cpu" else torch.get_num_threads()


def tune_allocator() -> bool:
    """Keeps large freed blocks in the heap (glibc only; elsewhere a no-op). Returns whether it applied."""
    global _allocator_tuned
    if _allocator_tuned:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    _allocator_tuned = bool(mallopt(_M_MMAP_THRESHOLD, 256 << 20)) and bool(mallopt(_M_TRIM_THRESHOLD, 512 << 20))
    return _allocator_tuned


def release_free_memory() -> bool:
    """Gives the heap's free memory back to the system now (glibc's malloc_trim; elsewhere a no-op).
    tune_allocator keeps freed blocks for the steps' reuse; once, after the warm-up, an idle server
    should not hold what start-up freed. Returns whether it applied."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return False
    trim.argtypes = [ctypes.c_size_t]
    return bool(trim(0))


def configure_cpu_runtime(num_threads: int) -> None:
    """Sets torch's intra-op threads and tunes the allocator; call from the thread that runs the model."""
    torch.set_num_threads(num_threads)
    if not tune_allocator():
        logger.debug("allocator tuning not available on this platform")
