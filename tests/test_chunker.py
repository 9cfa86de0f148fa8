"""The chunk_size / buffer rules of ../shared/design/streaming.md, step by step."""

import pytest

from audio_pipeline.decoders.chunker import ChunkSchedule, DecodeWindow


def run(schedule, total, step=1):
    """Simulates a stream generating ``step`` tokens at a time; returns every window in order."""
    windows, decoded, chunk, generated = [], 0, 0, 0
    while True:
        generated = min(total, generated + step)
        finished = generated == total
        while (window := schedule.next_window(generated, decoded, chunk, finished)) is not None:
            windows.append((generated, window))
            decoded, chunk = window.end, chunk + 1
        if finished:
            return windows


def test_no_streaming_decodes_everything_once_at_the_end():
    windows = run(ChunkSchedule(None), 70)
    assert [w for _, w in windows] == [DecodeWindow(0, 70, 0, 0, True)]


def test_chunks_follow_the_schedule_and_repeat_its_last_entry():
    windows = run(ChunkSchedule([7, 14, 28]), 100)
    assert [(w.start, w.end) for _, w in windows] == [(0, 7), (7, 21), (21, 49), (49, 77), (77, 100)]
    # Each chunk is decoded as soon as its tokens exist, not later.
    assert [g for g, _ in windows][:4] == [7, 21, 49, 77]
    assert [w.final for _, w in windows] == [False] * 4 + [True]


def test_a_remainder_that_fills_a_chunk_exactly_is_the_final_chunk():
    windows = run(ChunkSchedule([14]), 28)
    assert [(w.start, w.end, w.final) for _, w in windows] == [(0, 14, False), (14, 28, True)]


def test_buffer_adds_left_context_capped_by_what_was_decoded():
    windows = [w for _, w in run(ChunkSchedule([7, 14], buffer=21), 56)]
    # eff = min(buffer, decoded_index); input = tokens[decoded_index - eff : end]
    assert [(w.start, w.end, w.context_tokens) for w in windows] == [(0, 7, 0), (0, 21, 7), (0, 35, 21), (14, 49, 21),
                                                                      (28, 56, 21)]
    assert all(w.new_tokens == w.end - w.start - w.context_tokens for w in windows)


def test_every_generated_token_is_decoded_exactly_once():
    for chunk_size, buffer, step in (([28, 56, 112], 7, 3), ([7], 0, 7), (None, 14, 5), ([21], 70, 13)):
        windows = [w for _, w in run(ChunkSchedule(chunk_size, buffer), 301, step)]
        covered = [i for w in windows for i in range(w.start + w.context_tokens, w.end)]
        assert covered == list(range(301))
        assert windows[-1].final and not any(w.final for w in windows[:-1])


@pytest.mark.parametrize("chunk_size, buffer", [([], 0), ([0], 0), ([7], -7)])
def test_bad_settings_are_rejected(chunk_size, buffer):
    with pytest.raises(ValueError):
        ChunkSchedule(chunk_size, buffer)


# --- block_causal and the prompt prepend modes ----------------------------------------------------

def windows_of(total=56, step=7, **settings):
    return [w for _, w in run(ChunkSchedule(**settings), total, step)]


def test_block_causal_gets_no_generated_context_whatever_the_buffer():
    windows = windows_of(chunk_size=[7, 14], buffer=21, block_causal=True)
    assert [(w.start, w.end, w.context_tokens) for w in windows] == [(0, 7, 0), (7, 21, 0), (21, 35, 0), (35, 49, 0),
                                                                      (49, 56, 0)]


def test_never_prepends_no_prompt_tokens():
    for mode in ("never", "NEVER"):
        windows = windows_of(chunk_size=[14], buffer=7, prepend=mode, prompt_tokens=35)
        assert all(w.prompt_tokens == 0 for w in windows)


def test_once_prepends_the_whole_prompt_to_the_first_chunk_only():
    windows = windows_of(chunk_size=[14], buffer=7, prepend="once", prompt_tokens=35)
    assert [w.prompt_tokens for w in windows] == [35, 0, 0, 0]
    assert [(w.start, w.context_tokens) for w in windows] == [(0, 0), (7, 7), (21, 7), (35, 7)]


def test_rolling_fills_the_buffer_with_generated_tokens_first_then_the_prompt_tail():
    windows = windows_of(chunk_size=[7], buffer=21, prepend="rolling", prompt_tokens=35)
    # chunk 0: the whole prompt; then generated context 7, 14, 21 -> prompt tails 14, 7, 0.
    assert [(w.context_tokens, w.prompt_tokens) for w in windows[:5]] == [(0, 35), (7, 14), (14, 7), (21, 0), (21, 0)]
    assert all(w.context_tokens + w.prompt_tokens == 21 for w in windows[1:])
    # A prompt shorter than the room left gives all it has.
    short = windows_of(chunk_size=[7], buffer=21, prepend="rolling", prompt_tokens=7)
    assert [w.prompt_tokens for w in short[:4]] == [7, 7, 7, 0]


def test_with_block_causal_only_the_first_chunk_gets_the_prompt():
    for mode in ("once", "rolling"):
        windows = windows_of(chunk_size=[7], buffer=21, block_causal=True, prepend=mode, prompt_tokens=35)
        assert [w.prompt_tokens for w in windows] == [35] + [0] * (len(windows) - 1)
        assert all(w.context_tokens == 0 for w in windows)


def test_without_a_prompt_every_mode_prepends_nothing():
    for mode in ("never", "once", "rolling"):
        assert all(w.prompt_tokens == 0 for w in windows_of(chunk_size=[7], buffer=14, prepend=mode))


def test_unknown_prepend_mode_is_rejected():
    with pytest.raises(ValueError, match="never, once, rolling"):
        ChunkSchedule([7], prepend="always")
