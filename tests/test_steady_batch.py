"""The persistent decode batch (core/steady_batch.py) schedules exactly what the scheduler schedules
row by row: two schedulers alike, one keeping the batch from pass to pass and one not, run the same
random traffic (arrivals, prompts sharing prefixes, stops, cancellations, a cache small enough to
preempt, each pass launched before the one before it is applied) and make the same passes, item
for item, with the same results, ends and KV blocks; and the batch does hold most passes."""

from __future__ import annotations

import random

import pytest

from audio_pipeline.core.scheduler import StepResult
from audio_pipeline.core.steady_batch import SteadyItems
from audio_pipeline.core.stop import StopReason
from scheduler_harness import Clock, Request, make_scheduler, prompt


def sample_of(item) -> int:
    """What the runner samples for an item: a function of the request and the position alone, so
    both schedulers see the same ids whenever they launch the same item."""
    return 1000 + item.start + item.num_tokens


def result_of(items) -> StepResult:
    """The runner's result for ``items``, read when it is applied; where every item sampled one id,
    each marked plain or not as the runner checks them (no stop, within the budget), as a token
    layout's decode pass is: the update appends plain samples without asking the request."""
    tokens = [[sample_of(item)] if item.sample else [] for item in items]
    if not items or not all(item.sample and item.num_tokens == 1 for item in items):
        return StepResult(items, tokens)
    plain = [token[0] != item.request.stop_id and len(item.request.generated) + 1 < item.request.budget
             for item, token in zip(items, tokens)]
    return StepResult(items, tokens, plain=plain, ids=[token[0] for token in tokens])


def traffic(seed: int, count: int):
    """``count`` requests: when each arrives (a pass index), its prompt, budget, and where it stops."""
    rng = random.Random(seed)
    out = []
    for index in range(count):
        length = rng.randint(3, 14)
        base = 0 if rng.random() < 0.3 else 100 * (index + 1)  # some share a prefix
        budget = rng.randint(4, 40)
        stop_at = rng.randint(2, budget + 4)  # past the budget: it ends by max tokens
        out.append((rng.randint(0, 60), f"r{index}", prompt(length, base), budget, stop_at))
    return out


def mark_deadlines(scheduler, clock, index: int) -> None:
    """The engine's part under deadline scheduling: each running request's deadline, whether it
    has been heard and the passes to its next chunk, from what it generated (the same in both runs)."""
    clock.now = 0.01 * index
    for request in scheduler.running:
        made = len(request.generated)
        request.passes_to_chunk = (7 - made % 7) % 7
        request.heard = made > 5
        request.deadline = None if made % 11 == 0 else clock.now + 0.02 * ((made * 13) % 9)


def run(seed: int, steady: bool, *, blocks: int, knobs: dict, passes: int = 400):
    clock = Clock()
    knobs = {"max_batch_size": 8, **knobs}
    scheduler, manager = make_scheduler(blocks=blocks, block_size=4, max_batch_input_tokens=48, clock=clock,
                                        **knobs)
    scheduler.steady_batches = steady
    arrivals = traffic(seed, 14)
    requests: dict[str, Request] = {}
    rng = random.Random(seed + 1)
    log, ends, pending, held = [], [], [], 0
    for index in range(passes):
        for arrival, request_id, tokens, budget, stop_at in arrivals:
            if arrival == index:
                request = Request(request_id, tokens, budget=budget)
                # the id sampled at the position after the stop position: it ends there
                request.stop_id = 1000 + len(tokens) + stop_at
                requests[request_id] = request
                scheduler.add(request)
        running = sorted(r.request_id for r in scheduler.running if not r.is_done)
        if running and rng.random() < 0.04:  # the same choice in both runs: the same running set
            victim = requests[rng.choice(running)]
            ends += [(index, f.request.request_id, f.reason) for f in scheduler.finish(victim, StopReason.CANCELLED)]
        if knobs.get("deadline_scheduling"):
            mark_deadlines(scheduler, clock, index)
        due = len(pending)  # the passes launched before this round: applied once it has launched
        output = scheduler.schedule()
        held += type(output.items) is SteadyItems
        ends += [(index, f.request.request_id, f.reason) for f in output.finished]
        for steps_index, items in enumerate(output.steps):
            launched = [item for item in items if not item.request.is_done]
            # (in order of slack under deadlines, which the batch keeps as it was when it formed)
            log.append((index, output.kind, sorted((i.request.request_id, i.start, i.num_tokens, i.sample)
                                                   for i in launched)))
            pending.append((output, launched, steps_index == output.num_steps - 1))
        for _ in range(due):  # the overlap: the previous round is applied after this one launched
            done, launched, last = pending.pop(0)
            finished = scheduler.update(done, result_of(launched), last=last)
            ends += [(index, f.request.request_id, f.reason) for f in finished]
        if index > 80 and not scheduler.num_running and not scheduler.num_waiting and not pending:
            break
    while pending:
        done, launched, last = pending.pop(0)
        ends += [(passes, f.request.request_id, f.reason) for f in scheduler.update(done, result_of(launched), last=last)]
    assert not scheduler.num_running and not scheduler.num_waiting, "every request ended"
    generated = {request_id: (list(request.generated), request.processed) for request_id, request in requests.items()}
    return log, ends, generated, manager.num_free_blocks, scheduler.num_preemptions, held


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("knobs,blocks", [
    (dict(enable_in_flight_batching=True, max_num_steps=1, deadline_scheduling=False), 200),
    (dict(enable_in_flight_batching=True, max_num_steps=1, deadline_scheduling=False), 20),  # preempts
    (dict(enable_in_flight_batching=False, max_num_steps=1, deadline_scheduling=False), 200),
    (dict(enable_in_flight_batching=False, max_num_steps=-1, deadline_scheduling=False), 20),  # multi-step
    (dict(enable_in_flight_batching=False, max_num_steps=-1, deadline_scheduling=True), 200),  # rounds end at chunks
    (dict(enable_in_flight_batching=True, max_num_steps=1, deadline_scheduling=True), 20),
    # requests wait while as many run as may: the batch holds, its rounds one pass long
    (dict(enable_in_flight_batching=False, max_num_steps=-1, deadline_scheduling=True, max_batch_size=3), 200),
    (dict(enable_in_flight_batching=True, max_num_steps=1, deadline_scheduling=False, max_batch_size=3), 20),
])
def test_the_persistent_batch_schedules_what_the_scheduler_schedules_row_by_row(seed, knobs, blocks):
    plain = run(seed, False, blocks=blocks, knobs=knobs)
    steady = run(seed, True, blocks=blocks, knobs=knobs)
    for one, other in zip(plain[0], steady[0]):
        assert one == other
    assert len(plain[0]) == len(steady[0])
    # (requests ending in the same update: in the order of their rows, which slack may have changed)
    assert sorted(plain[1], key=lambda end: end[:2]) == sorted(steady[1], key=lambda end: end[:2])
    assert plain[2:5] == steady[2:5]
    assert plain[5] == 0
    rounds = len({index for index, _, _ in steady[0]})
    assert steady[5] > rounds // 4, "the batch held many of the rounds"
    if blocks == 40 and seed == 0:
        assert plain[4] > 0, "the small cache preempted"


def test_a_request_cancelled_while_the_batch_holds_it_leaves_with_its_last_pass():
    scheduler, manager = make_scheduler(blocks=64, block_size=4, enable_in_flight_batching=True, max_num_steps=1,
                                        deadline_scheduling=False)
    requests = [Request(f"r{i}", prompt(5, 10 * i), budget=30) for i in range(3)]
    for request in requests:
        scheduler.add(request)
    pending = []
    for _ in range(6):  # prefill, then passes the batch holds
        output = scheduler.schedule()
        pending.append((output, StepResult(list(output.items), [[sample_of(i)] for i in output.items])))
        if len(pending) > 1:
            scheduler.update(*pending.pop(0))
    assert type(output.items) is SteadyItems
    assert scheduler.finish(requests[1], StopReason.CANCELLED) == []  # a pass of it is in flight
    output = scheduler.schedule()
    assert [item.request.request_id for item in output.items] == ["r0", "r2"]
    finished = scheduler.update(*pending.pop(0))
    assert [(f.request.request_id, f.reason) for f in finished] == [("r1", StopReason.CANCELLED)]
    assert "r1" not in scheduler and len(requests[1].generated) == 5  # its pass in flight is dropped
    free = manager.num_free_blocks
    scheduler.update(output, StepResult(list(output.items), [[sample_of(i)] for i in output.items]))
    assert manager.num_free_blocks == free
