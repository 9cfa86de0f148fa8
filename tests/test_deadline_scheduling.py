"""Deadline scheduling (torch-free): what the engine's listeners say of each stream, what steps are
learned to cost, and how the scheduler orders and sizes steps by the streams' slack."""

import math

import pytest

from audio_pipeline.core.deadlines import Listeners, PassRate, StepCosts
from audio_pipeline.core.scheduler import SchedulerConfig
from audio_pipeline.core.stop import StopReason
from scheduler_harness import Clock, Request, make_scheduler, prompt, run_step


# --- listeners ---------------------------------------------------------------------------------

def test_a_streams_deadline_is_when_its_audio_so_far_has_played_out():
    listeners = Listeners()
    listeners.add("a", "a")
    assert listeners.deadline("a") is None  # not heard yet
    listeners.delivered("a", 10.0, 0.2)
    listeners.delivered("a", 10.1, 0.2)
    assert listeners.deadline("a") == pytest.approx(10.4)
    listeners.delivered("a", 10.6, 0.1)  # ran dry at 10.4: it plays on from its arrival
    assert listeners.deadline("a") == pytest.approx(10.7)
    listeners.ended("a", 10.6)
    assert len(listeners) == 0 and listeners.deadline("a") is None


def test_a_later_piece_of_a_long_text_is_not_due_before_the_piece_playing_ends():
    listeners = Listeners()
    listeners.add("s-0", "s")
    listeners.add("s-1", "s")
    listeners.delivered("s-0", 1.0, 0.5)
    listeners.delivered("s-1", 1.1, 0.3)  # made early: it waits behind s-0's audio
    assert listeners.deadline("s-0") == pytest.approx(1.5)
    assert listeners.deadline("s-1") is None and listeners.follows("s-1") and not listeners.follows("s-0")
    listeners.ended("s-0", 1.2)  # s-0's last audio is out: s-1's waiting audio plays after it
    assert listeners.deadline("s-1") == pytest.approx(1.8) and not listeners.follows("s-1")


def test_step_costs_learn_what_a_pass_of_so_many_rows_takes_and_a_prompts_seconds_per_token():
    costs = StepCosts(pass_seconds=0.004, per_row=0.0002)
    assert costs.decode_pass(10) == pytest.approx(0.006)  # nothing seen yet: the model
    for _ in range(100):
        for rows in (1, 4, 8, 16):
            costs.observe_decode(rows, 0.002 + 0.0003 * rows)
    assert costs.decode_pass(1) == pytest.approx(0.0023, rel=0.01)
    assert costs.decode_pass(10) == pytest.approx(0.005, rel=0.01)  # between the counts seen
    assert costs.decode_pass(32) > costs.decode_pass(16)  # beyond them, scaled
    for _ in range(100):
        costs.observe_prefill(100, 1, costs.decode_pass(1) + 100 * 0.00005)
    assert costs.per_prompt_token == pytest.approx(0.00005, rel=0.01)
    assert costs.prompt_tokens_within(costs.decode_pass(1) + 0.005) == pytest.approx(100, abs=1)
    assert costs.prompt_tokens_within(0.0001) == 0
    costs.observe_decode(4, math.nan)  # ignored
    assert costs.decode_pass(10) == pytest.approx(0.005, rel=0.01)


def test_step_costs_stay_bounded_however_the_steps_go():
    """Rows that never change, then a machine stall: the estimates follow, and never run away."""
    costs = StepCosts()
    for _ in range(5000):
        costs.observe_decode(1, 0.002)
    assert costs.decode_pass(1) == pytest.approx(0.002) and costs.decode_pass(2) < 0.01
    costs.observe_decode(1, 30.0)  # the machine stopped for 30 s
    assert costs.decode_pass(1) <= StepCosts.LONGEST_PASS
    for _ in range(60):
        costs.observe_decode(1, 0.002)
    assert costs.decode_pass(1) < 0.003


# --- the scheduler ------------------------------------------------------------------------------

def timed(request_id, clock, deadline, passes=1, heard=True, budget=40, n=6):
    request = Request(request_id, prompt(n, hash(request_id) % 1000), budget=budget)
    request.deadline, request.passes_to_chunk, request.heard = deadline, passes, heard
    return request


def started(scheduler, requests):
    """``requests`` admitted and prefilled (one step each, deadline scheduling off for it)."""
    for request in requests:
        scheduler.add(request)
    saved, scheduler.config = scheduler.config, __import__("dataclasses").replace(scheduler.config,
                                                                               deadline_scheduling=False)
    try:
        while any(r.processed < len(r.prompt) for r in requests):
            run_step(scheduler, scheduler.schedule())
    finally:
        scheduler.config = saved


def test_rows_close_to_running_dry_go_first_where_the_batch_cannot_hold_them_all():
    clock = Clock()
    scheduler, _ = make_scheduler(clock=clock, max_batch_size=2, max_queue_size_tg=8, max_num_steps=1,
                                  deadline_margin_ms=0)
    scheduler.costs = StepCosts(pass_seconds=0.001, per_row=0.0)
    started(scheduler, [timed("far", clock, 5.0), timed("mid", clock, 0.5), timed("near", clock, 0.1)])
    step = scheduler.schedule()
    assert [i.request.request_id for i in step.items] == ["near", "mid"]  # the batch holds two: least slack first
    # A batch that holds them all runs them all: a stream ahead of its listener keeps its lead.
    wide, _ = make_scheduler(clock=clock, max_num_steps=1, deadline_margin_ms=0)
    started(wide, [timed("far", clock, 5.0), timed("mid", clock, 0.5), timed("near", clock, 0.1)])
    assert [i.request.request_id for i in wide.schedule().items] == ["near", "mid", "far"]


def test_a_multi_step_round_ends_where_a_new_streams_first_chunk_is_due():
    clock = Clock()
    scheduler, _ = make_scheduler(clock=clock, max_num_steps=4)
    scheduler.costs = StepCosts(pass_seconds=0.001, per_row=0.0)
    old = timed("old", clock, 3.0, passes=3)
    new = timed("new", clock, 0.1, passes=2, heard=False)
    started(scheduler, [old, new])
    assert scheduler.schedule().num_steps == 2
    # Heard, with slack for a whole round: the round runs its four passes.
    new.heard, new.deadline = True, 3.0
    assert scheduler.schedule().num_steps == 4


def test_a_prefill_step_is_no_longer_than_the_least_slack_allows():
    clock = Clock()
    scheduler, _ = make_scheduler(blocks=512, clock=clock, max_num_steps=1, deadline_margin_ms=0,
                                  max_batch_input_tokens=4096)
    scheduler.costs = StepCosts(pass_seconds=0.002, per_row=0.0, per_prompt_token=0.0001)
    running = timed("running", clock, 0.05, passes=1, budget=100)
    started(scheduler, [running])
    scheduler.add(Request("long", prompt(600, 5000), budget=10))
    # 50 ms of audio, less a pass for the running stream's next chunk and the step's own pass:
    # 46 ms for prompt tokens at 0.1 ms each.
    step = scheduler.schedule()
    assert step.kind == "ce" and [i.request.request_id for i in step.items] == ["long"]
    assert step.items[0].num_tokens == pytest.approx(460, abs=1)
    run_step(scheduler, step)
    # A stream about to run dry: no prefill that could help fits, so it decodes first.
    running.deadline = clock.now + 0.004
    step = scheduler.schedule()
    assert step.kind == "tg" and [i.request.request_id for i in step.items] == ["running"]
    run_step(scheduler, step)
    running.deadline = clock.now + 1.0  # it has caught up: the rest of the prompt goes in
    step = scheduler.schedule()
    assert step.kind == "ce" and step.items[0].num_tokens == 600 - step.items[0].start


def burst_behind_a_heard_row():
    """A heard row decoding, and five prompts of 100 tokens arriving at once behind it."""
    clock = Clock()
    scheduler, _ = make_scheduler(blocks=512, clock=clock, max_num_steps=1, deadline_margin_ms=0,
                                  first_audio_target_ms=100)
    scheduler.costs = StepCosts(pass_seconds=0.002, per_row=0.0, per_prompt_token=0.0001)
    running = timed("running", clock, 0.0, passes=1, budget=400)
    started(scheduler, [running])
    for i in range(5):
        scheduler.add(Request(f"new{i}", prompt(100, 9000 + 200 * i), budget=4, arrival_time=clock.now))
    return clock, scheduler, running


def test_prompts_in_line_wait_for_one_step_that_takes_them_all_until_the_first_audio_target():
    """A burst: the heard row's slack holds two of five prompts. Rather than two now and the rest a
    few at a time, the row decodes (building its lead) until one step takes all five, or until the
    oldest prompt is first_audio_target_ms old, when what fits goes in."""
    clock, scheduler, running = burst_behind_a_heard_row()
    running.deadline = clock.now + 0.025  # 25 ms: its next pass, the step's and 210 prompt tokens
    step = scheduler.schedule()
    assert step.kind == "tg" and [i.request.request_id for i in step.items] == ["running"]
    run_step(scheduler, step)
    running.deadline = clock.now + 0.060  # the row's lead has grown: all five fit
    step = scheduler.schedule()
    assert step.kind == "ce" and len(step.items) == 5
    # The same burst once its oldest prompt has waited out the first-audio target: what fits goes in.
    clock, late, row = burst_behind_a_heard_row()
    clock.now += 0.101
    row.deadline = clock.now + 0.025
    step = late.schedule()
    assert step.kind == "ce" and [i.num_tokens for i in step.items][:2] == [100, 100]
    assert step.input_tokens == pytest.approx(210, abs=1)  # 23 ms less the step's own pass (chunked: a piece of a third)


def test_a_stream_not_heard_yet_does_not_hold_another_prompt_back():
    """Its first audio is as late as the new prompt's would be, and no listener runs dry."""
    clock = Clock()
    scheduler, _ = make_scheduler(blocks=512, clock=clock, max_num_steps=1, deadline_margin_ms=0)
    scheduler.costs = StepCosts(pass_seconds=0.002, per_row=0.0, per_prompt_token=0.0001)
    new = timed("new", clock, -0.5, passes=2, heard=False)  # long past its first-audio target
    started(scheduler, [new])
    scheduler.add(Request("next", prompt(100, 7000), budget=4))
    step = scheduler.schedule()
    assert step.kind == "ce" and step.input_tokens == 100


def test_without_deadlines_or_with_them_off_steps_are_as_before():
    clock = Clock()
    for knobs in ({}, {"deadline_scheduling": False}):
        scheduler, _ = make_scheduler(blocks=512, clock=clock, max_num_steps=4, **knobs)
        plain = Request("plain", prompt(6), budget=20)  # no deadline
        started(scheduler, [plain])
        scheduler.add(Request("next", prompt(300, 9000), budget=4))
        assert scheduler.schedule().input_tokens == 300
    off, _ = make_scheduler(clock=clock, max_num_steps=4, deadline_scheduling=False)
    urgent = timed("urgent", clock, 0.0, passes=1, heard=False)
    started(off, [urgent])
    assert off.schedule().num_steps == 4


def test_the_queue_wait_is_the_oldest_new_requests_not_a_later_piece_of_a_running_stream():
    clock = Clock()
    scheduler, _ = make_scheduler(clock=clock, max_batch_size=1, max_queue_size_tg=1)
    started(scheduler, [Request("running", prompt(4), budget=100)])
    later = Request("running-1", prompt(4, 50))
    later.continuation, later.arrival_time = True, 0.0
    scheduler.add(later)
    clock.now = 5.0
    assert scheduler.queue_wait() == 0.0  # a later piece of an admitted stream waits its turn
    fresh = Request("fresh", prompt(4, 90))
    fresh.arrival_time = 3.0
    scheduler.add(fresh)
    assert scheduler.queue_wait() == pytest.approx(2.0)


@pytest.mark.slow
def test_past_capacity_a_new_request_is_refused_with_a_clear_status_not_queued_forever(tiny_model_dir):
    """One request at a time (max_queue_size_tg=1): while a long one runs, the next waits; once it
    has waited over max_queue_wait_ms, a third gets HTTP 429 (and gRPC RESOURCE_EXHAUSTED) saying the
    server is at capacity, and the waiting one is still served."""
    import threading
    import time

    import httpx
    from audio_pipeline_client import TTSClient, TTSError

    from audio_pipeline.testing.background import BackgroundServer
    from helpers import make_config

    server = BackgroundServer(make_config(tiny_model_dir, "max_batch_size=1", "max_queue_size_tg=1",
                                          "max_queue_wait_ms=200", "sampling.max_tokens_limit=4096"),
                              http_port=0).start()
    try:
        results = {}

        def speak(name, tokens):
            with TTSClient(server.target, timeout=120) as client:
                results[name] = client.synthesize("A long one, please.", max_tokens=tokens, min_tokens=tokens)

        long = threading.Thread(target=speak, args=("long", 2100))
        long.start()
        while not server.engine.core.load[1]:
            time.sleep(0.01)
        waiting = threading.Thread(target=speak, args=("waiting", 70))
        waiting.start()
        while not server.engine.core.load[0]:
            time.sleep(0.01)
        time.sleep(0.3)
        reply = httpx.post(f"{server.http_url}/v1/audio/speech", json={"input": "One more.", "response_format": "pcm"},
                           timeout=60)
        assert reply.status_code == 429 and reply.headers["retry-after"] == "1"
        assert "at capacity" in reply.json()["error"]["message"]
        with TTSClient(server.target, timeout=60, retries=0) as client, pytest.raises(TTSError) as refused:
            client.synthesize("One more.")
        assert "RESOURCE_EXHAUSTED" in str(refused.value.code) and "at capacity" in str(refused.value)
        long.join(120)
        waiting.join(120)
        assert results["waiting"].samples.size and results["long"].samples.size
    finally:
        server.stop()



# --- admission by the rate the streams gain audio ----------------------------------------------

def test_the_pass_rate_is_decode_passes_a_second_of_recent_rounds_idle_time_left_out():
    rate = PassRate()
    assert rate.per_second(0.0) is None  # nothing known
    now = 0.0
    for _ in range(20):  # rounds of 4 passes in 40 ms: 100 passes a second
        now += 0.04
        rate.observe(now, 0.04, 4)
    assert rate.per_second(now) == pytest.approx(100)
    now += 3.0  # idle: no rounds, nothing counted
    for _ in range(10):  # then prefill rounds without decode passes share the time
        now += 0.02
        rate.observe(now, 0.02, 0)
    assert rate.per_second(now) == pytest.approx(100 * 0.8 / 1.0, rel=0.06)  # the window's last second
    assert rate.per_second(now + PassRate.STALE + 1) is None  # a spell long ago says nothing now
    rate.observe(now, math.nan, 3)  # ignored
    rate.observe(now, 0.0, 3)


def gated(clock, pass_seconds, rows=2, **knobs):
    """A scheduler whose engine made decode passes of ``pass_seconds`` for the last second, a
    pass adding 20 ms of audio to a stream, with ``rows`` streams running."""
    scheduler, _ = make_scheduler(blocks=512, clock=clock, **knobs)
    scheduler.audio_per_pass = 0.02
    started(scheduler, [Request(f"running-{i}", prompt(6, 100 * i), budget=200) for i in range(rows)])
    for _ in range(int(1.0 / pass_seconds) + 1):
        clock.now += pass_seconds
        scheduler.pass_rate.observe(clock.now, pass_seconds, 1)
    return scheduler


def admitted(scheduler, request):
    scheduler.add(request)
    output = scheduler.schedule()
    return any(item.request is request for item in output.items)


def test_a_new_stream_waits_while_the_running_ones_would_not_keep_ahead_of_their_listeners():
    """20 ms of audio a pass: passes of 19 ms leave 5 % to spare, under the 10 % asked; passes of
    15 ms leave 33 %. A later piece of a running stream goes in either way; with nothing running,
    or rate_admission off, so does a new one."""
    clock = Clock()
    slow = gated(clock, 0.019, admission_headroom=0.1)
    assert not admitted(slow, Request("new", prompt(6, 900)))
    assert slow.num_waiting == 1 and slow.queue_wait() >= 0
    piece = Request("running-0-1", prompt(6, 950))
    piece.continuation = True
    assert admitted(slow, piece) and slow.num_waiting == 1  # it passes the new one waiting
    assert slow.schedule().num_steps > 1  # rounds stay long while the new one cannot join
    assert admitted(gated(Clock(), 0.015, admission_headroom=0.1), Request("new", prompt(6, 900)))
    assert not admitted(gated(Clock(), 0.015), Request("new", prompt(6, 900)))  # the default asks 1.8x
    assert admitted(gated(Clock(), 0.010), Request("new", prompt(6, 900)))
    assert admitted(gated(Clock(), 0.019, rate_admission=False), Request("new", prompt(6, 900)))
    assert admitted(gated(Clock(), 0.019, rows=0), Request("new", prompt(6, 900)))
    cuda, _ = make_scheduler()
    assert cuda.config.rate_admission  # on the CPU; on CUDA off until measured on a GPU:
    from audio_pipeline.config import PipelineConfig
    assert not SchedulerConfig.from_config(PipelineConfig().for_device("cuda")).rate_admission
    unknown, _ = make_scheduler(blocks=512, clock=Clock())  # no audio_per_pass: nothing held back
    started(unknown, [Request("running", prompt(6), budget=200)])
    for _ in range(60):
        unknown.pass_rate.observe(unknown.clock(), 0.05, 1)
    assert admitted(unknown, Request("new", prompt(6, 900)))


def test_the_streams_beyond_a_batch_take_turns_and_that_counts():
    """Passes of 10 ms give a stream 2x real time while every row is in every pass; with 4 rows
    running in batches of 4, another row would be in 4 of every 5 passes (about 1.5x: admitted at
    a 10 % headroom); in batches of 2, in 2 of every 5 (0.8x: held back)."""
    assert admitted(gated(Clock(), 0.010, rows=4, max_batch_size=4, max_queue_size_tg=8, admission_headroom=0.1),
                    Request("new", prompt(6, 900)))
    assert not admitted(gated(Clock(), 0.010, rows=4, max_batch_size=2, max_queue_size_tg=8, admission_headroom=0.1),
                        Request("new", prompt(6, 900)))


def test_after_a_pause_a_burst_is_admitted_whatever_the_last_busy_spell_ran_at():
    """The rate of a busy spell that ended (nothing running) is forgotten at the next admission:
    the streams of a burst all go in together, as before any rate was known."""
    clock = Clock()
    scheduler = gated(clock, 0.019, rows=1)
    (running,) = scheduler.running
    scheduler.finish(running, StopReason.CANCELLED)
    burst = [Request(f"burst-{i}", prompt(6, 300 + 10 * i)) for i in range(4)]
    for request in burst:
        scheduler.add(request)
    output = scheduler.schedule()
    assert {item.request.request_id for item in output.items} == {r.request_id for r in burst}
