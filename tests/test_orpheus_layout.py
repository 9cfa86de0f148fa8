"""Orpheus token layout, and the sampler that can only produce whole, valid frames."""

import pytest
import torch

from audio_pipeline.core.request import TTSContext

from audio_pipeline.core.stop import StopReason
from audio_pipeline.errors import InvalidArgument
from audio_pipeline.layouts import orpheus
from audio_pipeline.core.sampler import sample_next_tokens
from audio_pipeline.core.sampling_params import SamplingParams

LAYOUT = orpheus.OrpheusLayout()
VOCAB = orpheus.MIN_VOCAB_SIZE + 2


def test_prompt_format():
    assert LAYOUT.prompt_ids([1, 2]) == [128259, 1, 2, 128009, 128260, 128261, 128257]
    assert LAYOUT.prompt_text("Hi.", "tara") == "tara: Hi."


def test_token_ids_and_codes_round_trip_per_frame_position():
    codes = list(range(0, 4096, 300))[:14]
    tokens = LAYOUT.codes_to_tokens(codes)
    assert tokens[0] == 128266 + codes[0] and tokens[1] == 128266 + 4096 + codes[1]
    assert tokens[7] == 128266 + codes[7]
    assert LAYOUT.tokens_to_codes(tokens).tolist() == codes
    # From a later frame position (a decoder window starts on a frame, its context may not).
    assert LAYOUT.tokens_to_codes(tokens[3:], first_position=3).tolist() == codes[3:]


def test_a_token_in_the_wrong_slot_is_rejected_not_phase_shifted():
    token_for_slot_1 = LAYOUT.codes_to_tokens([5], first_position=1)[0]
    with pytest.raises(ValueError, match="frame position 0"):
        LAYOUT.token_to_code(token_for_slot_1, 0)
    window = LAYOUT.codes_to_tokens([1, 2, 3, 4, 5, 6, 7, 8, 9])
    window[8] = window[7]  # slot 1 holds slot 0's token: the first bad one is named
    with pytest.raises(ValueError, match=f"token {window[7]} is not a speech token for frame position 1"):
        LAYOUT.tokens_to_codes(window)
    with pytest.raises(ValueError, match="frame position 3"):
        LAYOUT.tokens_to_codes([0], first_position=10)


def make_context(**sampling):
    return TTSContext("r", [1, 2, 3], SamplingParams(**sampling), LAYOUT)


def test_sampling_only_produces_valid_frames_even_from_adversarial_logits():
    context = make_context(temperature=1.0, seed=1, max_tokens=70, min_tokens=70, repetition_penalty=1.0)
    logits = torch.zeros(1, VOCAB)
    logits[0, :128266] = 50.0  # the model prefers text ids; they must never come out
    while not (stop := context.append_token(sample_next_tokens(logits, [context])[0])):
        pass
    assert stop == StopReason.MAX_TOKENS and len(context.generated) == 70
    LAYOUT.tokens_to_codes(context.generated)  # raises on any slot mismatch


def test_end_of_speech_only_on_frame_boundaries_and_after_min_tokens():
    logits = torch.zeros(1, VOCAB)
    logits[0, orpheus.END_OF_SPEECH] = 100.0
    context = make_context(temperature=0.0, min_tokens=10, max_tokens=70)
    while not (stop := context.append_token(sample_next_tokens(logits, [context])[0])):
        pass
    assert stop == StopReason.END_OF_SPEECH and len(context.generated) == 14


def test_max_tokens_rounds_down_to_whole_frames():
    context = make_context(temperature=0.0, max_tokens=20)
    while not context.append_token(sample_next_tokens(torch.zeros(1, VOCAB), [context])[0]):
        pass
    assert len(context.generated) == 14


def test_same_seed_same_tokens_whatever_the_batch():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    alone = make_context(temperature=1.0, seed=42)
    batched = [make_context(temperature=1.0, seed=s) for s in (7, 42, 9)]
    for _ in range(21):
        alone.append_token(sample_next_tokens(logits[1:2], [alone])[0])
        for c, t in zip(batched, sample_next_tokens(logits, batched)):
            c.append_token(t)
    assert alone.generated == batched[1].generated


@pytest.mark.parametrize("field, value", [("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("top_k", 0),
                                          ("repetition_penalty", 0.0), ("max_tokens", 3), ("max_tokens", 10**6),
                                          ("min_tokens", 5000), ("min_tokens", -1)])
def test_invalid_sampling_values_name_the_field(field, value):
    with pytest.raises(InvalidArgument, match=f"sampling.{field}"):
        SamplingParams().with_overrides(max_tokens_limit=4096, tokens_per_frame=7, **{field: value})
