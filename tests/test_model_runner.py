"""The model runner: a step is launched without reading anything back from the device, sampling
decides its rule from host data only, padded decode batches give the tokens unpadded ones give, and
the repetition counts kept on the device are each request's own."""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext

import numpy as np
import pytest
import torch

from audio_pipeline.service.engine import TTSEngine
from audio_pipeline.core.model_runner import ModelRunner
from audio_pipeline.core.sampler import DeviceSamplingRows, SamplingRows, sample_rows, slot_counts
from audio_pipeline.core.scheduler import AudioGenerationScheduler
from helpers import make_config, run_texts, start_engine
from sync_guard import HostSync, no_host_sync

#: Every sampling rule the runner has: greedy, the full nucleus, a top_k prefix, penalties, stop ids.
SETTINGS = [dict(temperature=0.0), dict(temperature=0.9, top_p=0.9, seed=1), dict(temperature=0.7, top_k=20, seed=2),
            dict(temperature=1.0, top_k=200, min_p=0.05, seed=3),
            dict(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.5),
            dict(temperature=0.8, stop_token_ids=[5], min_tokens=14, seed=4)]


@pytest.fixture(scope="module", params=["tiny-orpheus", "builtin:slt-en"])
def engine(request, tiny_model_dir):
    """An engine whose parts the tests drive directly (not started): the tiny random Orpheus-layout
    model, and the built-in voice (phoneme-lpc: forced tokens follow samples)."""
    return TTSEngine(make_config(tiny_model_dir if request.param == "tiny-orpheus" else request.param))


def contexts_for(engine, prefix="r"):
    texts = ["Hello there.", "A somewhat longer sentence for a longer prompt.", "Hi!"]
    return [engine.create_context(texts[i % len(texts)], request_id=f"{prefix}{i}", max_tokens=70, **settings)
            for i, settings in enumerate(SETTINGS)]


def drive(engine, runner, contexts, steps, *, guard=True, ahead=False):
    """Runs ``steps`` steps of the contexts as a scheduler plans them (every request in every step:
    the prompts, then one sample each with its forced tokens), each launched inside the host-sync
    guard, and applies each result in order through the scheduler's update. With ``ahead`` step
    n + 1 is launched before step n's result is read: its first tokens are then step n's samples,
    on the device."""
    scheduler = AudioGenerationScheduler(
        dataclasses.replace(engine.scheduler.config, max_batch_size=len(contexts), enable_in_flight_batching=True,
                            max_num_steps=1),
        engine.scheduler.block_manager)
    for context in contexts:
        scheduler.add(context)
    pending = []
    try:
        for _ in range(steps):
            output = scheduler.schedule()
            with no_host_sync(runner.device) if guard else nullcontext():
                pending.append((output, runner.launch(output.items)))
            if not ahead or len(pending) > 1:
                output, launched = pending.pop(0)
                scheduler.update(output, launched.result())
        while pending:
            output, launched = pending.pop(0)
            scheduler.update(output, launched.result())
    finally:
        for context in contexts:
            scheduler.remove(context.request_id)


@pytest.mark.parametrize("buckets", [(), (4, 8)], ids=["exact", "padded"])
def test_a_step_reads_nothing_back_from_the_device(engine, buckets):
    """Input building (staging, the attention metadata, the random draws), the forward pass, the
    candidate logits, sampling and the counts update run inside a guard that fails on any
    operation that would wait for the device: prompts, decode steps (padded or not), every rule."""
    runs = []
    for guard in (True, False):
        runner = ModelRunner(engine.model, engine.kv_cache, engine.layout, decode_buckets=buckets, sync_free=True)
        contexts = contexts_for(engine, prefix=f"{guard}")
        drive(engine, runner, contexts, steps=20, guard=guard)
        runs.append([c.generated for c in contexts])
    # The guarded steps ran, and gave what the same steps give unguarded.
    assert runs[0] == runs[1] and all(len(tokens) >= 14 for tokens in runs[0][:3])


def test_the_guard_catches_a_step_that_reads_back(engine, monkeypatch):
    """Where reading back is allowed (the CPU's own rule, sync_free off), the torch form of the rule
    (what serves where the native sampler cannot be built) first tries a flat row's nucleus over a
    prefix and checks it on the host: the guard sees that."""
    import audio_pipeline_kernels.native_sampler as native

    monkeypatch.setattr(native.native_sampler, "tried", True)
    monkeypatch.setattr(native.native_sampler, "kernel", None)
    runner = ModelRunner(engine.model, engine.kv_cache, engine.layout, sync_free=False)
    contexts = [engine.create_context("Hello there.", request_id="flat", temperature=5.0, top_p=0.99, seed=7)]
    with pytest.raises(HostSync):
        drive(engine, runner, contexts, steps=2)


def test_the_guard_watches_the_engines_device_only():
    """On the CPU every tensor stands for a device tensor and a read-back fails; for a CUDA engine
    a host tensor's value (FlashInfer's planners read their index arrays) is no wait and passes,
    with or without a GPU here."""
    host = torch.arange(4)
    with pytest.raises(HostSync, match="item"):
        with no_host_sync("cpu"):
            host.sum().item()
    with pytest.raises(HostSync, match="nonzero"):
        with no_host_sync(torch.device("cpu")):
            torch.nonzero(host)
    with no_host_sync("cuda"):
        assert host.sum().item() == 6 and host.tolist() == [0, 1, 2, 3] and bool(host[1])
        assert torch.nonzero(host).shape == (3, 1) and host[host > 1].tolist() == [2, 3]


@pytest.mark.parametrize("spread", [10.0, 1.0, 0.1])
def test_sampling_without_reading_back_picks_what_the_checked_rule_picks(spread):
    """The sync-free sampler (the rule chosen from the settings alone) and the CPU's checked rule
    (a prefix first, checked on the host) draw the same ids, for sharp and flat rows alike."""
    from audio_pipeline.core.request import TTSContext
    from audio_pipeline.layouts.orpheus import OrpheusLayout
    from audio_pipeline.core.sampling_params import SamplingParams

    layout = OrpheusLayout()

    def contexts_seeded():  # fresh requests: the same seeds, so the same draws
        return [TTSContext(request_id=f"s{i}", prompt_ids=[1, 2], layout=layout,
                           sampling=SamplingParams(**{"seed": 100 + i, **SETTINGS[i % len(SETTINGS)]}))
                for i in range(24)]

    contexts = contexts_seeded()
    generator = torch.Generator().manual_seed(int(spread * 10))
    width = SamplingRows.build(contexts, draw=False).width
    scores = torch.randn(len(contexts), width, generator=generator) * spread
    counts = torch.poisson(torch.full((len(contexts), layout.codebook_size), 0.01), generator=generator)
    picks = []
    for sync_free in (True, False):
        contexts = contexts_seeded()
        rows = SamplingRows.build(contexts)
        device_rows = DeviceSamplingRows.copy_of(rows, torch.device("cpu"))
        picks.append(sample_rows(scores.clone(), rows, device_rows, counts, sync_free=sync_free).tolist())
    assert picks[0] == picks[1]
    assert len(set(picks[0])) > 3


def test_device_counts_are_each_requests_codes_by_frame_slot(engine):
    """After a run, the device table holds exactly the codes each request generated in each frame
    slot (samples and the forced tokens that follow them), the reference the penalties read."""
    runner = ModelRunner(engine.model, engine.kv_cache, engine.layout, sync_free=True)
    contexts = contexts_for(engine, prefix="c")
    drive(engine, runner, contexts, steps=12, guard=False)
    frame = engine.layout.tokens_per_frame
    layout = engine.layout
    for context in contexts:
        expected = np.zeros((frame, layout.codebook_size), dtype=np.float32)
        for position, token in enumerate(context.generated):
            expected[position % frame, layout.token_to_code(token, position)] += 1
        torch.testing.assert_close(runner.device_rows.counts_of(context.request_id).cpu(), torch.from_numpy(expected))
        probe = type(context)(request_id="probe", prompt_ids=context.prompt_ids, sampling=context.sampling, layout=layout)
        probe.generated = context.generated
        assert np.array_equal(slot_counts(probe), expected[len(context.generated) % frame])
        runner.release(context.request_id)
    assert len(runner.rows) == 0


@pytest.mark.parametrize("settings", [dict(temperature=0.0), dict(temperature=0.8, seed=11)], ids=["greedy", "seeded"])
def test_padded_decode_batches_give_the_tokens_of_exact_ones(tiny_model_dir, settings):
    """Decode steps padded to bucket sizes (the static shapes CUDA graphs replay) run eagerly on
    the CPU: every request's tokens equal those of exact-size batches."""
    texts = ["Hello there.", "A much longer sentence that makes a longer prompt for the model.", "Hi!",
             "Numbers: one two three four five.", "Short."]
    tokens = []
    for buckets in ("none", "2,3,8"):
        engine = start_engine(tiny_model_dir, f"model.decode_buckets={buckets}")
        try:
            assert engine.core.runner.decode_buckets == ([] if buckets == "none" else [2, 3, 8])
            tokens.append([c.generated for c in run_texts(engine, texts, max_tokens=70, **settings)])
        finally:
            engine.stop()
    assert tokens[0] == tokens[1]


def test_the_overlap_step_reads_nothing_back_either(engine):
    """Launching step n + 1 before step n is read (its first tokens copied from step n's samples on
    the device, the forced tokens after them from the layout) passes the guard too."""
    runs = []
    for guard in (True, False):
        runner = ModelRunner(engine.model, engine.kv_cache, engine.layout, sync_free=True)
        contexts = contexts_for(engine, prefix=f"o{guard}")
        drive(engine, runner, contexts, steps=8, guard=guard, ahead=True)
        runs.append([c.generated for c in contexts])
    assert runs[0] == runs[1] and all(len(tokens) >= 8 for tokens in runs[0][:3])


@pytest.mark.parametrize("worker", [False, True], ids=["inline", "worker-thread"])
def test_a_step_launched_before_the_last_one_is_read_takes_its_sample_from_the_device(engine, worker):
    """Step n + 1 is launched from the tokens step n sampled, on the device, before step n's result
    reaches the host (with the CPU's worker thread, before step n has even run); the runner hands
    back plain data and writes no request; applied in order, the tokens equal one-step-at-a-time
    execution. With the built-in voice each sample is followed by forced tokens, which go in with it."""
    if worker and engine.model.devices[0].type != "cpu":
        pytest.skip("the worker thread is the CPU's overlap; CUDA runs ahead on its own (ModelRunner refuses it)")
    runs = []
    for ahead in (False, True):
        runner = ModelRunner(engine.model, engine.kv_cache, engine.layout, worker=worker and ahead)
        contexts = [engine.create_context(text, request_id=f"{ahead}{i}", temperature=0.0, max_tokens=70)
                    for i, text in enumerate(["Hello there.", "A longer sentence for a longer prompt.", "Hi!"])]
        drive(engine, runner, contexts, steps=12, guard=False, ahead=ahead)
        runner.close()
        runs.append([c.generated for c in contexts])
    assert runs[0] == runs[1]
    assert all(len(tokens) >= 12 for tokens in runs[0])


@pytest.mark.parametrize("settings", [SETTINGS[:5], SETTINGS], ids=["captured", "own-stop-ids"])
def test_the_captured_sampling_draws_the_eager_samplers_tokens(tiny_model_dir, settings):
    """The token sampling CUDA graphs capture (core/sample_graphs.py: one logit product over every
    frame slot, penalties and the sampling rule always on, rows padded to the bucket), run here on
    its fixed buffers without a graph, gives every request the tokens the eager sampler gives, for
    every rule, and reads nothing back. A request with stop ids of its own (another candidate width)
    makes the step sample eagerly, with the same logits."""
    from audio_pipeline.core.model_runner import sample_graphs_for

    engine = TTSEngine(make_config(tiny_model_dir))
    runs, replays = [], []
    for captured in (False, True):
        runner = ModelRunner(engine.model, engine.kv_cache, engine.layout, decode_buckets=(4, 8), sync_free=True)
        if captured:
            runner.sample_graphs = sample_graphs_for(engine.model, engine.layout, runner.frame_sampling, (4, 8),
                                                     capture=False)
        contexts = [engine.create_context(["Hello there.", "A somewhat longer sentence.", "Hi!"][i % 3],
                                          request_id=f"g{captured}{i}", max_tokens=70, **s)
                    for i, s in enumerate(settings)]
        drive(engine, runner, contexts, steps=24)
        runs.append([c.generated for c in contexts])
        replays.append(runner.sample_graphs.replays if captured else 0)
    assert runs[0] == runs[1] and all(len(tokens) >= 20 for tokens in runs[0])
    assert replays[1] > 15 if len(settings) == 5 else replays[1] == 0


def test_the_captured_sampling_keeps_every_layouts_tokens(engine):
    """With the captured sampling on, every layout speaks what it speaks without: the built-in
    voice's steps (a sample, then the forced tokens that follow it) sample eagerly, with the
    captured form's logits, and the Orpheus layout's decode steps replay the captured sampling."""
    from audio_pipeline.core.model_runner import sample_graphs_for

    runs, replays = [], 0
    for captured in (False, True):
        runner = ModelRunner(engine.model, engine.kv_cache, engine.layout, decode_buckets=(4, 8), sync_free=True)
        if captured:
            runner.sample_graphs = sample_graphs_for(engine.model, engine.layout, runner.frame_sampling, (4, 8),
                                                     capture=False)
        contexts = contexts_for(engine, prefix=f"k{captured}")[:5]
        drive(engine, runner, contexts, steps=16)
        runs.append([c.generated for c in contexts])
        replays = runner.sample_graphs.replays if captured else 0
    assert runs[0] == runs[1] and all(len(tokens) >= 14 for tokens in runs[0][:3])
    print(type(engine.layout).__name__, "replays", replays)
    assert (replays > 0) == (type(engine.layout).__name__ == "OrpheusLayout")


def test_a_large_prompt_step_runs_on_the_prefill_threads_and_gives_the_same_tokens(tiny_model_dir):
    """On the CPU a step of PREFILL_THREADS_MIN_TOKENS tokens or more (prompts arriving together)
    runs its forward pass on ``prefill_threads`` intra-op threads, the decode steps after it on the
    engine's own again, and every request speaks what it speaks with one thread throughout."""
    from audio_pipeline.core.model_runner import PREFILL_THREADS_MIN_TOKENS

    engine = TTSEngine(make_config(tiny_model_dir))
    if engine.model.devices[0].type != "cpu":
        pytest.skip("prefill_threads are the CPU's intra-op threads for a prompt step; CUDA has none")
    seen: list[tuple[int, int]] = []
    hook = engine.model.model.register_forward_pre_hook(
        lambda module, args: seen.append((args[0].shape[0], torch.get_num_threads())))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    runs = []
    try:
        for prefill_threads in (1, 2):
            runner = ModelRunner(engine.model, engine.kv_cache, engine.layout, sync_free=True, prefill_threads=prefill_threads)
            contexts = [engine.create_context("A somewhat longer sentence, so that the prompts together are long. "
                                              f"Number {i}.", request_id=f"p{prefill_threads}-{i}", temperature=0.0,
                                              max_tokens=70) for i in range(12)]
            seen.clear()
            drive(engine, runner, contexts, steps=6, guard=False)
            runs.append([c.generated for c in contexts])
            assert seen[0][0] >= PREFILL_THREADS_MIN_TOKENS and seen[0][1] == prefill_threads
            assert all(count == 1 for tokens, count in seen[1:]) and torch.get_num_threads() == 1
    finally:
        hook.remove()
        torch.set_num_threads(threads)
    assert runs[0] == runs[1] and all(len(tokens) >= 5 for tokens in runs[0])
