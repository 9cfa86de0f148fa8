"""Decode steps' matrix products on oneDNN's packed weights (CPU, float32; model.packed_linears).

torch's ``F.linear`` on a CPU goes to a BLAS whose small-batch paths differ: on 2 Zen 4 cores a
[64, 192] x [192, 576] product took 142 us, while oneDNN's linear over a weight packed once for it
took 71 (at 16 to 128 rows it was 1.6-2.1x faster throughout); at one row the BLAS's
matrix-vector product is faster (6.7 against 15 us). The BLAS also rounds a row differently at 1,
at 2-3 and at 4 or more rows, so a request's speech could depend on how many others shared its
steps; oneDNN gives a row the same bits at any number of rows from 2 up (for the built-in voice's
shapes; ``tests/test_cpu_linear.py`` checks it on the machine it runs on). So steps of two rows or
more multiply by the packed copy, and a lone row keeps the BLAS's fast product.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

#: Fewest rows a product takes the packed weights for (a lone row is faster as a matrix-vector product).
PACKED_MIN_ROWS = 2

#: Largest total of float32 linear weights auto packs: the packed copy doubles them in memory.
AUTO_MAX_BYTES = 1 << 30


@lru_cache(maxsize=1)
def onednn_linear_available() -> bool:
    """Whether this torch has oneDNN's packed linear (built with mkldnn, and the ops answer)."""
    try:
        if not torch.backends.mkldnn.is_available():
            return False
        weight = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8), None)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8), weight, None, "none", [], "")
        return bool(torch.equal(out, torch.full((2, 8), 8.0)))
    except (AttributeError, RuntimeError):
        return False


def linear_weight_bytes(layers: nn.Module) -> int:
    """Bytes of the nn.Linear weights inside ``layers``."""
    return sum(m.weight.numel() * m.weight.element_size() for m in layers.modules() if isinstance(m, nn.Linear))


def use_packed_linears(setting: bool | None, layers: nn.Module, dtype: torch.dtype, device: torch.device,
                       quantized: bool = False, compiled: bool = False) -> bool:
    """model.packed_linears resolved: None (auto) packs a float32 model's layers on the CPU where
    oneDNN answers and their weights come to at most AUTO_MAX_BYTES; True insists (an error where
    it cannot run); False never. Not with model.compile: torch.compile packs its own weights and
    cannot lower these ops."""
    possible = device.type == "cpu" and dtype == torch.float32 and not quantized and not compiled
    if setting is None:
        return possible and onednn_linear_available() and linear_weight_bytes(layers) <= AUTO_MAX_BYTES
    if setting and not (possible and onednn_linear_available()):
        raise ValueError("model.packed_linears=true needs a float32, unquantized, uncompiled model on the CPU "
                         "and a torch built with oneDNN (mkldnn)")
    return setting


def pack_linears(layers: nn.Module) -> int:
    """Gives every nn.Linear inside ``layers`` a ``packed_weight`` (oneDNN's layout); returns how many."""
    count = 0
    for module in layers.modules():
        if isinstance(module, nn.Linear):
            module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), None)
            count += 1
    return count


def linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``, on the packed weights where the module has them and ``x`` has enough rows."""
    packed = getattr(module, "packed_weight", None)
    if packed is None or x.shape[0] < PACKED_MIN_ROWS:
        return module(x)
    return torch.ops.mkldnn._linear_pointwise(x, packed, module.bias, "none", [], "")


__all__ = ["PACKED_MIN_ROWS", "linear", "pack_linears", "use_packed_linears", "onednn_linear_available"]
