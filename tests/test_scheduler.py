"""AudioGenerationScheduler (torch-free): every knob, chunked prefill, in-flight batching, preemption.

Requests here are plain objects with the scheduler's documented duck type; ``run_step`` plays the
model runner's part (tests/scheduler_harness.py).
"""

import pytest

from audio_pipeline.config import PipelineConfig
from audio_pipeline.core.scheduler import Finished, QueueFull, SchedulerConfig
from audio_pipeline.core.stop import StopReason
from scheduler_harness import Clock, Request, drain, make_scheduler, prompt, run_step


def test_prefill_then_decode_until_every_request_finishes_and_frees_its_blocks():
    scheduler, manager = make_scheduler()
    requests = [Request(f"r{i}", prompt(10, 100 * i)) for i in range(3)]
    for r in requests:
        scheduler.add(r)
    outputs = drain(scheduler)
    assert outputs[0].kind == "ce" and outputs[0].batch_size == 3 and outputs[0].input_tokens == 30
    assert all(o.kind == "tg" for o in outputs[1:])
    assert all(len(r.generated) == r.budget for r in requests)
    assert manager.num_used_blocks == 0 and manager.sequences == []


def test_max_batch_size_caps_every_step():
    scheduler, manager = make_scheduler(max_batch_size=2, max_num_steps=1)
    requests = [Request(f"r{i}", prompt(6, 10 * i)) for i in range(5)]
    for request in requests:
        scheduler.add(request)
    outputs = drain(scheduler)
    assert max(o.batch_size for o in outputs) == 2
    # Capped, not starved: every request reached its budget, and nothing is held afterwards.
    assert all(len(r.generated) == r.budget for r in requests) and manager.num_used_blocks == 0


def test_chunked_prefill_splits_long_prompts_across_steps():
    scheduler, _ = make_scheduler(max_batch_input_tokens=8)
    long = Request("long", prompt(20))
    scheduler.add(long)
    first = scheduler.schedule()
    assert [(i.start, i.num_tokens, i.sample) for i in first.items] == [(0, 8, False)]
    run_step(scheduler, first)
    second = scheduler.schedule()
    assert [(i.start, i.num_tokens, i.sample) for i in second.items] == [(8, 8, False)]
    run_step(scheduler, second)
    third = scheduler.schedule()
    assert [(i.start, i.num_tokens, i.sample) for i in third.items] == [(16, 4, True)]


def test_without_chunked_prefill_a_prompt_waits_for_a_step_that_holds_all_of_it():
    scheduler, _ = make_scheduler(max_batch_input_tokens=10, enable_chunked_prefill=False)
    scheduler.add(Request("a", prompt(6)))
    scheduler.add(Request("b", prompt(6, 50)))
    first = scheduler.schedule()
    assert [(i.request.request_id, i.num_tokens) for i in first.items] == [("a", 6)]
    # An oversize prompt (after a preemption, say) still runs, alone in its step.
    scheduler2, _ = make_scheduler(max_batch_input_tokens=4, enable_chunked_prefill=False)
    scheduler2.add(Request("big", prompt(9)))
    assert [i.num_tokens for i in scheduler2.schedule().items] == [9]


def test_in_flight_batching_mixes_prefill_into_decode_steps():
    scheduler, manager = make_scheduler(enable_in_flight_batching=True, max_batch_input_tokens=6)
    first_request = Request("a", prompt(4), budget=20)
    scheduler.add(first_request)
    run_step(scheduler, scheduler.schedule())
    second = Request("b", prompt(12, 100), budget=4)
    scheduler.add(second)
    mixed = scheduler.schedule()
    assert mixed.kind == "mixed"
    assert [(i.request.request_id, i.num_tokens) for i in mixed.items] == [("a", 1), ("b", 5)]
    run_step(scheduler, mixed)
    drain(scheduler)
    # "a" kept decoding while "b" prefilled: both reached their budgets and freed their blocks.
    assert len(first_request.generated) == 20 and len(second.generated) == 4
    assert manager.num_used_blocks == 0 and manager.sequences == []


def test_alternating_mode_keeps_prefill_and_decode_apart():
    scheduler, _ = make_scheduler(max_batch_input_tokens=6)
    scheduler.add(Request("a", prompt(4), budget=20))
    run_step(scheduler, scheduler.schedule())
    scheduler.add(Request("b", prompt(12, 100), budget=4))
    outputs = drain(scheduler)
    assert {o.kind for o in outputs} == {"ce", "tg"}


def test_min_batch_size_tg_keeps_decoding_while_enough_requests_decode():
    scheduler, _ = make_scheduler(min_batch_size_tg=2, max_num_steps=1)
    for i in range(2):
        scheduler.add(Request(f"r{i}", prompt(4, 10 * i), budget=10))
    run_step(scheduler, scheduler.schedule())  # both prefilled together
    scheduler.add(Request("late", prompt(4, 99)))
    assert scheduler.schedule().kind == "tg"  # two decoding >= floor: the newcomer waits
    scheduler3, _ = make_scheduler(min_batch_size_tg=3, max_num_steps=1)
    for i in range(2):
        scheduler3.add(Request(f"r{i}", prompt(4, 10 * i), budget=10))
    run_step(scheduler3, scheduler3.schedule())
    scheduler3.add(Request("late", prompt(4, 99)))
    assert scheduler3.schedule().kind == "ce"  # below the floor: prefill first


def test_prioritize_first_decode_runs_decode_right_after_prefill():
    for prioritize, expected in ((True, "tg"), (False, "ce")):
        scheduler, _ = make_scheduler(enable_prioritize_first_decode=prioritize, max_batch_size=1, max_queue_size_tg=4,
                            max_num_steps=1)
        scheduler.add(Request("a", prompt(4)))
        scheduler.add(Request("b", prompt(4, 50)))
        first = scheduler.schedule()
        assert first.kind == "ce"
        run_step(scheduler, first)
        assert scheduler.schedule().kind == expected


def test_ce_delay_holds_a_lone_prompt_until_the_delay_or_a_full_batch():
    clock = Clock()
    scheduler, _ = make_scheduler(ce_delay_ms=50, max_batch_size=3, clock=clock)
    scheduler.add(Request("a", prompt(4), arrival_time=0.0))
    held = scheduler.schedule()
    assert not held.items and held.wait_s == pytest.approx(0.05)
    clock.now = 0.02
    scheduler.add(Request("b", prompt(4, 20), arrival_time=0.02))
    assert not scheduler.schedule().items
    scheduler.add(Request("c", prompt(4, 40), arrival_time=0.02))  # a full batch goes at once
    assert scheduler.schedule().batch_size == 3

    clock2 = Clock()
    scheduler2, _ = make_scheduler(ce_delay_ms=50, clock=clock2)
    scheduler2.add(Request("a", prompt(4)))
    assert not scheduler2.schedule().items
    clock2.now = 0.051
    assert scheduler2.schedule().kind == "ce"


def test_max_num_steps_runs_multi_step_decode():
    scheduler, _ = make_scheduler(max_num_steps=3)
    r = Request("a", prompt(4), budget=7)
    scheduler.add(r)
    run_step(scheduler, scheduler.schedule())
    decode = scheduler.schedule()
    assert decode.kind == "tg" and decode.num_steps == 3
    run_step(scheduler, decode)
    assert len(r.generated) == 4
    last = None
    while (output := scheduler.schedule()).items:
        last = output
        run_step(scheduler, output)
    assert last.num_steps == 3  # 4 + 3 = 7: the last round stops exactly at the budget
    assert len(r.generated) == 7


def test_max_queue_size_tg_admits_more_than_a_batch_and_rotates_decode():
    scheduler, _ = make_scheduler(max_batch_size=2, max_queue_size_tg=4, max_num_steps=1)
    requests = [Request(f"r{i}", prompt(4, 10 * i), budget=6) for i in range(4)]
    for r in requests:
        scheduler.add(r)
    drain(scheduler)
    assert all(len(r.generated) == 6 for r in requests)
    scheduler2, _ = make_scheduler(max_batch_size=2, max_queue_size_tg=2, max_num_steps=1)
    for r in [Request(f"s{i}", prompt(4, 10 * i)) for i in range(4)]:
        scheduler2.add(r)
    run_step(scheduler2, scheduler2.schedule())
    assert scheduler2.num_running == 2 and scheduler2.num_waiting == 2


def test_watermark_defers_admission():
    scheduler, manager = make_scheduler(blocks=10, block_size=4, kvcache_ce_watermark=0.5)
    scheduler.add(Request("a", prompt(16), budget=2))  # 4 blocks: 40 %
    scheduler.add(Request("b", prompt(8, 50), budget=2))  # +2 blocks would be 60 %
    first = scheduler.schedule()
    assert [i.request.request_id for i in first.items] == ["a"]


def test_queue_limit_and_oversize_requests():
    # One batch slot, two queue places: three requests fit (the slot is free), a fourth does not.
    scheduler, _ = make_scheduler(max_queue_size=2, max_batch_size=1, blocks=4, block_size=4)
    for name in "abc":
        scheduler.add(Request(name, prompt(4)))
    with pytest.raises(QueueFull, match="queue is full"):
        scheduler.add(Request("d", prompt(4)))
    with pytest.raises(ValueError, match="already in flight"):
        scheduler.add(Request("a", prompt(4)))
    scheduler2, _ = make_scheduler(blocks=2, block_size=4)
    with pytest.raises(ValueError, match="more than the whole cache"):
        scheduler2.add(Request("huge", prompt(6), budget=8))


def test_preemption_recomputes_and_every_request_still_finishes():
    # 6 blocks of 4 tokens: three requests of up to 12 tokens cannot all hold their KV at once.
    scheduler, manager = make_scheduler(blocks=6, block_size=4, max_num_steps=1, kvcache_ce_watermark=1.0)
    requests = [Request(f"r{i}", prompt(4, 10 * i), budget=8) for i in range(3)]
    for r in requests:
        scheduler.add(r)
    outputs = drain(scheduler)
    assert scheduler.num_preemptions > 0
    assert any(o.preempted for o in outputs)
    assert all(len(r.generated) == 8 for r in requests)
    # A preempted request prefills again from position 0: its prompt plus what it had generated.
    prefilled, recomputes = set(), []
    for item in (i for o in outputs for i in o.items if i.start == 0 and o.kind == "ce"):
        (recomputes if item.request in prefilled else []).append(item)
        prefilled.add(item.request)
    assert recomputes
    assert all(len(i.request.prompt) < i.num_tokens < len(i.request.prompt) + i.request.budget for i in recomputes)
    assert manager.num_used_blocks == 0 and manager.sequences == []


def test_requests_sharing_a_prompt_prefix_skip_its_prefill():
    scheduler, manager = make_scheduler(blocks=16, block_size=4)
    voice = prompt(9, 500)  # a shared voice preamble: two full blocks
    scheduler.add(Request("first", voice + [1, 2]))
    drain(scheduler)
    scheduler.add(Request("second", voice + [3, 4, 5]))
    item = scheduler.schedule().items[0]
    assert (item.start, item.num_tokens) == (8, 4)
    assert manager.prefix_stats.hit_tokens == 8
    assert manager.prefix_stats.hit_rate == pytest.approx(8 / (11 + 12))


def test_cancel_works_for_queued_and_running_requests():
    scheduler, manager = make_scheduler(max_batch_size=1, max_queue_size_tg=1)
    a, b = Request("a", prompt(4)), Request("b", prompt(4, 50))
    scheduler.add(a)
    scheduler.add(b)
    run_step(scheduler, scheduler.schedule())
    assert manager.sequences == ["a"]
    assert scheduler.remove("b") is b and scheduler.num_waiting == 0
    assert scheduler.remove("a") is a and manager.num_used_blocks == 0
    assert scheduler.remove("a") is None


def test_update_returns_the_requests_that_finished_with_their_reasons_and_frees_their_blocks():
    scheduler, manager = make_scheduler(max_num_steps=1)
    eos = Request("eos", prompt(4), stop_id=1001)  # its second sample is its end of speech
    full = Request("max", prompt(4, 10), budget=2)
    cancelled, failed, going = (Request(name, prompt(4, base)) for name, base in
                                [("cancelled", 20), ("failed", 30), ("going", 40)])
    for r in (eos, full, cancelled, failed, going):
        scheduler.add(r)
    assert run_step(scheduler, scheduler.schedule()) == []  # prefill: everyone samples a first token
    # Between steps nothing is in flight: a cancellation or a failure lets go at once.
    assert scheduler.finish(cancelled, StopReason.CANCELLED) == [Finished(cancelled, StopReason.CANCELLED)]
    assert scheduler.finish(failed, StopReason.FAILED, "decoder exploded") == [
        Finished(failed, StopReason.FAILED, "decoder exploded")]
    assert manager.sequences == ["eos", "max", "going"]
    assert run_step(scheduler, scheduler.schedule()) == [Finished(eos, StopReason.END_OF_SPEECH),
                                                         Finished(full, StopReason.MAX_TOKENS)]
    assert eos.generated == [1000] and full.generated == [1000, 1001]
    assert manager.sequences == ["going"] and scheduler.running == [going]
    assert [r.stop_reason for r in (eos, full, cancelled, failed, going)] == [
        StopReason.END_OF_SPEECH, StopReason.MAX_TOKENS, StopReason.CANCELLED, StopReason.FAILED, None]
    # An ended request keeps its reason, except that a failure (its audio lost) overrides it.
    assert scheduler.finish(eos, StopReason.CANCELLED) == [] and eos.stop_reason == StopReason.END_OF_SPEECH
    assert scheduler.finish(eos, StopReason.FAILED, "late") == [Finished(eos, StopReason.FAILED, "late")]
    assert eos.stop_reason == StopReason.FAILED


def test_a_request_ended_while_in_flight_is_let_go_by_the_update_that_ends_its_flight():
    scheduler, manager = make_scheduler()
    r = Request("a", prompt(4))
    scheduler.add(r)
    output = scheduler.schedule()
    assert scheduler.finish(r, StopReason.CANCELLED) == []  # its step runs: its blocks stay until it is done
    assert r.stop_reason == StopReason.CANCELLED and "a" in scheduler and scheduler.schedule().items == []
    assert run_step(scheduler, output) == [Finished(r, StopReason.CANCELLED)]
    assert r.generated == [] and "a" not in scheduler and manager.num_used_blocks == 0


def test_overlapping_steps_let_a_finished_request_go_with_its_last_step_in_flight():
    """With overlap the next step is planned before the previous one is applied: a request whose
    end of speech comes in the first is let go by the update of the second."""
    scheduler, manager = make_scheduler(max_num_steps=1)
    r = Request("a", prompt(4), stop_id=1001)
    scheduler.add(r)
    first, second = scheduler.schedule(), scheduler.schedule()
    assert run_step(scheduler, first) == []
    third = scheduler.schedule()  # planned while the second is in flight
    assert run_step(scheduler, second) == []  # ends the speech; the third step is still in flight
    assert r.stop_reason == StopReason.END_OF_SPEECH and "a" in scheduler
    assert run_step(scheduler, third) == [Finished(r, StopReason.END_OF_SPEECH)]
    assert r.generated == [1000] and manager.sequences == []


def test_a_failure_after_a_failed_step_lets_go_at_once():
    """After a failed step the caller gives up what it launched: ``stopped`` lets the request go
    though the scheduler still counts a step of it in flight, and that step's late update is a no-op."""
    scheduler, manager = make_scheduler()
    r = Request("a", prompt(4))
    scheduler.add(r)
    output = scheduler.schedule()
    assert scheduler.finish(r, StopReason.FAILED, "generation failed: boom", stopped=True) == [
        Finished(r, StopReason.FAILED, "generation failed: boom")]
    assert "a" not in scheduler and manager.sequences == []
    assert scheduler.update(output) == []


def test_a_request_that_can_never_fit_is_failed_by_schedule():
    scheduler, manager = make_scheduler(blocks=4, block_size=4, kvcache_ce_watermark=0.5)
    r = Request("big", prompt(12), budget=2)  # 4 blocks: within the cache, never within the watermark
    scheduler.add(r)
    output = scheduler.schedule()
    assert output.items == [] and output.finished == [
        Finished(r, StopReason.FAILED, "the request does not fit in the KV cache")]
    assert r.stop_reason == StopReason.FAILED and "big" not in scheduler and manager.sequences == []


def test_overlap_scheduling_plans_the_next_step_before_the_previous_is_applied():
    scheduler, _ = make_scheduler(max_num_steps=1)
    r = Request("a", prompt(4), budget=4)
    scheduler.add(r)
    first = scheduler.schedule()  # prefill, in flight
    second = scheduler.schedule()  # decode of the token the prefill will sample
    assert [(i.start, i.num_tokens) for i in second.items] == [(4, 1)]
    run_step(scheduler, first)
    run_step(scheduler, second)
    assert r.processed == 5 and len(r.generated) == 2


def test_config_validation():
    with pytest.raises(ValueError, match="max_num_steps"):
        make_scheduler(max_num_steps=0)
    with pytest.raises(ValueError, match="kvcache_ce_watermark"):
        make_scheduler(kvcache_ce_watermark=0)
    with pytest.raises(ValueError, match="max_batch_size, max_queue_size, enable_in_flight_batching, deadline_scheduling, "
                                         "rate_admission: resolve"):
        SchedulerConfig.from_config(PipelineConfig())  # the open values must be made the device's first


def test_the_committed_token_prefix_reads_like_the_joined_list():
    """The scheduler hands the block manager prompt + generated without joining them; every slice
    and index the block manager may take reads the same as the joined list."""
    from audio_pipeline.core.scheduler import _TokenPrefix

    prompt, generated = list(range(100, 110)), list(range(200, 207))
    joined = prompt + generated
    for length in (0, 5, 10, 13, 17):
        view = _TokenPrefix(prompt, generated, length)
        assert len(view) == length and list(view) == joined[:length]
        for start in range(0, length + 1):
            for stop in range(start, length + 2):
                assert view[start:stop] == joined[:length][start:stop]
        assert view[::2] == joined[:length][::2]
        if length:
            assert view[-1] == joined[length - 1] and view[length // 2] == joined[length // 2]


def test_a_burst_fills_free_batch_slots_and_the_queue_before_the_next_step():
    """max_batch_size running plus max_queue_size waiting may be held: a burst arriving before the
    scheduler runs is not turned away while batch slots stand empty."""
    scheduler, _ = make_scheduler(max_queue_size=8, max_batch_size=4, blocks=64, block_size=4)
    for i in range(12):
        scheduler.add(Request(f"r{i}", prompt(4, 10 * i)))
    with pytest.raises(QueueFull):
        scheduler.add(Request("r12", prompt(4, 200)))
    output = scheduler.schedule()
    assert len(output.items) == 4 and scheduler.num_running == 4 and scheduler.num_waiting == 8
    # With every slot taken, the queue alone decides.
    with pytest.raises(QueueFull):
        scheduler.add(Request("r13", prompt(4, 300)))
