"""One step's inputs, staged on the host and sent to the device in one copy.

Every array a step needs (token ids, positions, cache slots, sampling settings, ...) is written with
numpy into one page-locked host buffer; a single non-blocking copy moves the used part to the
device, where each array is a view at the same offset. The offsets depend only on the order and
shapes of the arrays, so a step of a given shape always finds its inputs at the same device
addresses (what a captured CUDA graph reads).

Two host buffers alternate: while the device may still be copying step n's, step n + 1 is written
into the other one; step n + 2 waits for step n's copy first (an event, long passed when steps are
read back in order). On the CPU there is nothing to copy: the views are the host arrays themselves.

A step shaped like the one before it in the same buffer (a steady decode step, pass after pass)
gets the views made for that one back: at a few dozen arrays, making each view anew was a tenth of
a decode step's staging on the host.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

#: Every array starts on a multiple of this many bytes (the widest element type is 8 bytes; 64
#: keeps device reads aligned).
ALIGN = 64


@dataclass
class _Slot:
    offset: int
    shape: tuple[int, ...]
    dtype: np.dtype


@dataclass
class StagedStep:
    """The arrays of one step: ``host[name]`` (numpy, writable until ``send``) and, after ``send``,
    ``device[name]`` (torch views on the device)."""

    host: dict[str, np.ndarray] = field(default_factory=dict)
    device: dict[str, torch.Tensor] = field(default_factory=dict)
    #: The step's row ranges that are prompt positions (model.prompt_dtype; the model runner's).
    prompt_rows: tuple[tuple[int, int], ...] = ()


class StepArena:
    """Pinned host staging and its device mirror, for one step at a time (see the module docstring)."""

    def __init__(self, device: torch.device, capacity: int = 1 << 20):
        self.device = device
        self._capacity = 0
        self._turn = 0
        self._grow(capacity)

    def _grow(self, capacity: int) -> None:
        self._capacity = capacity
        pin = self.device.type == "cuda"
        self._host = [torch.empty(capacity, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        self._host_arrays = [buffer.numpy() for buffer in self._host]  # taken once: filling reads nothing back
        self._sent = [None, None]
        #: Per buffer, the last layout staged there: (arrays, slots, used, host views, device views).
        self._views: list[tuple | None] = [None, None]
        self._device_buffer = (torch.empty(capacity, dtype=torch.uint8, device=self.device)
                               if self.device.type != "cpu" else None)

    def stage(self, arrays: dict[str, tuple[tuple[int, ...], np.dtype]]) -> StagedStep:
        """Room for ``arrays`` (name -> (shape, dtype)), in this order; returns the host views to fill."""
        turn = self._turn ^ 1
        kept = self._views[turn]
        if kept is not None and kept[0] == list(arrays.items()):  # (in order: the order sets the offsets)
            self._turn = turn
            self._wait_turn()
            step = StagedStep(host=dict(kept[3]))
            step._slots, step._used, step._kept = kept[1], kept[2], kept  # type: ignore[attr-defined]
            return step
        slots, offset = {}, 0
        for name, (shape, dtype) in arrays.items():
            dtype = _DTYPES[dtype]
            slots[name] = _Slot(offset, tuple(shape), dtype)
            size = math.prod(shape) * dtype.itemsize
            offset += -(-size // ALIGN) * ALIGN
        if offset > self._capacity:
            self._wait_all()
            self._grow(max(offset, 2 * self._capacity))
        self._turn ^= 1
        self._wait_turn()
        buffer = self._host_arrays[self._turn]
        step = StagedStep()
        for name, slot in slots.items():
            count = math.prod(slot.shape)
            step.host[name] = buffer[slot.offset:slot.offset + count * slot.dtype.itemsize].view(slot.dtype).reshape(
                slot.shape)
        kept = [list(arrays.items()), slots, offset, dict(step.host), None]
        self._views[self._turn] = kept
        step._slots, step._used, step._kept = slots, offset, kept  # type: ignore[attr-defined]
        return step

    def _wait_turn(self) -> None:
        if self._sent[self._turn] is not None:
            self._sent[self._turn].synchronize()  # the copy out of this buffer two steps ago
            self._sent[self._turn] = None

    def send(self, step: StagedStep) -> StagedStep:
        """One copy of the staged arrays to the device (non-blocking from pinned memory); fills
        ``step.device``."""
        slots, used, kept = step._slots, step._used, step._kept  # type: ignore[attr-defined]
        host = self._host[self._turn]
        if self._device_buffer is None:  # the CPU: the host arrays are the step's tensors
            if kept[4] is None:
                kept[4] = {name: torch.from_numpy(array) for name, array in step.host.items()}
            step.device = dict(kept[4])
            return step
        else:
            self._device_buffer[:used].copy_(host[:used], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._sent[self._turn] = event
            source = self._device_buffer
        if kept[4] is None:  # the device buffer is one for both turns: a layout's views are the same
            kept[4] = {}
            for name, slot in slots.items():
                count = math.prod(slot.shape)
                raw = source[slot.offset:slot.offset + count * slot.dtype.itemsize]
                kept[4][name] = raw.view(_TORCH_DTYPES[slot.dtype]).view(slot.shape)
        step.device = dict(kept[4])
        return step

    def _wait_all(self) -> None:
        for event in self._sent:
            if event is not None:
                event.synchronize()


_DTYPES = {kind: np.dtype(kind) for kind in (np.int64, np.int32, np.float32, np.bool_)}
_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
                 np.dtype(np.float32): torch.float32, np.dtype(np.bool_): torch.bool}
