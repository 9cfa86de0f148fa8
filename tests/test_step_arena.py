"""The step arena (core/step_arena.py) hands each step the arrays it asked for, in the shapes and
types asked, with what the host wrote in them on the device side: whether the step is shaped like
the one before it in the same buffer (its views made once and handed back) or not."""

from __future__ import annotations

import numpy as np
import torch

from audio_pipeline.core.step_arena import StepArena


def layout(batch: int, *, swapped: bool = False) -> dict:
    arrays = {"tokens": ((batch,), np.int64), "floats": ((3, batch), np.float32),
              "blocked": ((batch, 5), np.bool_)}
    if swapped:
        arrays = dict(reversed(list(arrays.items())))
    return arrays


def stage_and_send(arena: StepArena, arrays: dict, fill: int) -> dict[str, torch.Tensor]:
    step = arena.stage(arrays)
    for name, (shape, dtype) in arrays.items():
        assert step.host[name].shape == shape and step.host[name].dtype == dtype
        step.host[name][...] = np.full(shape, fill).astype(dtype)
    return arena.send(step).device


def test_steps_of_the_same_shape_and_of_others_each_see_what_was_written_for_them():
    arena = StepArena(torch.device("cpu"), capacity=256)
    seen = []
    # the same shape over and over (each buffer's views handed back), then others, then a larger
    # one that grows the buffers, then the same order of names reversed (other offsets)
    plan = [layout(4)] * 5 + [layout(6), layout(4), layout(64), layout(64), layout(4, swapped=True), layout(4)]
    for index, arrays in enumerate(plan):
        device = stage_and_send(arena, arrays, fill=index + 1)
        assert list(device) == list(arrays)
        for name, (shape, dtype) in arrays.items():
            tensor = device[name]
            assert tuple(tensor.shape) == shape
            assert torch.equal(tensor, torch.from_numpy(np.full(shape, index + 1).astype(dtype))), (index, name)
        seen.append(device)
    # Two steps in a row never share memory: the one before may still be running on the device.
    for one, other in zip(seen, seen[1:]):
        assert one["tokens"].data_ptr() != other["tokens"].data_ptr()
    # A step's views made again for the same shape in the same buffer are the same memory.
    assert seen[0]["tokens"].data_ptr() == seen[2]["tokens"].data_ptr() == seen[4]["tokens"].data_ptr()
    # Handed a step's device dict, a caller may add to it without the next step seeing it.
    seen[-1]["extra"] = torch.zeros(1)
    stage_and_send(arena, layout(4), fill=0)
    assert "extra" not in stage_and_send(arena, layout(4), fill=0)  # seen[-1]'s buffer again
