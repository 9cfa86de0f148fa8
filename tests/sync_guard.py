"""A guard that fails on any operation that would make the host wait for a device value.

On CUDA such an operation (``.item()``, ``.tolist()``, ``bool(tensor)``, a data-dependent shape
such as ``nonzero`` or a boolean mask index, a copy to the CPU) blocks the host until the device has
caught up, which serialises the step. On the CPU the same operations cost nothing, so the guard
refuses them by kind, not by cost, and a code path that passes it on the CPU has no such point on
CUDA either.

The guard watches the tensors of the device the engine runs on (``no_host_sync(device)``): on the
CPU every tensor stands for a device one; on CUDA only CUDA tensors count, since reading a host
tensor waits for nothing (FlashInfer's planners read their host index arrays by design).
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

#: Operators that read a value on the host or whose output shape depends on the data.
SYNCING_OPERATORS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
                     aten.equal.default, aten.is_nonzero.default, aten.unique_consecutive.default,
                     aten._unique2.default, aten.unique_dim.default, aten.repeat_interleave.Tensor}
#: Tensor methods that hand device values to Python.
SYNCING_METHODS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.numpy, torch.Tensor.cpu,
                   torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}


class HostSync(AssertionError):
    """An operation that waits for the device ran inside the guard."""


def _on(device_type: str, values) -> bool:
    """Whether any tensor among ``values`` (nested in lists and tuples) is on the watched device type."""
    for value in values:
        if isinstance(value, torch.Tensor):
            if value.device.type == device_type:
                return True
        elif isinstance(value, (list, tuple)) and _on(device_type, value):
            return True
    return False


class _Operators(TorchDispatchMode):
    def __init__(self, device_type: str):
        super().__init__()
        self.device_type = device_type

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        watched = _on(self.device_type, args) or _on(self.device_type, kwargs.values())
        if (watched and func in SYNCING_OPERATORS
                and not (func is aten.repeat_interleave.Tensor and "output_size" in kwargs)):
            raise HostSync(f"{func} reads a device value on the host")
        if watched and func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(i is not None and i.dtype == torch.bool for i in indices):
                raise HostSync(f"{func} with a boolean mask has a data-dependent shape")
        return func(*args, **kwargs)


class _Methods(TorchFunctionMode):
    def __init__(self, device_type: str):
        super().__init__()
        self.device_type = device_type

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in SYNCING_METHODS and _on(self.device_type, args[:1]):
            raise HostSync(f"{getattr(func, '__name__', func)} hands a device value to the host")
        return func(*args, **(kwargs or {}))


class no_host_sync:
    """``with no_host_sync(device): ...`` raises HostSync at the first operation that would wait for
    ``device`` (a torch.device or its name; the CPU by default, where every tensor counts)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device_type = torch.device(device).type

    def __enter__(self):
        self._modes = [_Methods(self.device_type), _Operators(self.device_type)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        return False
