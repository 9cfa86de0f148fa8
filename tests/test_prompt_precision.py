"""model.prompt_dtype: prompt positions' products in bfloat16 on CPUs that multiply it natively,
chosen by position so a request's speech never depends on its batch."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from audio_pipeline.config import AudioGenerationConfig
from audio_pipeline.service.engine import TTSEngine
from audio_pipeline.models.prompt_precision import (add_prompt_weights, native_bfloat16_cpu, project, prompt_ranges,
                                                    resolve_prompt_dtype)
from helpers import GREEDY, TEXTS, make_config, run_texts, start_engine

CPU = torch.device("cpu")
native = pytest.mark.skipif(not native_bfloat16_cpu(), reason="this CPU has no native bfloat16 products "
                            "(model.prompt_dtype=auto keeps float32 here)")


def test_prompt_ranges_are_the_prompt_positions_of_each_item_merged():
    # Item 0: positions 0-9 of a 12-position prompt (all prompt); item 1: positions 10-14 of the same
    # request (2 prompt, 3 generated); item 2: a decode row; item 3: a whole new prompt of 4.
    assert prompt_ranges([0, 10, 30, 0], [10, 5, 1, 4], [12, 12, 20, 4]) == [(0, 12), (16, 20)]
    assert prompt_ranges([5, 6], [1, 1], [3, 3]) == []
    assert prompt_ranges([], [], []) == []


def test_project_multiplies_only_the_prompt_rows_by_the_bfloat16_copy():
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 80, bias=True)
    layers = torch.nn.ModuleList([linear])
    assert add_prompt_weights(layers, torch.bfloat16) == 1
    x = torch.randn(9, 48)
    with torch.inference_mode():
        mixed = project(linear, x, ((2, 5), (7, 9)))
        low = F.linear(x.bfloat16(), linear.weight.bfloat16(), linear.bias.bfloat16()).float()
        full = linear(x)
        assert mixed.dtype == torch.float32 and mixed.shape == (9, 80)
        for start, end in ((2, 5), (7, 9)):
            assert torch.equal(mixed[start:end], low[start:end])
        for start, end in ((0, 2), (5, 7)):  # (float32 products of 2 rows and of 9 may round differently)
            assert torch.equal(mixed[start:end], linear(x[start:end]))
        assert not torch.equal(low, full)  # the copy really is coarser
        assert torch.equal(project(linear, x), full)  # no prompt rows: the module as it is


@native
def test_a_rows_bfloat16_product_does_not_depend_on_the_rows_beside_it():
    # What makes the choice by position batch-independent: the same row gives the same bits in a
    # product of one row, a few or thousands, with the engine's threads or more.
    torch.manual_seed(1)
    x, weight = torch.randn(4200, 192).bfloat16(), torch.randn(576, 192).bfloat16()
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            whole = F.linear(x, weight)
            for start, rows in ((0, 1), (17, 3), (100, 64), (7, 300), (1000, 3000)):
                assert torch.equal(F.linear(x[start:start + rows], weight), whole[start:start + rows]), (threads, rows)
    finally:
        torch.set_num_threads(before)


def test_auto_is_bfloat16_only_for_a_float32_model_on_a_cpu_with_native_products():
    expected = torch.bfloat16 if native_bfloat16_cpu() else None
    assert resolve_prompt_dtype("auto", torch.float32, CPU) == expected
    assert resolve_prompt_dtype("auto", torch.bfloat16, CPU) is None
    assert resolve_prompt_dtype("auto", torch.float32, CPU, quantized=True) is None
    assert resolve_prompt_dtype("float32", torch.float32, CPU) is None
    assert resolve_prompt_dtype("bfloat16", torch.float32, CPU) == torch.bfloat16
    with pytest.raises(ValueError, match="model.prompt_dtype"):
        resolve_prompt_dtype("bfloat16", torch.float32, CPU, quantized=True)


def test_an_unknown_prompt_dtype_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"model.prompt_dtype: Input should be 'auto', 'float32' or 'bfloat16'"):
        AudioGenerationConfig.load(env={}, audio_flags=["model.prompt_dtype=float8"])


def test_an_int8_model_with_a_bfloat16_prompt_is_refused_at_load(tiny_model_dir):
    with pytest.raises(ValueError, match="model.prompt_dtype"):
        TTSEngine(make_config(tiny_model_dir, model={"quantization": "int8", "prompt_dtype": "bfloat16"}))


def test_bfloat16_prompt_logits_stay_close_to_float32(tiny_model_dir):
    engine = TTSEngine(make_config(tiny_model_dir, model={"prompt_dtype": "bfloat16"}))
    assert engine.model.prompt_dtype == torch.bfloat16
    context = engine.create_context("Compare the prompt's logits in both precisions.", temperature=0.0)
    prompt = context.prompt_ids
    kv = engine.kv_cache
    kv.claim(context.request_id)
    kv.block_manager.alloc(context.request_id, len(prompt))
    logits = {}
    with torch.inference_mode():
        for name, rows in (("float32", ()), ("bfloat16", ((0, len(prompt)),))):
            batch = dataclasses.replace(kv.batch([context.request_id], [0], [len(prompt)]), prompt_rows=rows)
            hidden = engine.model.forward(torch.tensor(prompt), torch.arange(len(prompt)), batch)
            logits[name] = engine.model.model.compute_logits(hidden[-1:])[0]
    kv.release(context.request_id)
    difference = (logits["bfloat16"] - logits["float32"]).abs().max().item()
    assert 0 < difference < 0.05, difference


@native
@pytest.mark.parametrize("flags", [
    pytest.param((), id="continuous-batching"),
    pytest.param(("max_batch_input_tokens=16",), id="chunked-prefill"),
    pytest.param(("enable_in_flight_batching=true", "max_batch_input_tokens=24"), id="in-flight-batching"),
])
def test_bfloat16_prompts_give_the_same_speech_whatever_the_batch(tiny_model_dir, flags):
    # In-flight batching puts prompt rows and decode rows in the same steps; chunked prefill splits a
    # prompt over steps of other sizes. Each request's greedy speech must equal its run alone.
    alone = start_engine(tiny_model_dir, "max_batch_size=1", model={"prompt_dtype": "bfloat16"})
    try:
        reference = [run_texts(alone, [text], **GREEDY)[0].generated for text in TEXTS]
    finally:
        alone.stop()
    engine = start_engine(tiny_model_dir, *flags, model={"prompt_dtype": "bfloat16"})
    try:
        assert [c.generated for c in run_texts(engine, TEXTS, **GREEDY)] == reference
    finally:
        engine.stop()


def test_the_rows_taken_as_prompt_are_exactly_the_prompt_positions_of_mixed_steps(tiny_model_dir):
    engine = start_engine(tiny_model_dir, "enable_in_flight_batching=true", "max_batch_input_tokens=24",
                   model={"prompt_dtype": "bfloat16"})
    runner, seen = engine.core.runner, []
    stage = runner._stage

    def recording(items):  # steps staged row by row: those with prompt positions
        staged = stage(items)
        seen.append(([(item.start, item.num_tokens, len(item.request.prompt_ids)) for item in items],
                     staged.prompt_rows))
        return staged

    runner._stage = recording
    try:
        run_texts(engine, TEXTS, **GREEDY)
    finally:
        engine.stop()
    mixed = 0
    for items, rows in seen:
        flags, expected = [], set()
        for start, count, prompt in items:
            for position in range(start, start + count):
                if position < prompt:
                    expected.add(len(flags))
                flags.append(position < prompt)
        assert {row for first, end in rows for row in range(first, end)} == expected
        mixed += any(flags) and not all(flags)
    assert mixed, "no step mixed prompt and generated positions: the case this test is for did not occur"


def test_auto_follows_an_explicit_model_dtype_whatever_the_cpu(monkeypatch):
    """``--dtype float32`` means float32 throughout: auto's own choice (bfloat16 on a CPU with native
    products) only where model.dtype is auto too, so greedy speech does not depend on the CPU."""
    from audio_pipeline.models import prompt_precision

    monkeypatch.setattr(prompt_precision, "native_bfloat16_cpu", lambda: True)  # whatever CPU runs this
    choose = prompt_precision.choose_prompt_dtype
    assert choose("auto", torch.float32, CPU, dtype_setting="float32") == (
        None, "model.prompt_dtype=auto follows model.dtype=float32, set explicitly")
    assert choose("auto", torch.float32, CPU, dtype_setting="auto") == (
        torch.bfloat16, "model.prompt_dtype=auto: model.dtype is auto and this CPU multiplies bfloat16 natively "
        "(AVX512-BF16 or AMX)")
    assert choose("auto", torch.bfloat16, CPU, dtype_setting="bfloat16")[0] is None
    assert choose("bfloat16", torch.float32, CPU, dtype_setting="float32")[0] == torch.bfloat16  # asked for by name
    assert resolve_prompt_dtype("auto", torch.float32, CPU, dtype_setting="float32") is None
    monkeypatch.setattr(prompt_precision, "native_bfloat16_cpu", lambda: False)
    assert choose("auto", torch.float32, CPU) == (None, "model.prompt_dtype=auto: this CPU has no native bfloat16 "
                                                        "products")


@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_the_start_up_log_says_what_auto_chose_in_one_line(tiny_model_dir, caplog, monkeypatch, dtype):
    """On a CPU with native bfloat16 products: an explicit --dtype float32 engine keeps float32 prompt
    products, the default one takes bfloat16; one INFO line says which and why."""
    import logging

    from audio_pipeline.models import prompt_precision

    monkeypatch.setattr(prompt_precision, "native_bfloat16_cpu", lambda: True)
    with caplog.at_level(logging.INFO, logger="audio_pipeline.models.llama_model"):
        engine = TTSEngine(make_config(tiny_model_dir, model={"dtype": dtype}))
    lines = [r.getMessage() for r in caplog.records if "prompt positions' products" in r.getMessage()]
    assert len(lines) == 1 and all(r.levelno == logging.INFO for r in caplog.records
                                   if "prompt positions' products" in r.getMessage())
    if dtype == "float32":
        assert engine.model.prompt_dtype is None
        assert lines == ["prompt positions' products in float32, the model's dtype (model.prompt_dtype=auto follows "
                         "model.dtype=float32, set explicitly)"]
    else:
        assert engine.model.prompt_dtype == torch.bfloat16
        assert lines[0].startswith("prompt positions' products in bfloat16 (model.prompt_dtype=auto: model.dtype is "
                                   "auto and this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX)): ")
        assert lines[0].endswith(" weight copies")
