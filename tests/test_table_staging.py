"""A steady decode step staged from the tables (the row table's columns, the KV cache's page table,
each slot's latest sample kept on the device) gives the device exactly the inputs the same step
staged row by row gives: token ids and frames, positions, cache slots, attention metadata, every
sampling row and draw, the frame codes alignments fix; so the speech is the same bit for bit. Steps
the tables do not serve (prompts, batches mixing prompts and decode rows, forced runs of phoneme-lpc,
Qwen3-TTS's text track) are staged row by row in both runs. Two engines built alike run the same
requests, one scheduling and staging every step row by row, the other with the scheduler's
persistent batch (core/steady_batch.py) and from the tables wherever it can: mixed batches, a request
joining late, seeded sampling rules, and preemption in a cache too small for all."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from audio_pipeline.core.kv_cache.paged import PagedKVCache
from audio_pipeline.core.model_runner import ModelRunner
from audio_pipeline.core.scheduler import AudioGenerationScheduler
from audio_pipeline.core.steady_batch import SteadyItems
from audio_pipeline.service.engine import TTSEngine
from csm_model import write_tiny_csm
from helpers import make_config

RULES = [dict(temperature=0.0), dict(temperature=0.9, top_p=0.9, seed=1), dict(temperature=0.7, top_k=20, seed=2),
         dict(temperature=1.0, min_p=0.05, repetition_penalty=1.3, seed=3), dict(temperature=0.8, min_tokens=14, seed=4)]
TEXTS = ["Hello there.", "A somewhat longer sentence for a longer prompt.", "Hi!", "One more, to join late."]
PAGE = 16
#: Cache pages the small cache holds: fewer than the requests need together, so some are preempted.
SMALL_CACHE_PAGES = 22


def model_for(name, tiny_model_dir, tmp_path_factory):
    if name == "tiny-orpheus":
        return tiny_model_dir
    if name == "tiny-csm":
        return write_tiny_csm(tmp_path_factory.mktemp("csm") / "model", seed=0)
    return name


def engines(model, small: bool):
    """Two engines built alike (not started), with pages of 16 tokens (a page boundary every 16
    steps) and, where ``small``, a cache small enough for preemption."""
    cache = {"kv_cache_page_size": PAGE}
    flags = ("chunk_size=32,64",) if "csm" in str(model) else ()  # Mimi's frames are 32 tokens
    if small:
        probe = TTSEngine(make_config(model, *flags, model={"kv_cache": cache}))
        cache["kv_cache_memory_bytes"] = SMALL_CACHE_PAGES * PagedKVCache.bytes_per_block(probe.kv_cache.params)
        del probe
    return [TTSEngine(make_config(model, *flags, model={"kv_cache": cache})) for _ in range(2)]


def run(engine, from_tables: bool, steps: int):
    """The requests' steps (one joins late), each launched before the one before it is read; returns
    every step's device inputs, the requests' tokens, steps staged from the tables, preemptions."""
    runner = ModelRunner(engine.model, engine.kv_cache, engine.layout, sync_free=True)
    # Row by row means the whole old way: no persistent batch in the scheduler either.
    scheduler = AudioGenerationScheduler(
        dataclasses.replace(engine.scheduler.config, max_batch_size=8, enable_in_flight_batching=True,
                            max_num_steps=1, deadline_scheduling=False),
        engine.scheduler.block_manager, steady_batches=from_tables)
    contexts = [engine.create_context(TEXTS[i % 3], request_id=f"r{i}", max_tokens=48, **rule)
                for i, rule in enumerate(RULES)]
    late = engine.create_context(TEXTS[3], request_id="late", max_tokens=40, temperature=0.8, top_k=50, seed=9)
    seen, tabled = [], []
    forward, stage_decode = runner._forward, runner._stage_decode

    def record(device, metadata, padded, prompt_rows=()):
        step = {name: tensor.clone() for name, tensor in device.items()
                if name not in ("chain_rows", "chain_slots", "fresh_slots")}
        step.update({f"metadata.{name}": value for name, value in vars(metadata).items()})
        step.update(padded=padded, prompt_rows=prompt_rows)
        seen.append(step)
        return forward(device, metadata, padded, prompt_rows)

    def count(items):
        staged = stage_decode(items)
        tabled.append((staged is not None, type(items) is SteadyItems))
        return staged

    runner._forward = record
    launch = runner.launch if from_tables else (lambda items: ModelRunner.launch(runner, items, from_tables=False))
    if from_tables:
        runner._stage_decode = count
    for context in contexts:
        scheduler.add(context)
    pending = []
    for step in range(steps):
        if step == 9:
            scheduler.add(late)
        output = scheduler.schedule()
        pending.append((output, launch(output.items)))
        if len(pending) > 1:
            done, launched = pending.pop(0)
            scheduler.update(done, launched.result())
    while pending:
        done, launched = pending.pop(0)
        scheduler.update(done, launched.result())
    tokens = [(c.generated, c.frames) for c in [*contexts, late]]
    return seen, tokens, [sum(column) for column in zip(*tabled)] or [0, 0], scheduler.num_preemptions


def assert_same_step(index, one, other):
    assert one.keys() == other.keys(), index
    for name, value in one.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == other[name].dtype and torch.equal(value, other[name]), (index, name)
        elif isinstance(value, np.ndarray):
            assert value.dtype == other[name].dtype and np.array_equal(value, other[name]), (index, name)
        else:
            assert value == other[name], (index, name)


@pytest.mark.parametrize("model,small,served", [
    ("tiny-orpheus", False, True), ("tiny-orpheus", True, True),
    ("builtin:slt-en-v5", False, True),  # frames and an alignment's fixed codes and forced end
    ("tiny-csm", False, True),  # frames from a depth decoder, no alignment
    ("builtin:slt-en", False, False),  # phoneme-lpc: forced runs follow samples, row by row
])
def test_steps_from_the_tables_are_the_steps_staged_row_by_row(model, small, served, tiny_model_dir,
                                                              tmp_path_factory):
    row_by_row, tables = engines(model_for(model, tiny_model_dir, tmp_path_factory), small)
    seen, tokens, _, preempted = run(row_by_row, False, steps=40)
    seen_tables, tokens_tables, tabled, preempted_tables = run(tables, True, steps=40)
    assert len(seen) == len(seen_tables) > 20
    for index, (one, other) in enumerate(zip(seen, seen_tables)):
        assert_same_step(index, one, other)
    assert tokens == tokens_tables and preempted == preempted_tables
    assert sum(len(generated) > 8 for generated, _ in tokens) >= 4, [len(generated) for generated, _ in tokens]
    staged_from_tables, from_the_batch = tabled
    if served:
        assert staged_from_tables > 10, "steady decode steps were staged from the tables"
        assert from_the_batch > 5, "the scheduler's persistent batch made steady steps"
    else:
        assert staged_from_tables == 0
    if small:
        assert preempted > 0, f"the small cache preempted a request: {[len(g) for g, _ in tokens]}"
