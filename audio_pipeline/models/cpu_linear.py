"""Decode steps' matrix products on packed, row-stable weights (CPU, float32; model.packed_linears).

torch's ``F.linear`` on a CPU goes to a BLAS that rounds a row differently when it comes alone, in
twos or threes, and in fours or more (three kernels), so a request's speech could depend on how
many others shared its steps. Every product of a decode step (the decoder layers', with q/k/v and
gate/up fused into one product each; the candidate logits' range of the output projection; a frame
model's depth head) runs here instead on a copy of its weight packed once, by a kernel that gives
a row the same bits at any number of rows:

- the native kernel (``audio_pipeline_kernels.native_decode``, built on first use): one chain of
  fused multiply-adds per output element, row-stable by construction and without a fixed cost per
  call: on 2 Zen 4 cores a lone row's [1, 192] x [192, 576] product took 3 us (the BLAS 7, oneDNN
  16), 64 rows' 65 us (the BLAS 149, oneDNN 75);
- where it cannot be built (no C++ compiler), oneDNN's linear over a weight packed for it: a row
  gets the same bits at any number of rows from 2 up (``tests/test_cpu_linear.py`` checks it on
  the machine it runs on); a lone row takes another kernel for some shapes (the tiny test model's,
  3072 inputs), so packing probes each weight once and pads a lone row to two only where its bits
  differ; it costs ~10 us a call whatever the size.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from audio_pipeline_kernels.native_decode import NativeWeight, native_decode

#: Largest total of float32 linear weights auto packs: the packed copy doubles them in memory.
AUTO_MAX_BYTES = 1 << 30

#: Most rows one oneDNN product takes; more go in chunks of this many (see in_buckets).
CHUNK_ROWS = 1024


def bucket_rows(rows: int) -> int:
    """The row count a product of ``rows`` rows runs at: the next power of two, at least 2 (oneDNN
    takes another kernel for a lone row of some shapes: the tiny test model's, or 3072 inputs)."""
    return max(2, 1 << (rows - 1).bit_length())


def in_buckets(product, x: torch.Tensor) -> torch.Tensor:
    """``product(x)`` run at bucket_rows() rows (``x`` padded with zero rows), in chunks of
    CHUNK_ROWS. oneDNN compiles and keeps a kernel for every shape it meets (about 0.6 MiB each,
    whatever the weight's size, up to 1,024 of them): products at every row count a server sees
    grew it by ~75 MiB over a 64-stream benchmark and by 0.6 MiB per new count after. Buckets bound
    that to 10 shapes per weight; a row's result is the same at any row count (module docstring),
    so the padding changes none of the real rows. (Chunks of 256 rows cost the prompts' bfloat16
    products their gain: 64 prompts, 4,145 positions, prefilled in 158 ms against 109 with 1,024.)"""
    rows = x.shape[0]
    if rows > CHUNK_ROWS:
        return torch.cat([in_buckets(product, x[start:start + CHUNK_ROWS]) for start in range(0, rows, CHUNK_ROWS)])
    size = bucket_rows(rows)
    if size == rows:
        return product(x)
    return product(torch.cat([x, x.new_zeros(size - rows, x.shape[1])]))[:rows]


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
    a packing kernel runs (the native one builds, or oneDNN answers) and their weights come to at
    most AUTO_MAX_BYTES; True insists (an error where it cannot run); False never. Not with
    model.compile: torch.compile packs its own weights and cannot lower these ops."""
    possible = device.type == "cpu" and dtype == torch.float32 and not quantized and not compiled
    if setting is None:
        return possible and packing_available() and linear_weight_bytes(layers) <= AUTO_MAX_BYTES
    if setting and not (possible and packing_available()):
        raise ValueError("model.packed_linears=true needs a float32, unquantized, uncompiled model on the CPU "
                         "and a C++ compiler (the native kernel) or a torch built with oneDNN (mkldnn)")
    return setting


def packing_available() -> bool:
    """Whether a row-stable packed product runs here: the native kernel (built now if it was not),
    else oneDNN's."""
    return native_decode() is not None or onednn_linear_available()


def pack_weight(weight: torch.Tensor, bias: torch.Tensor | None = None, *, probe: bool = True) -> "PackedWeight":
    """``weight`` ([out, in], float32) packed for the native kernel, or where it cannot be built for
    oneDNN, with whether a lone row may run unpadded there (``probe``: find out, which reads
    products back; else a lone row is always padded)."""
    kernel = native_decode()
    if kernel is not None:
        return NativeWeight(kernel, weight, bias)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)
    return OneDNNWeight(packed, None if bias is None else bias.detach(),
                        probe and lone_row_exact(packed, weight.shape[1]))


class OneDNNWeight:
    """A weight in oneDNN's layout (and its bias); ``lone_exact``: a lone row's product equals its
    row of a larger product here (probed at packing), so it needs no padding row."""

    __slots__ = ("weight", "bias", "lone_exact")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, lone_exact: bool):
        self.weight, self.bias, self.lone_exact = weight, bias, lone_exact

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T + bias`` at bucketed row counts (in_buckets), a lone row unpadded where exact."""
        if x.shape[0] == 1 and self.lone_exact:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return in_buckets(lambda rows: torch.ops.mkldnn._linear_pointwise(rows, self.weight, self.bias, "none", [],
                                                                           ""), x)


#: A weight packed by pack_weight: ``self(x)`` is ``x @ weight.T + bias``; ``lone_exact``: a lone
#: row runs unpadded.
PackedWeight = NativeWeight | OneDNNWeight


def lone_row_exact(packed: torch.Tensor, in_features: int) -> bool:
    """Whether oneDNN multiplies a lone row by ``packed`` to the same bits as that row inside a product
    of several (for some shapes it takes another kernel: the tiny test model's, 3072 inputs). Random
    rows give different bits under different kernels almost surely, so agreeing rows say the
    kernel is the same; a lone row is padded to two where they do not. (Two rows: the products of
    the probe's row count stay in oneDNN's kernel cache, about 0.6 MiB each, and serving uses two.)"""
    rows = torch.randn(2, in_features, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        together = torch.ops.mkldnn._linear_pointwise(rows, packed, None, "none", [], "")
        return all(torch.equal(torch.ops.mkldnn._linear_pointwise(rows[i:i + 1], packed, None, "none", [], ""),
                               together[i:i + 1]) for i in range(rows.shape[0]))


def pack_linears(layers: nn.Module) -> int:
    """Gives every nn.Linear inside ``layers`` a ``packed_weight`` (pack_weight); returns how many."""
    count = 0
    for module in layers.modules():
        if isinstance(module, nn.Linear):
            module.packed_weight = pack_weight(module.weight, module.bias)
            count += 1
    return count


def linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``, on the packed weights where the module has them."""
    packed = getattr(module, "packed_weight", None)
    if packed is None:
        # A plain nn.Linear without the module call's hook machinery (a few us a product, tens of
        # products a pass); anything else (int8-quantized modules) as it is.
        return F.linear(x, module.weight, module.bias) if type(module) is nn.Linear else module(x)
    return packed(x)


__all__ = ["OneDNNWeight", "PackedWeight", "in_buckets", "linear", "pack_linears", "pack_weight",
           "packing_available", "use_packed_linears", "onednn_linear_available"]
