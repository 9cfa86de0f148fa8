"""Prompt positions' matrix products in bfloat16 on CPUs that multiply bfloat16 natively
(model.prompt_dtype).

Prompts arriving together make the largest steps on a CPU: 64 streams' prompts are about 4,000
positions, and their linear layers are most of the time to first audio. A CPU with AVX512-BF16 or
AMX multiplies bfloat16 matrices at several times its float32 rate (2 Zen 4 cores, a [4000, 192] x
[192, 576] product: 5.1 ms in float32, 1.0 ms in bfloat16), while the small products of decode steps
(one row per stream) run no faster, or slower, in bfloat16. So the rows of a step that are prompt
positions multiply by a bfloat16 copy of the weights and every other row by the model's own: the
choice goes by position, never by how a step was batched, so it adds no dependence of a request's
audio on what it shared its steps with (bfloat16 products here give each row the same bits
whatever the rows beside it; ``tests/test_prompt_precision.py`` checks it on the machine it runs
on). The float32 products beside them still round by row count (models/cpu_linear.py), which is
why this is not the default yet. An explicit model.dtype (``--dtype float32``) turns auto off: the
model's dtype throughout, so greedy speech does not depend on which CPU runs it.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from audio_pipeline.models.cpu_linear import in_buckets, linear as own_linear

#: The model.prompt_dtype values besides auto, by name.
PROMPT_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@lru_cache(maxsize=1)
def native_bfloat16_cpu() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (x86 AVX512-BF16 or AMX-BF16; Linux's
    /proc/cpuinfo flags). False where that cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            for line in info:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        pass
    return False


def choose_prompt_dtype(setting: str, model_dtype: torch.dtype, device: torch.device, *, quantized: bool = False,
                        dtype_setting: str = "auto") -> tuple[torch.dtype | None, str]:
    """(The dtype of prompt positions' products, None where they run in the model's dtype; why,
    for the start-up log). ``dtype_setting`` is model.dtype as set: auto follows an explicit one
    (``--dtype float32`` means float32 throughout, the same greedy speech on any CPU), and only
    where model.dtype is auto too is it bfloat16 for a float32 model on a CPU with native
    bfloat16 products, else the model's dtype."""
    if setting != "auto":
        wanted, why = PROMPT_DTYPES[setting], f"model.prompt_dtype={setting}"
    elif dtype_setting != "auto":
        wanted, why = model_dtype, f"model.prompt_dtype=auto follows model.dtype={dtype_setting}, set explicitly"
    elif device.type != "cpu":
        wanted, why = model_dtype, f"model.prompt_dtype=auto: the model's dtype on {device.type}"
    elif quantized:
        wanted, why = model_dtype, "model.prompt_dtype=auto: the model's dtype for an int8-quantized model"
    elif not native_bfloat16_cpu():
        wanted, why = model_dtype, "model.prompt_dtype=auto: this CPU has no native bfloat16 products"
    else:
        wanted, why = torch.bfloat16, ("model.prompt_dtype=auto: model.dtype is auto and this CPU multiplies "
                                       "bfloat16 natively (AVX512-BF16 or AMX)")
    if wanted == model_dtype:
        return None, why
    if quantized:
        raise ValueError("model.prompt_dtype: an int8-quantized model has no float weights to copy; "
                         "use prompt_dtype=auto or the model's dtype")
    return wanted, why


def resolve_prompt_dtype(setting: str, model_dtype: torch.dtype, device: torch.device,
                         quantized: bool = False, dtype_setting: str = "auto") -> torch.dtype | None:
    """The dtype of prompt positions' products, or None when they run in the model's dtype
    (:func:`choose_prompt_dtype`)."""
    return choose_prompt_dtype(setting, model_dtype, device, quantized=quantized, dtype_setting=dtype_setting)[0]


def add_prompt_weights(layers: nn.Module, dtype: torch.dtype) -> int:
    """Gives every nn.Linear inside ``layers`` (the decoder layers) a ``prompt_weight`` (and
    ``prompt_bias``) copy in ``dtype``; returns how many. Costs that dtype's share of the layers'
    weights in memory (half of them again for bfloat16 beside float32)."""
    count = 0
    for module in layers.modules():
        if isinstance(module, nn.Linear):
            module.prompt_weight = module.weight.detach().to(dtype)
            module.prompt_bias = None if module.bias is None else module.bias.detach().to(dtype)
            count += 1
    return count


def project(linear: nn.Linear, x: torch.Tensor, prompt_rows: Sequence[tuple[int, int]] = ()) -> torch.Tensor:
    """``linear(x)`` (on its packed weights where it has them: models/cpu_linear.py), the row ranges
    ``prompt_rows`` of ``x`` multiplied by the linear's prompt weights (where it has them) and the
    result returned in ``x``'s dtype."""
    if not prompt_rows:  # every decode step, tens of products a pass: the plain product at once
        if type(linear) is nn.Linear and "packed_weight" not in linear.__dict__:
            return F.linear(x, linear.weight, linear.bias)
        return own_linear(linear, x)
    weight = getattr(linear, "prompt_weight", None)
    if weight is None:
        return own_linear(linear, x)
    rows = x.shape[0]

    def low(part: torch.Tensor) -> torch.Tensor:  # (bucketed: oneDNN keeps a kernel per row count)
        return in_buckets(lambda a: F.linear(a, weight, linear.prompt_bias), part.to(weight.dtype)).to(x.dtype)

    if len(prompt_rows) == 1 and prompt_rows[0] == (0, rows):
        return low(x)
    pieces, done = [], 0
    for start, end in prompt_rows:
        if start > done:
            pieces.append(own_linear(linear, x[done:start]))
        pieces.append(low(x[start:end]))
        done = end
    if done < rows:
        pieces.append(own_linear(linear, x[done:]))
    return torch.cat(pieces)


def prompt_ranges(starts: Sequence[int], lengths: Sequence[int], prompt_lengths: Sequence[int]) -> list[tuple[int, int]]:
    """The flat rows of a step that are prompt positions, as merged [start, end) ranges: item i's
    tokens are positions starts[i] .. starts[i] + lengths[i] of a request whose prompt has
    prompt_lengths[i] positions, laid out one item after the other."""
    ranges: list[tuple[int, int]] = []
    row = 0
    for start, length, prompt in zip(starts, lengths, prompt_lengths):
        count = min(max(prompt - start, 0), length)
        if count:
            if ranges and ranges[-1][1] == row:
                ranges[-1] = (ranges[-1][0], row + count)
            else:
                ranges.append((row, row + count))
        row += length
    return ranges
