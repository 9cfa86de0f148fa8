"""Streaming fidelity for every decoder (streamed chunks vs one-shot decode: SNR, seams, no samples
lost), exact block-causal streaming on the causal decoder, and the decoder inputs of every prepend
mode, window by window."""

from __future__ import annotations

import math

import pytest
import torch

from audio_pipeline.decoders import load_audio_decoder
from audio_pipeline.decoders.causal_conv import CausalConvDecoder, save_random_causal_checkpoint
from audio_pipeline.decoders.snac import save_random_snac_checkpoint
from audio_pipeline.decoders.streaming import DecoderStream, decode_windows

FRAME = 7


@pytest.fixture(scope="module")
def decoders(tmp_path_factory):
    snac_dir = save_random_snac_checkpoint(tmp_path_factory.mktemp("snac"))
    causal_dir = save_random_causal_checkpoint(tmp_path_factory.mktemp("causal"))
    return {"snac": load_audio_decoder("snac", str(snac_dir)), "causal-conv": load_audio_decoder("causal-conv",
                                                                                                str(causal_dir))}


def codes(frames=24, seed=0):
    return torch.randint(0, 4096, (frames * FRAME,), generator=torch.Generator().manual_seed(seed))


def stream_all(decoder, tokens, *, step=5, **settings):
    """Feeds ``tokens`` in as generation would (a few at a time) and decodes every due chunk."""
    stream = DecoderStream(decoder, **settings)
    parts, known = [], 0
    while True:
        known = min(known + step, tokens.numel())
        finished = known == tokens.numel()
        while (window := stream.next_window(known, finished)) is not None:
            parts.append(decode_windows(decoder, [(stream, window, tokens[window.start:window.end])])[0])
        if finished:
            return parts


def snr_db(reference, test):
    error = ((test - reference) ** 2).sum().item()
    return math.inf if error == 0 else 10 * math.log10((reference ** 2).sum().item() / error)


def max_seam_jump(parts):
    audio = torch.cat(parts)
    seams, position = [], 0
    for part in parts[:-1]:
        position += part.numel()
        seams.append((audio[position] - audio[position - 1]).abs().item())
    return max(seams, default=0.0)


# SNR lower bounds (dB) by decoder and setting; the printed figures are in the closing notes.
SETTINGS = [(cs, buffer) for cs in (None, [7], [28, 56], [14, 28, 56]) for buffer in (0, 14, 56)]


@pytest.mark.parametrize("name", ["snac", "causal-conv"])
@pytest.mark.parametrize("chunk_size, buffer", SETTINGS)
def test_streamed_audio_against_one_shot(decoders, name, chunk_size, buffer):
    decoder = decoders[name]
    tokens = codes()
    one_shot = decoder.decode(tokens)
    parts = stream_all(decoder, tokens, chunk_size=chunk_size, buffer=buffer)
    streamed = torch.cat(parts)
    assert streamed.numel() == one_shot.numel()  # no samples lost, first and last frames kept
    snr = snr_db(one_shot, streamed)
    print(f"{name} chunk_size={chunk_size} buffer={buffer}: SNR {snr:.1f} dB")
    if chunk_size is None:
        torch.testing.assert_close(streamed, one_shot)
    elif name == "causal-conv" and buffer >= decoder.receptive_field_frames * FRAME:
        assert snr > 100  # context covers the receptive field: equal up to float rounding
    else:
        assert snr > 15


@pytest.mark.parametrize("chunk_size", [[7], [28, 56], [14, 28, 56]])
def test_block_causal_streaming_equals_one_shot_on_a_causal_decoder(decoders, chunk_size):
    decoder = decoders["causal-conv"]
    tokens = codes(seed=1)
    parts = stream_all(decoder, tokens, chunk_size=chunk_size, buffer=0, block_causal=True)
    torch.testing.assert_close(torch.cat(parts), decoder.decode(tokens), atol=1e-6, rtol=1e-5)
    assert max_seam_jump(parts) <= (decoder.decode(tokens).diff().abs().max().item())


@pytest.mark.parametrize("name, settings", [
    ("snac", dict(chunk_size=[28, 56], buffer=14)),
    ("snac", dict(chunk_size=[7], buffer=56)),
    ("causal-conv", dict(chunk_size=[28, 56], buffer=56)),
    ("causal-conv", dict(chunk_size=[7], block_causal=True)),
    ("snac", dict(chunk_size=[28, 56], block_causal=True)),
])
def test_no_seam_jumps_more_than_the_one_shot_audio_does(decoders, name, settings):
    decoder = decoders[name]
    for seed in range(3):
        tokens = codes(seed=seed)
        inside = decoder.decode(tokens).diff().abs().max().item()
        assert max_seam_jump(stream_all(decoder, tokens, **settings)) <= inside


class NoBlockCausal(CausalConvDecoder):
    name = "test-no-block-causal"
    supports_block_causal = False


def test_block_causal_is_refused_by_a_decoder_without_it(tmp_path):
    decoder = NoBlockCausal.load(str(save_random_causal_checkpoint(tmp_path / "c")))
    with pytest.raises(ValueError, match="block_causal: the audio decoder 'test-no-block-causal' does not support"):
        DecoderStream(decoder, chunk_size=[7], block_causal=True)


@pytest.mark.parametrize("chunk_size", [[7], [28, 56], [14, 28, 56]])
def test_snac_block_causal_streaming_keeps_every_sample_and_is_close_to_one_shot(decoders, chunk_size):
    decoder = decoders["snac"]
    tokens = codes(seed=2)
    one_shot = decoder.decode(tokens)
    parts = stream_all(decoder, tokens, chunk_size=chunk_size, block_causal=True)
    streamed = torch.cat(parts)
    assert streamed.numel() == one_shot.numel()
    snr = snr_db(one_shot, streamed)
    print(f"snac block_causal chunk_size={chunk_size}: SNR {snr:.1f} dB")
    assert snr > 15
    assert max_seam_jump(parts) <= one_shot.diff().abs().max().item()
    # One block holding everything is the one-shot decode exactly.
    (whole, _), = decoder.decode_blocks([tokens], [decoder.init_state()])
    torch.testing.assert_close(whole, one_shot, atol=1e-5, rtol=1e-4)


# --- what the decoder is handed, mode by mode ------------------------------------------------------

class Recording(CausalConvDecoder):
    """The real causal decoder, remembering every input it was given."""

    name = "recording-causal"

    def reset(self):
        self.calls = []

    def decode_batch(self, batch):
        self.calls += [("window", b.clone()) for b in batch]
        return [wave for wave, _ in CausalConvDecoder.decode_blocks(self, batch, [None] * len(batch))]

    def decode_blocks(self, blocks, states):
        self.calls += [("block", b.clone()) for b in blocks]
        return super().decode_blocks(blocks, states)


@pytest.fixture
def recording(tmp_path):
    path = save_random_causal_checkpoint(tmp_path / "rec")
    decoder = Recording.load(str(path))
    decoder.reset()
    return decoder


PROMPT = torch.arange(1000, 1000 + 5 * FRAME)  # 35 prompt codes
GENERATED = torch.arange(0, 12 * FRAME)  # 84 generated codes


def run_mode(decoder, **settings):
    parts = stream_all(decoder, GENERATED, step=GENERATED.numel(), prompt_codes=PROMPT, **settings)
    return [(kind, codes.tolist()) for kind, codes in decoder.calls], parts


def g(start, end):
    return list(range(start, end))


def p_tail(count):
    return PROMPT.tolist()[PROMPT.numel() - count:] if count else []


def test_never_sends_no_prompt_tokens(recording):
    calls, _ = run_mode(recording, chunk_size=[14, 28], buffer=7, prepend="never")
    assert calls == [("window", g(0, 14)), ("window", g(7, 42)), ("window", g(35, 70)), ("window", g(63, 84))]


def test_once_prepends_the_whole_prompt_to_the_first_chunk_only(recording):
    calls, parts = run_mode(recording, chunk_size=[14, 28], buffer=7, prepend="once")
    assert calls == [("window", PROMPT.tolist() + g(0, 14)), ("window", g(7, 42)), ("window", g(35, 70)),
                     ("window", g(63, 84))]
    assert sum(p.numel() for p in parts) == 12 * recording.samples_per_frame  # prompt audio dropped


def test_rolling_fills_the_buffer_with_generated_tokens_first_then_the_prompt_tail(recording):
    calls, parts = run_mode(recording, chunk_size=[7], buffer=21, prepend="rolling")
    assert calls[:5] == [
        ("window", PROMPT.tolist() + g(0, 7)),  # chunk 0: the whole prompt
        ("window", p_tail(14) + g(0, 14)),  # 7 generated in the buffer, 14 from the prompt's tail
        ("window", p_tail(7) + g(0, 21)),
        ("window", g(0, 28)),  # the buffer is all generated from here on
        ("window", g(7, 35)),
    ]
    assert sum(p.numel() for p in parts) == 12 * recording.samples_per_frame


def test_prepend_causal_primes_a_state_with_the_prompt_alone(recording):
    calls, parts = run_mode(recording, chunk_size=[28], buffer=7, prepend="once", prepend_causal=True)
    # The prompt is its own block (it cannot see the chunk), then the chunk goes on from that state.
    assert calls[:2] == [("block", PROMPT.tolist()), ("block", g(0, 28))]
    assert calls[2:] == [("window", g(21, 56)), ("window", g(49, 84))]
    with_prompt = recording.decode(torch.cat([PROMPT, GENERATED[:28]]))
    torch.testing.assert_close(parts[0], with_prompt[5 * recording.samples_per_frame:], atol=1e-6, rtol=1e-5)


def test_block_causal_decodes_each_chunk_once_on_the_streams_state(recording):
    calls, parts = run_mode(recording, chunk_size=[14, 28], buffer=7, block_causal=True, prepend="once")
    assert calls == [("block", PROMPT.tolist()), ("block", g(0, 14)), ("block", g(14, 42)), ("block", g(42, 70)),
                     ("block", g(70, 84))]
    whole = recording.decode(torch.cat([PROMPT, GENERATED]))
    torch.testing.assert_close(torch.cat(parts), whole[5 * recording.samples_per_frame:], atol=1e-6, rtol=1e-5)


def test_many_streams_decode_in_one_batched_call(decoders):
    decoder = decoders["causal-conv"]
    streams = [DecoderStream(decoder, chunk_size=[14], buffer=7) for _ in range(6)]
    tokens = [codes(4, seed=s) for s in range(6)]
    calls = []
    original = decoder.decode_batch

    def counting(batch):
        calls.append(len(batch))
        return original(batch)

    decoder.decode_batch = counting
    try:
        jobs = [(s, s.next_window(t.numel(), False), t) for s, t in zip(streams, tokens)]
        audio = decode_windows(decoder, [(s, w, t[w.start:w.end]) for s, w, t in jobs])
    finally:
        del decoder.decode_batch
    assert calls == [6]
    for wave, t in zip(audio, tokens):
        torch.testing.assert_close(wave, decoder.decode(t[:14]))
    assert all(s.decoded_index == 14 and s.chunks_decoded == 1 for s in streams)


@pytest.mark.parametrize("flags", [
    ("block_causal=true", "chunk_size=14,28"),
    ("chunk_size=7,28", "buffer=56"),
])
def test_the_engine_streams_the_same_audio_as_a_one_shot_decode(tiny_model_dir, tmp_path, flags):
    import queue

    from audio_pipeline.engine import TTSEngine
    from conftest import make_config, wait_idle

    weights = save_random_causal_checkpoint(tmp_path / "causal")
    engine = TTSEngine(make_config(tiny_model_dir, *flags, audio_decoder="causal-conv",
                                   audio_decoder_weights=str(weights)))
    engine.start()
    try:
        events = queue.Queue()
        contexts = [engine.create_context(t, temperature=0.0, max_tokens=70, min_tokens=70) for t in ("One.", "Two!")]
        for context in contexts:
            engine.submit(context, events.put)
        audio = {c.request_id: [] for c in contexts}
        done = 0
        while done < len(contexts):
            event = events.get(timeout=120)
            assert event.kind != "error", event.error
            if event.kind == "audio":
                audio[event.request_id].append(torch.from_numpy(event.samples))
            done += event.kind == "complete"
        for context in contexts:
            assert len(audio[context.request_id]) > 2
            one_shot = engine.decoder.decode(context.speech_codes(0, len(context.generated)))
            torch.testing.assert_close(torch.cat(audio[context.request_id]), one_shot, atol=1e-6, rtol=1e-5)
        wait_idle(engine)
    finally:
        engine.stop()
