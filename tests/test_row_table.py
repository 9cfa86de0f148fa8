"""The row table (core/row_table.py): a step's sampling rows gathered from slots written once per
request are exactly the rows built from the requests one by one (SamplingRows.build), on mixed
batches, as requests come and go and slots are reused; and the same draws from each request's
generator."""

import numpy as np
import pytest

from audio_pipeline.core.request import TTSContext
from audio_pipeline.core.row_table import RowTable
from audio_pipeline.core.sampler import SamplingRows
from audio_pipeline.core.sampling_params import SamplingParams
from audio_pipeline.layouts.orpheus import OrpheusLayout
from audio_pipeline.layouts.phoneme_lpc import Alignment, PhonemeLPCLayout, TOKENS_PER_FRAME

ORPHEUS = OrpheusLayout()
LPC = PhonemeLPCLayout()

SETTINGS = [
    {},
    {"temperature": 0.0},
    {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "seed": 1},
    {"temperature": 1.1, "min_p": 0.05, "repetition_penalty": 1.3, "seed": 2},
    {"stop_token_ids": (5, 6), "frequency_penalty": 0.2, "seed": 3},
    {"min_tokens": 21, "presence_penalty": 0.4, "top_k": 4000, "seed": 4},
    {"stop_token_ids": (9,), "temperature": 0.0, "min_tokens": 14},
]


def fields(rows: SamplingRows) -> dict:
    return {name: getattr(rows, name) for name in ("starts", "extra_ids", "blocked", "floats", "top_k",
                                                    "frame_slots", "any_sampling", "penalized",
                                                    "prefix_suffices", "prefix_may_suffice")}


def assert_same(table_rows: SamplingRows, built: SamplingRows) -> None:
    got, want = fields(table_rows), fields(built)
    for name, value in want.items():
        if isinstance(value, np.ndarray):
            assert got[name].dtype == value.dtype and np.array_equal(got[name], value), name
        else:
            assert got[name] == value, name


def twin(context: TTSContext) -> TTSContext:
    """The same request again, its generator at the same point (for the draws)."""
    copy = TTSContext(request_id=context.request_id, prompt_ids=list(context.prompt_ids), sampling=context.sampling,
                      layout=context.layout, alignment=context.alignment)
    copy.generated = list(context.generated)
    copy.generator.set_state(context.generator.get_state())
    copy._uniforms, copy._uniform_next = list(context._uniforms), context._uniform_next
    return copy


def orpheus_request(index: int, generated: int) -> TTSContext:
    context = TTSContext(request_id=f"r{index}", prompt_ids=[1, 2, 3],
                         sampling=SamplingParams(**SETTINGS[index % len(SETTINGS)]), layout=ORPHEUS)
    for _ in range(generated):
        context.append_token(ORPHEUS.token_range(len(context.generated))[0] + 1)
    return context


def test_sampling_rows_from_the_table_equal_those_built_request_by_request():
    table = RowTable(ORPHEUS, capacity=2)  # grows as requests come
    requests = [orpheus_request(i, generated=(i * 5) % 29) for i in range(23)]
    twins = {r.request_id: twin(r) for r in requests}  # drawing one at a time from the same generators
    for step in range(6):
        live = [r for i, r in enumerate(requests) if (i + step) % 4]  # rows come and go between steps
        positions = [len(r.generated) + step for r in live]
        built = SamplingRows.build([twins[r.request_id] for r in live], positions=positions)
        assert_same(table.sampling_rows(live, positions), built)
        for i, request in enumerate(requests):
            if (i + step) % 4 == 0:
                table.release(request.request_id)  # its slot is free for another
    assert built.any_sampling and built.penalized
    assert (~built.blocked[:, ORPHEUS.codebook_size:]).any(), "some row may stop"


def test_a_request_id_that_names_a_new_request_gets_its_own_settings():
    table = RowTable(ORPHEUS)
    first = orpheus_request(2, 7)
    table.sampling_rows([first], [7], draw=False)
    again = TTSContext(request_id=first.request_id, prompt_ids=[1], layout=ORPHEUS,
                       sampling=SamplingParams(temperature=0.0, stop_token_ids=(5, 6, 7)))
    rows = table.sampling_rows([again], [7], draw=False)
    assert_same(rows, SamplingRows.build([again], positions=[7], draw=False))
    assert len(table) == 1


def test_forced_rows_of_an_aligned_layout_allow_their_forced_id_alone():
    frames = [(LPC.token_range(0)[0] + i, LPC.token_range(1)[0] + i) for i in range(6)]
    requests = [TTSContext(request_id=f"a{i}", prompt_ids=[1, 2], layout=LPC, alignment=Alignment(frames),
                           sampling=SamplingParams(**SETTINGS[i % len(SETTINGS)])) for i in range(5)]
    positions = [0, 1, 2, 3, TOKENS_PER_FRAME * len(frames)]  # forced, forced, chosen, chosen, the end
    table = RowTable(LPC)
    rows = table.sampling_rows(requests, positions, draw=False)
    assert_same(rows, SamplingRows.build(requests, positions=positions, draw=False))
    assert (~rows.blocked[0]).sum() == 1 and (~rows.blocked[2]).sum() > 1


def test_a_full_table_grows_and_keeps_every_slot():
    table = RowTable(ORPHEUS, capacity=1)
    requests = [orpheus_request(i, 3) for i in range(9)]
    slots = table.slots(requests)
    assert sorted(slots.tolist()) == list(range(9)) and len(table) == 9
    wider = TTSContext(request_id="wide", prompt_ids=[1], layout=ORPHEUS,
                       sampling=SamplingParams(stop_token_ids=tuple(range(5, 12))))
    rows = table.sampling_rows([*requests, wider], [3] * 9 + [0], draw=False)
    assert_same(rows, SamplingRows.build([*requests, wider], positions=[3] * 9 + [0], draw=False))


@pytest.mark.parametrize("seed", [0, 7])
def test_a_seeded_request_draws_the_same_numbers_through_the_table(seed):
    table = RowTable(ORPHEUS)
    alone = TTSContext(request_id="s", prompt_ids=[1], layout=ORPHEUS, sampling=SamplingParams(seed=seed))
    same = twin(alone)
    other = orpheus_request(3, 0)
    draws = [table.sampling_rows([other, alone], [i, i]).floats[-1, 1] for i in range(70)]
    assert draws == [SamplingRows.build([same], positions=[i]).floats[-1, 0] for i in range(70)]


def test_a_sample_is_plain_only_where_appending_it_neither_stops_nor_fails():
    """RowTable.plain_samples (every row of a step at once) calls a sample plain only where the
    request's append_sample, one by one, would append it and go on: a code of its position's
    codebook, no stop id where the speech may end, not the budget's last token. And the usual
    sample (a valid code mid-speech) is plain."""
    rng = np.random.default_rng(0)
    table = RowTable(ORPHEUS)
    requests = [orpheus_request(i, generated=int(rng.integers(0, 40))) for i in range(40)]
    slots = table.slots(requests)
    positions = np.array([len(r.generated) for r in requests], dtype=np.int64)
    for trial in range(30):
        ids = []
        for request, position in zip(requests, positions.tolist()):
            start = ORPHEUS.token_range(position)[0]
            kind = rng.integers(0, 5)
            ids.append({0: start + int(rng.integers(0, ORPHEUS.codebook_size)), 1: start - 1 - int(rng.integers(0, 9)),
                        2: ORPHEUS.end_of_speech, 3: int(rng.choice(request.stop_ids)),
                        4: start + ORPHEUS.codebook_size}[int(kind)])
        plain = table.plain_samples(slots, positions, np.array(ids, dtype=np.int64))
        for request, token, is_plain in zip(requests, ids, plain.tolist()):
            probe = twin(request)
            try:
                outcome = probe.append_sample(token)
            except ValueError:
                outcome = "refused"
            if is_plain:
                assert outcome is None and probe.generated[-1] == token
            elif ORPHEUS.token_range(len(request.generated))[0] <= token < ORPHEUS.token_range(len(request.generated))[1] \
                    and token not in request.stop_ids and len(request.generated) + 1 < request.token_budget:
                pytest.fail(f"a valid code mid-speech was not plain: {token} at {len(request.generated)}")
    budget_end = TTSContext(request_id="end", prompt_ids=[1], layout=ORPHEUS, sampling=SamplingParams(max_tokens=14))
    budget_end.generated = [ORPHEUS.token_range(i)[0] for i in range(13)]
    slot = table.slots([budget_end])
    assert not table.plain_samples(slot, np.array([13]), np.array([ORPHEUS.token_range(13)[0]]))[0]
