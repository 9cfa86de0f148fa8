"""The batched sampler: per-request settings and generators, the frame-slot constraint, penalties."""

import pytest
import torch

from audio_pipeline.core.request import TTSContext

from audio_pipeline.core.stop import StopReason
from audio_pipeline.errors import InvalidArgument
from audio_pipeline.layouts.orpheus import MIN_VOCAB_SIZE, OrpheusLayout
from audio_pipeline.core.sampler import candidate_width, sample_next_tokens
from audio_pipeline.core.sampling_params import SamplingParams

LAYOUT = OrpheusLayout()


def context(name="r", **sampling) -> TTSContext:
    return TTSContext(request_id=name, prompt_ids=[1, 2, 3], sampling=SamplingParams(**sampling), layout=LAYOUT)


def logits(batch, seed=0):
    return torch.randn(batch, MIN_VOCAB_SIZE, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_picks_the_best_allowed_id_of_the_frame_slot():
    contexts = [context(f"r{i}", temperature=0.0, repetition_penalty=1.0) for i in range(3)]
    for i, c in enumerate(contexts):
        for _ in range(i):  # three different frame positions
            c.append_token(LAYOUT.token_range(len(c.generated))[0])
    scores = logits(3)
    tokens = sample_next_tokens(scores, contexts)
    for c, row, token in zip(contexts, scores, tokens):
        start, end = LAYOUT.token_range(len(c.generated))
        assert token == start + int(row[start:end].argmax())


def test_every_sampled_token_is_valid_for_its_slot_even_with_wild_logits():
    c = context(temperature=2.0, top_p=1.0, seed=3)
    for step in range(70):
        token = sample_next_tokens(logits(1, seed=step) * 10, [c])[0]
        stop = c.append_token(token)
        if stop:
            break
        assert LAYOUT.is_valid_token(c.generated[-1], len(c.generated) - 1)
    # These draws never stop it: ten whole frames, every code in its own slot (tokens_to_codes
    # raises on a token of another slot).
    assert not stop and len(c.generated) == 10 * LAYOUT.tokens_per_frame
    assert LAYOUT.tokens_to_codes(c.generated).numel() == len(c.generated)


def test_end_of_speech_only_on_frame_boundaries_and_after_min_tokens():
    scores = logits(1)
    scores[0, LAYOUT.end_of_speech] = 1e6  # the model wants to stop at once
    c = context(temperature=0.0, min_tokens=14)
    assert [c.append_token(sample_next_tokens(scores, [c])[0]) for _ in range(14)] == [None] * 14
    assert len(c.generated) == 14
    assert c.append_token(sample_next_tokens(scores, [c])[0]) == StopReason.END_OF_SPEECH


def test_a_requests_tokens_do_not_depend_on_its_batch_mates():
    def first_row(mates):
        target = context("a", temperature=1.0, top_k=50, seed=100)
        others = [context(f"m{i}", temperature=0.3, seed=i) for i in range(mates)]
        tokens = []
        for step in range(5):
            rows = torch.cat([logits(1, seed=step), logits(mates, seed=1000 + step)])
            tokens.append(sample_next_tokens(rows, [target, *others])[0])
        return tokens

    # Alone or with three others, the request draws the same tokens (and not one fixed choice).
    assert first_row(0) == first_row(3)
    assert len(set(first_row(0))) > 1


def test_top_k_one_and_tiny_top_p_are_greedy():
    scores = logits(2)
    greedy = sample_next_tokens(scores, [context("g", temperature=0.0, repetition_penalty=1.0)])[0]
    assert sample_next_tokens(scores[:1], [context("k", temperature=1.0, top_k=1, repetition_penalty=1.0, seed=1)]) \
        == [greedy]
    assert sample_next_tokens(scores[:1], [context("p", temperature=1.0, top_p=1e-6, repetition_penalty=1.0,
                                                   seed=2)]) == [greedy]


def test_min_p_drops_unlikely_candidates():
    start, end = LAYOUT.token_range(0)
    scores = torch.full((1, MIN_VOCAB_SIZE), -1e9)
    scores[0, start] = 5.0
    scores[0, start + 1] = 5.0 - 2.0  # probability ratio e^-2 ~ 0.135
    picks = {sample_next_tokens(scores, [context("m", temperature=1.0, top_p=1.0, min_p=0.2, seed=s,
                                                 repetition_penalty=1.0)])[0] for s in range(40)}
    assert picks == {start}
    picks = {sample_next_tokens(scores, [context("m", temperature=1.0, top_p=1.0, min_p=0.05, seed=s,
                                                 repetition_penalty=1.0)])[0] for s in range(40)}
    assert picks == {start, start + 1}


@pytest.mark.parametrize("penalty", [dict(repetition_penalty=100.0), dict(frequency_penalty=2.0),
                                     dict(presence_penalty=2.0)])
def test_penalties_push_away_from_codes_already_generated_in_that_slot(penalty):
    start, _ = LAYOUT.token_range(0)
    scores = torch.full((1, MIN_VOCAB_SIZE), -1.0)
    scores[0, start] = 1.0
    scores[0, start + 1] = 0.5
    c = context(temperature=0.0, **{"repetition_penalty": 1.0, **penalty})
    c.generated = []
    c.append_token(start)  # code 0 in slot 0
    for _ in range(6):
        c.append_token(LAYOUT.token_range(len(c.generated))[0])
    # Slot 0 again: code 0 was used there before, so the penalty moves the choice to code 1.
    assert sample_next_tokens(scores, [c])[0] == start + 1


def test_candidate_width_pads_requests_with_fewer_stop_ids():
    contexts = [context(f"r{i}", stop_token_ids=(128009,) if i else ()) for i in range(3)]
    width = candidate_width(contexts)
    assert width == LAYOUT.codebook_size + 2
    ids = torch.stack([c.candidate_ids(width) for c in contexts])
    assert (ids[0, -1] == LAYOUT.end_of_speech) and not contexts[0].candidate_mask(width)[-1]


def test_invalid_values_name_the_field():
    with pytest.raises(InvalidArgument, match="sampling.top_p"):
        SamplingParams().with_overrides(max_tokens_limit=100, tokens_per_frame=7, top_p=0.0)
    with pytest.raises(InvalidArgument, match="sampling.stop_token_ids"):
        SamplingParams().with_overrides(max_tokens_limit=2000, tokens_per_frame=7, stop_token_ids=[-1])


def test_candidate_batch_equals_each_contexts_own_candidates():
    """The batched candidate builder gives every row exactly its context's candidate ids and mask:
    frame slots, stop ids of different counts (padded), min_tokens, and rows that may stop."""
    from audio_pipeline.core.sampler import SamplingRows

    contexts = [context("a"), context("b", stop_token_ids=(5, 6)), context("c", min_tokens=14)]
    for i, c in enumerate(contexts):
        for _ in range(i * 7 + (3 if i == 1 else 0)):
            c.append_token(LAYOUT.token_range(len(c.generated))[0] + 1)
    rows = SamplingRows.build(contexts, draw=False)
    width = candidate_width(contexts)
    allowed = torch.from_numpy(~rows.blocked)
    assert torch.equal(torch.from_numpy(rows.candidate_ids()), torch.stack([c.candidate_ids(width) for c in contexts]))
    assert torch.equal(allowed, torch.stack([c.candidate_mask(width) for c in contexts]))
    assert allowed[:, LAYOUT.codebook_size:].any(), "some row may stop here"


@pytest.mark.parametrize("spread", [10.0, 0.5])
def test_the_nucleus_over_the_best_candidates_picks_what_the_whole_row_picks(spread):
    """Top-p / top-k / min-p over a top-64 prefix is exact: where the kept set fits the prefix the
    draw equals the full-sort rule's; where it might not (flat rows) the prefix declines."""
    from audio_pipeline.core.sampler import _sample_nucleus

    generator = torch.Generator().manual_seed(11)
    rows, width = 24, 1025
    scores = torch.randn(rows, width, generator=generator) * spread
    scores[:, -3:] = float("-inf")  # masked stop columns
    top_k = [width if i % 3 else 16 for i in range(rows)]
    min_p = torch.tensor([[0.0 if i % 2 else 0.05] for i in range(rows)])
    top_p = torch.full((rows, 1), 0.9)
    uniform = torch.rand(rows, generator=generator)
    full = _sample_nucleus(scores, top_k, min_p, top_p, uniform, width)
    prefix = _sample_nucleus(scores, top_k, min_p, top_p, uniform, 64)
    if spread > 1:
        assert prefix is not None and torch.equal(prefix, full)
    else:
        assert prefix is None  # a flat row's nucleus reaches past 64 candidates


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_non_finite_logits_still_give_an_allowed_token_and_spare_the_batch(bad, temperature):
    """A row of NaN or infinite logits (an overflow, a broken model) gets one of its allowed ids;
    the other rows of the batch are sampled as if it were not there."""
    contexts = [context(f"r{i}", temperature=temperature, seed=i) for i in range(3)]
    scores = logits(3)
    alone = sample_next_tokens(scores[1:].clone(), [context(f"r{i}", temperature=temperature, seed=i)
                                                    for i in (1, 2)])
    scores[0] = bad
    tokens = sample_next_tokens(scores, contexts)
    start, end = LAYOUT.token_range(0)
    assert start <= tokens[0] < end  # an id of the first frame slot; never a stop or another slot's id
    assert tokens[1:] == alone


def test_a_requests_draws_come_in_blocks_that_equal_single_draws():
    """TTSContext.uniforms draws ahead in blocks; what it hands out, in any pattern of counts (the
    backbone takes one a step, a depth decoder several), is the same stream one draw at a time
    from a generator of the same seed gives."""
    from audio_pipeline.core.request import UNIFORM_BLOCK, TTSContext
    from audio_pipeline.layouts.orpheus import OrpheusLayout
    from audio_pipeline.core.sampling_params import SamplingParams

    context = TTSContext(request_id="r", prompt_ids=[1], layout=OrpheusLayout(),
                         sampling=SamplingParams(seed=42, temperature=0.8))
    counts = [1, 3, 1, 1, UNIFORM_BLOCK + 5, 7, 1] * 3
    handed = [value for count in counts for value in context.uniforms(count)]
    reference = torch.Generator().manual_seed(42)
    single = [torch.rand(1, generator=reference).item() for _ in handed]
    assert handed == single
