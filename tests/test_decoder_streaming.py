"""Streaming fidelity for every registered decoder (streamed chunks vs the one-shot decode of the same
codes: SNR, seams, no samples lost), exact block-causal streaming on causal decoders, and the
decoder inputs of every prepend mode, window by window. Real decoders with random weights."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from audio_pipeline.decoders import available_audio_decoders, load_audio_decoder
from audio_pipeline.decoders.causal_conv import CausalConvDecoder
from audio_pipeline.decoders.lpc import save_lpc_decoder
from audio_pipeline.decoders.mcep import save_mcep_decoder
from audio_pipeline.testing.random_decoders import (
    TINY_MIMI_CONFIG,
    TINY_SNAC_CONFIG,
    save_random_causal_checkpoint,
    save_random_mimi_checkpoint,
    save_random_neucodec_checkpoint,
    save_random_snac_checkpoint,
)
from audio_pipeline.decoders.streaming import DecoderStream, decode_windows

#: Wide enough that random weights give a signal-like output (the 32-wide tiny model's output is
#: nearly constant), small enough to decode 24 frames in ~40 ms on one core.
SNAC_TEST_CONFIG = {**TINY_SNAC_CONFIG, "decoder_dim": 128}


pytestmark = pytest.mark.usefixtures("one_thread")


def _lpc_codes(frames: int, seed: int) -> torch.Tensor:
    # [phoneme, countdown, envelope, prosody], small values that fit every slot.
    rng = np.random.default_rng(seed)
    return torch.from_numpy(np.stack([rng.integers(0, 90, frames), rng.integers(0, 10, frames),
                                      rng.integers(0, 32, frames), rng.integers(0, 32, frames)], axis=1).reshape(-1))


#: name -> (writes random weights into a directory, random codes(frames, seed)).
QWEN3_TTS_TOKENIZER = Path(__file__).parent / "fixtures" / "qwen3_tts" / "models" / "base" / "speech_tokenizer"
FACTORIES = {
    "snac": (lambda path: save_random_snac_checkpoint(path, **SNAC_TEST_CONFIG),
             lambda frames, seed: torch.randint(0, 4096, (frames * 7,), generator=torch.Generator().manual_seed(seed))),
    "causal-conv": (save_random_causal_checkpoint,
                    lambda frames, seed: torch.randint(0, 4096, (frames * 7,),
                                                       generator=torch.Generator().manual_seed(seed))),
    "lpc": (lambda path: save_lpc_decoder(path, np.random.default_rng(0).normal(0, 0.8, size=(64, 16))), _lpc_codes),
    "mcep": (lambda path: save_mcep_decoder(path, np.concatenate(
        [np.random.default_rng(0).normal(0, 0.3, (64, 40)) / np.arange(1, 41),
         np.random.default_rng(1).uniform(-30, -1, (64, 4))], 1)), _lpc_codes),
    "mimi": (save_random_mimi_checkpoint,
             lambda frames, seed: torch.randint(0, TINY_MIMI_CONFIG["codebook_size"],
                                                (frames * TINY_MIMI_CONFIG["num_quantizers"],),
                                                generator=torch.Generator().manual_seed(seed))),
    "neucodec": (save_random_neucodec_checkpoint,
                 lambda frames, seed: torch.randint(0, 65536, (frames,), generator=torch.Generator().manual_seed(seed))),
    # The reference's tiny speech tokenizer (tests/fixtures/qwen3_tts): 16 codebooks of 64 codes.
    "qwen3-tts-12hz": (lambda path: shutil.copytree(QWEN3_TTS_TOKENIZER, path, dirs_exist_ok=True),
                       lambda frames, seed: torch.randint(0, 64, (frames * 16,),
                                                          generator=torch.Generator().manual_seed(seed))),
}
#: Decoders whose audio depends only on the past: block-causal streaming must equal one-shot.
CAUSAL = {"causal-conv", "lpc", "mcep", "mimi", "qwen3-tts-12hz"}


def test_every_built_in_decoder_is_covered():
    assert set(FACTORIES) == set(available_audio_decoders()) - {n for n in available_audio_decoders()
                                                                if n.startswith("test-")}


@pytest.fixture(scope="module")
def decoders(tmp_path_factory):
    return {name: load_audio_decoder(name, str(save(tmp_path_factory.mktemp(name))))
            for name, (save, _) in FACTORIES.items()}


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


def seam_jumps(parts):
    audio = torch.cat(parts)
    positions = np.cumsum([p.numel() for p in parts[:-1]])
    return [(audio[i] - audio[i - 1]).abs().item() for i in positions]


# --- streamed vs one-shot, every decoder and setting ---------------------------------------------

#: Settings in frames (x tokens_per_frame): chunk_size, buffer (none / some / more than any
#: receptive field), block_causal.
GRID = [(chunks, buffer, block_causal) for chunks in (None, [1], [4, 8], [2, 4, 8]) for buffer in (0, 2, 8)
        for block_causal in (False, True)]


def expectation(name, decoder, chunks, buffer, block_causal):
    """(exact, SNR lower bound in dB or None, seams must stay within the one-shot's jumps)."""
    if chunks is None:
        return True, None, True  # one chunk: the one-shot decode itself
    if (block_causal and name in CAUSAL) or decoder.causal_state:
        return True, None, True  # on the stream's state: a causal_state decoder (lpc) always is
    if name == "causal-conv" and buffer >= decoder.receptive_field_frames:
        return True, None, True  # the context covers everything the new frames can see
    if name == "snac":
        # Not causal: the last frames of a chunk never see the codes after it. Measured 14.5 to
        # 17.5 dB with 1-frame chunks, 21.8 to 27 dB with chunks of 2 frames and more.
        return False, 12.0 if chunks == [1] else 18.0, True
    if name == "causal-conv":  # a context shorter than the receptive field; buffer 0 restarts from zeros
        return False, 20.0, buffer > 0
    if name == "neucodec":
        # Every frame's audio depends on the whole window (attention, group norms): with random
        # weights and windows of 1 to 16 frames the streamed audio is another noise (-4 to 3 dB);
        # tests/test_neutts_streaming.py measures the family's own chunk and buffer sizes.
        return False, None, True
    raise AssertionError(f"no expectation for {name}")


@pytest.mark.parametrize("name", sorted(FACTORIES))
@pytest.mark.parametrize("chunks, buffer, block_causal", GRID)
def test_streamed_audio_against_one_shot(decoders, name, chunks, buffer, block_causal):
    decoder = decoders[name]
    frame = decoder.tokens_per_frame
    settings = dict(chunk_size=None if chunks is None else [c * frame for c in chunks], buffer=buffer * frame,
                    block_causal=block_causal)
    if block_causal and not decoder.supports_block_causal:
        with pytest.raises(ValueError, match="block_causal: the audio decoder .* does not support"):
            DecoderStream(decoder, **settings)
        return
    exact, bound, continuous = expectation(name, decoder, chunks, buffer, block_causal)
    snrs, ratios = [], []
    for seed in range(2):
        tokens = FACTORIES[name][1](24, seed)
        one_shot = decoder.decode(tokens)
        parts = stream_all(decoder, tokens, step=3 * frame - 1, **settings)
        streamed = torch.cat(parts)
        assert [p.numel() for p in parts] == [c * decoder.samples_per_frame for c in chunk_frames(settings, 24, frame)]
        assert streamed.numel() == one_shot.numel()  # no samples lost, first and last frames kept
        snrs.append(snr_db(one_shot, streamed))
        ratios.append(max(seam_jumps(parts), default=0.0) / one_shot.diff().abs().max().item())
        if exact:
            torch.testing.assert_close(streamed, one_shot, atol=1e-5, rtol=1e-5)
        if continuous:
            assert ratios[-1] <= 1.0, f"a seam jumps {ratios[-1]:.2f}x the largest jump inside the one-shot audio"
    print(f"{name} {settings}: SNR {min(snrs):.1f} dB, largest seam jump {max(ratios):.2f}x the one-shot's")
    if bound is not None:
        assert min(snrs) > bound


def chunk_frames(settings, frames, frame):
    """Frames per chunk the schedule must give for ``frames`` frames."""
    if settings["chunk_size"] is None:
        return [frames]
    out, k = [], 0
    sizes = [s // frame for s in settings["chunk_size"]]
    while frames > 0:
        size = min(sizes[min(k, len(sizes) - 1)], frames)
        out.append(size)
        frames -= size
        k += 1
    return out


def test_snac_block_causal_audio_never_depends_on_later_codes(decoders):
    """Chunks decoded block-causally are the same whatever codes come after them."""
    decoder = decoders["snac"]
    tokens = FACTORIES["snac"][1](12, 3)
    parts = stream_all(decoder, tokens, chunk_size=[14, 28], block_causal=True)
    for cut in (14, 42):
        shorter = stream_all(decoder, tokens[:cut + 28], chunk_size=[14, 28], block_causal=True)
        torch.testing.assert_close(torch.cat(shorter[:2 if cut == 14 else 3]),
                                   torch.cat(parts[:2 if cut == 14 else 3]), atol=1e-6, rtol=0)
    # One block holding everything is the one-shot decode.
    (whole, _), = decoder.decode_blocks([tokens], [decoder.init_state()])
    torch.testing.assert_close(whole, decoder.decode(tokens), atol=1e-5, rtol=1e-4)


def test_snac_block_causal_equals_a_recomputation_where_earlier_blocks_keep_their_own_activations(decoders):
    """An independent reference for SNAC's block-causal state: decode blocks 0..j in one ordinary
    forward pass, with every convolution's input over blocks 0..j-1 overwritten by what it was when
    those blocks were decoded; block j's audio must be the streamed chunk j."""
    from audio_pipeline.decoders.snac import codes_to_codebooks
    from audio_pipeline.decoders.snac_layers import Conv

    decoder = decoders["snac"]
    tokens = FACTORIES["snac"][1](7, 4)
    sizes = [14, 28, 7]
    parts = stream_all(decoder, tokens, step=tokens.numel(), chunk_size=sizes, block_causal=True)
    convs = [m for m in decoder.synthesis.modules() if isinstance(m, Conv)]
    seen: dict[Conv, torch.Tensor] = {}

    def keep_the_past(conv, inputs):
        x = inputs[0].clone()
        if conv in seen:
            x[..., :seen[conv].shape[-1]] = seen[conv]
        seen[conv] = x
        return (x,)

    hooks = [conv.register_forward_pre_hook(keep_the_past) for conv in convs]
    try:
        end, spf = 0, decoder.samples_per_frame
        for size, part in zip(sizes, parts):
            start, end = end, end + size
            with torch.inference_mode():
                z = decoder.quantizer.from_codes(codes_to_codebooks(tokens[None, :end]))
                audio = decoder.synthesis(z, decoder._noise(end // 7, [0], None))[0, 0]
            torch.testing.assert_close(part, audio[start // 7 * spf:], atol=1e-5, rtol=1e-4)
    finally:
        for hook in hooks:
            hook.remove()
    # and it is not the plain decode of the same blocks (the past would see the block)
    assert not torch.allclose(torch.cat(parts), decoder.decode(tokens), atol=1e-3)


@pytest.mark.parametrize("name", ["snac", "causal-conv"])
def test_block_causal_state_is_small_and_holds_no_batch_activations(decoders, name):
    decoder = decoders[name]
    streams = [DecoderStream(decoder, chunk_size=[28], block_causal=True) for _ in range(3)]
    tokens = [FACTORIES[name][1](4, seed) for seed in range(3)]
    decode_windows(decoder, [(s, s.next_window(28, False), t) for s, t in zip(streams, tokens)])
    for stream in streams:
        tensors = [t for t in stream.state if t is not None]
        assert tensors and all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in tensors)
        # a few columns per layer, far less than the audio of one chunk
        assert sum(t.numel() for t in tensors) < 8 * 28 // 7 * decoder.samples_per_frame
        stream.close()
        stream.close()
        assert stream.state is None and stream.next_window(56, True) is None


# --- config-time check ---------------------------------------------------------------------------

class NoBlockCausal(CausalConvDecoder):
    name = "test-no-block-causal"
    supports_block_causal = False


def test_a_decoder_without_block_causal_is_refused_with_the_setting_named(tmp_path):
    with pytest.raises(ValueError, match="block_causal=true is not supported by audio_decoder 'test-no-block-causal'"):
        NoBlockCausal.check_streaming_settings(block_causal=True)
    with pytest.raises(ValueError, match="prepend_prompt_speech_tokens_causal=true is not supported"):
        NoBlockCausal.check_streaming_settings(prepend_causal=True)
    NoBlockCausal.check_streaming_settings()
    decoder = NoBlockCausal.load(str(save_random_causal_checkpoint(tmp_path / "c")))
    with pytest.raises(ValueError, match="block_causal: the audio decoder 'test-no-block-causal' does not support"):
        DecoderStream(decoder, chunk_size=[7], block_causal=True)


def test_config_refuses_block_causal_for_a_snac_checkpoint_with_attention(tmp_path):
    from audio_pipeline.config import AudioGenerationConfig
    from audio_pipeline.decoders.settings_check import check_decoder_settings

    attention = save_random_snac_checkpoint(tmp_path / "attn", **{**TINY_SNAC_CONFIG, "decoder_dim": 64,
                                                                  "encoder_dim": 4, "attn_window_size": 8})
    plain = save_random_snac_checkpoint(tmp_path / "plain", **TINY_SNAC_CONFIG)
    with pytest.raises(ValueError, match=r"block_causal=true is not supported by audio_decoder 'snac' with the "
                                         r"checkpoint .*windowed attention"):
        check_decoder_settings(AudioGenerationConfig(audio_decoder="snac", audio_decoder_weights=str(attention),
                                                     block_causal=True))
    assert check_decoder_settings(AudioGenerationConfig(audio_decoder="snac", audio_decoder_weights=str(plain),
                                                        block_causal=True)).block_causal
    assert not AudioGenerationConfig(audio_decoder="snac", audio_decoder_weights=str(attention)).block_causal
    assert not load_audio_decoder("snac", str(attention)).supports_block_causal


def test_stream_settings_are_checked(decoders):
    decoder = decoders["causal-conv"]
    with pytest.raises(ValueError, match="chunk_size: 10 is not a multiple"):
        DecoderStream(decoder, chunk_size=[7, 10])
    with pytest.raises(ValueError, match="buffer: 3"):
        DecoderStream(decoder, chunk_size=[7], buffer=3)
    with pytest.raises(ValueError, match="whole 7-code frames"):
        DecoderStream(decoder, chunk_size=[7], prompt_codes=torch.arange(8))
    with pytest.raises(ValueError, match="never, once, rolling"):
        DecoderStream(decoder, chunk_size=[7], prepend="always")
    with pytest.raises(ValueError, match=r"code 4096 at position 0 \(frame 0\) is outside \[0, 4096\)"):
        decoder.decode(torch.full((7,), 4096))


# Chunks ending at 7, 21, 49, 77, 105, 133; every 14; none before the end.
@pytest.mark.parametrize("chunks,buffer,expected", [([7, 14, 28], 0, 6), ([14], 7, 9), (None, 0, 0)])
def test_a_running_streams_due_at_is_where_its_next_window_falls_due(decoders, chunks, buffer, expected):
    """The engine finds due windows by comparing a stream's codes with ``due_at`` (one comparison a
    row): while the stream runs, no window is due below it and one is at it, chunk after chunk."""
    decoder = decoders["causal-conv"]
    stream = DecoderStream(decoder, chunk_size=chunks, buffer=buffer)
    windows = 0
    for generated in range(1, 140):
        window = stream.next_window(generated, finished=False)
        assert (window is not None) == (generated >= stream.due_at), (generated, stream.due_at)
        if window is not None:
            stream._advance(window)
            windows += 1
    assert windows == expected
    stream.close()
    assert stream.due_at == math.inf


# --- what the decoder is handed, mode by mode ------------------------------------------------------

class Recording(CausalConvDecoder):
    """The real causal decoder, remembering every input it was given."""

    name = "test-recording-causal"

    def reset(self):
        self.calls = []
        self.invocations = 0

    def decode_batch(self, batch):
        self.invocations += 1
        self.calls += [("window", b.tolist()) for b in batch]
        return [wave for wave, _ in CausalConvDecoder.decode_blocks(self, batch, [None] * len(batch))]

    def decode_blocks(self, blocks, states):
        self.invocations += 1
        self.calls += [("block", b.tolist()) for b in blocks]
        return super().decode_blocks(blocks, states)


@pytest.fixture
def recording(tmp_path):
    decoder = Recording.load(str(save_random_causal_checkpoint(tmp_path / "rec")))
    decoder.reset()
    return decoder


PROMPT = torch.arange(1000, 1000 + 5 * 7)  # 35 prompt codes
GENERATED = torch.arange(0, 12 * 7)  # 84 generated codes


def run_mode(decoder, **settings):
    parts = stream_all(decoder, GENERATED, step=GENERATED.numel(), prompt_codes=PROMPT, **settings)
    calls, decoder.calls = decoder.calls, []
    assert sum(p.numel() for p in parts) == 12 * decoder.samples_per_frame  # prompt and context audio dropped
    return calls, parts


def g(start, end):
    return list(range(start, end))


def p_tail(count):
    return PROMPT.tolist()[PROMPT.numel() - count:]


def test_never_sends_no_prompt_tokens(recording):
    calls, _ = run_mode(recording, chunk_size=[14, 28], buffer=7, prepend="never")
    assert calls == [("window", g(0, 14)), ("window", g(7, 42)), ("window", g(35, 70)), ("window", g(63, 84))]


def test_once_prepends_the_whole_prompt_to_the_first_chunk_only(recording):
    calls, parts = run_mode(recording, chunk_size=[14, 28], buffer=7, prepend="once")
    assert calls == [("window", PROMPT.tolist() + g(0, 14)), ("window", g(7, 42)), ("window", g(35, 70)),
                     ("window", g(63, 84))]
    # The first chunk is the audio of its codes decoded after the prompt.
    with_prompt = recording.decode(torch.cat([PROMPT, GENERATED[:14]]))
    torch.testing.assert_close(parts[0], with_prompt[5 * recording.samples_per_frame:])


def test_rolling_fills_the_buffer_with_generated_tokens_first_then_the_prompt_tail(recording):
    from audio_pipeline.config import PrependPromptSpeechTokens

    calls, _ = run_mode(recording, chunk_size=[7], buffer=21, prepend=PrependPromptSpeechTokens.ROLLING)
    assert calls[:5] == [
        ("window", PROMPT.tolist() + g(0, 7)),  # chunk 0: the whole prompt
        ("window", p_tail(14) + g(0, 14)),  # 7 generated codes of context, 14 from the prompt's tail
        ("window", p_tail(7) + g(0, 21)),
        ("window", g(0, 28)),  # the buffer is all generated from here on
        ("window", g(7, 35)),
    ]
    # ... and on to the last of the 12 chunks: 7 new codes after 21 generated ones of context.
    assert calls[3:] == [("window", g(7 * k - 21, 7 * k + 7)) for k in range(3, 12)]


def test_prepend_causal_decodes_the_prompt_once_as_its_own_block(recording):
    calls, parts = run_mode(recording, chunk_size=[28], buffer=7, prepend="once", prepend_causal=True)
    # The prompt is a block of its own (it cannot see the chunk); the chunk goes on from its state.
    assert calls == [("block", PROMPT.tolist()), ("block", g(0, 28)), ("window", g(21, 56)), ("window", g(49, 84))]
    # For a causal decoder that is the same audio as decoding prompt and chunk together.
    with_prompt = recording.decode(torch.cat([PROMPT, GENERATED[:28]]))
    torch.testing.assert_close(parts[0], with_prompt[5 * recording.samples_per_frame:], atol=1e-6, rtol=1e-5)


def test_rolling_prepend_causal_keeps_the_prompt_state_while_the_buffer_needs_the_prompt(recording):
    calls, _ = run_mode(recording, chunk_size=[7], buffer=21, prepend="rolling", prepend_causal=True)
    # Prompt context is the prompt's state; generated context is recomputed as usual.
    assert calls[:6] == [("block", PROMPT.tolist()), ("block", g(0, 7)), ("block", g(0, 14)), ("block", g(0, 21)),
                         ("window", g(0, 28)), ("window", g(7, 35))]


def test_block_causal_decodes_each_chunk_once_on_the_streams_state(recording):
    for prepend in ("once", "rolling"):
        calls, parts = run_mode(recording, chunk_size=[14, 28], buffer=7, block_causal=True, prepend=prepend)
        assert calls == [("block", PROMPT.tolist()), ("block", g(0, 14)), ("block", g(14, 42)),
                         ("block", g(42, 70)), ("block", g(70, 84))]
        whole = recording.decode(torch.cat([PROMPT, GENERATED]))
        torch.testing.assert_close(torch.cat(parts), whole[5 * recording.samples_per_frame:], atol=1e-6, rtol=1e-5)
    calls, _ = run_mode(recording, chunk_size=[14, 28], buffer=7, block_causal=True, prepend="never")
    assert calls[0] == ("block", g(0, 14))


# --- batching ------------------------------------------------------------------------------------

def test_many_streams_decode_in_one_batched_call(decoders):
    decoder = decoders["snac"]
    streams = [DecoderStream(decoder, chunk_size=[14], buffer=7) for _ in range(6)]
    tokens = [FACTORIES["snac"][1](4, seed) for seed in range(6)]
    calls = []
    original = decoder.decode_batch

    def counting(batch, **kwargs):
        calls.append(len(batch))
        return original(batch, **kwargs)

    decoder.decode_batch = counting
    try:
        audio = decode_windows(decoder, [(s, s.next_window(t.numel(), False), t[:14]) for s, t in zip(streams, tokens)])
    finally:
        del decoder.decode_batch
    assert calls == [6]
    for wave, t in zip(audio, tokens):
        torch.testing.assert_close(wave, decoder.decode(t[:14]), atol=1e-5, rtol=0)
    assert all(s.decoded_index == 14 and s.chunks_decoded == 1 for s in streams)


def test_snac_block_causal_streams_batched_together_equal_each_alone(decoders):
    decoder = decoders["snac"]
    tokens = [FACTORIES["snac"][1](8, seed) for seed in range(3)]
    alone = [torch.cat(stream_all(decoder, t, step=t.numel(), chunk_size=[14, 21], block_causal=True)) for t in tokens]
    streams = [DecoderStream(decoder, chunk_size=[14, 21], block_causal=True) for _ in tokens]
    together: list[list[torch.Tensor]] = [[] for _ in tokens]
    while jobs := [(i, s, w) for i, s in enumerate(streams) if (w := s.next_window(56, True)) is not None]:
        waves = decode_windows(decoder, [(s, w, tokens[i][w.start:w.end]) for i, s, w in jobs])
        for (i, _, _), wave in zip(jobs, waves):
            together[i].append(wave)
    for mine, reference in zip(together, alone):
        torch.testing.assert_close(torch.cat(mine), reference, atol=1e-5, rtol=0)


def test_streams_with_different_settings_share_a_call_and_each_gets_its_own_audio(recording):
    settings = [dict(chunk_size=[14], buffer=7), dict(chunk_size=[14], block_causal=True, prepend="once"),
                dict(chunk_size=[21], prepend="rolling", buffer=14), dict(chunk_size=[14], block_causal=True),
                dict(chunk_size=[14], prepend="once", prepend_causal=True, buffer=7)]
    streams = [DecoderStream(recording, prompt_codes=PROMPT, **s) for s in settings]
    alone = [stream_all(recording, GENERATED, step=GENERATED.numel(), prompt_codes=PROMPT, **s) for s in settings]
    recording.reset()
    together: list[list[torch.Tensor]] = [[] for _ in streams]
    calls_per_round = []
    while True:
        jobs = [(s, w, GENERATED[w.start:w.end]) for s in streams
                if (w := s.next_window(GENERATED.numel(), True)) is not None]
        if not jobs:
            break
        recording.invocations = 0
        for (stream, _, _), wave in zip(jobs, decode_windows(recording, jobs)):
            together[streams.index(stream)].append(wave)
        calls_per_round.append(recording.invocations)
    for mine, reference in zip(together, alone):
        torch.testing.assert_close(torch.cat(mine), torch.cat(reference), atol=1e-6, rtol=1e-5)
    # The first round primes prompts, decodes blocks and decodes windows: one call each.
    assert calls_per_round[0] == 3 and max(calls_per_round[1:]) == 2


def test_decode_windows_rejects_inconsistent_jobs(decoders):
    decoder = decoders["causal-conv"]
    stream = DecoderStream(decoder, chunk_size=[14])
    window = stream.next_window(28, False)
    tokens = FACTORIES["causal-conv"][1](4, 0)
    with pytest.raises(ValueError, match="expected 14 codes"):
        decode_windows(decoder, [(stream, window, tokens)])
    with pytest.raises(ValueError, match="one chunk per stream"):
        decode_windows(decoder, [(stream, window, tokens[:14]), (stream, window, tokens[:14])])
    decode_windows(decoder, [(stream, window, tokens[:14])])
    with pytest.raises(ValueError, match="new codes start at 0, the stream has decoded 14"):
        decode_windows(decoder, [(stream, window, tokens[:14])])
    stream.close()
    with pytest.raises(ValueError, match="closed"):
        decode_windows(decoder, [(stream, window, tokens[:14])])


# --- the engine ----------------------------------------------------------------------------------

@pytest.mark.parametrize("flags", [
    ("block_causal=true", "chunk_size=14,28"),
    ("chunk_size=7,28", "buffer=56"),
])
@pytest.mark.parametrize("decode_thread", [False, True], ids=["in-loop", "decoder-thread"])
def test_the_engine_streams_the_same_audio_as_a_one_shot_decode(tiny_model_dir, tmp_path, flags, decode_thread):
    """In the loop (the CPU's default) and on the decoder thread (CUDA's), the chunks add up to the
    one-shot decode."""
    from helpers import run_to_completion, start_engine

    weights = save_random_causal_checkpoint(tmp_path / "causal")
    engine = start_engine(tiny_model_dir, *flags, audio_decoder="causal-conv", audio_decoder_weights=str(weights),
                          audio_decoder_thread=decode_thread)
    try:
        assert (engine.core._decoder is not None) == decode_thread
        contexts = [engine.create_context(t, temperature=0.0, max_tokens=70, min_tokens=70) for t in ("One.", "Two!")]
        for context, chunks in zip(contexts, run_to_completion(engine, contexts)):
            assert len(chunks) > 2
            one_shot = engine.decoder.decode(context.speech_codes(0, len(context.generated)))
            torch.testing.assert_close(torch.from_numpy(np.concatenate(chunks)), one_shot, atol=1e-6, rtol=1e-5)
    finally:
        engine.stop()
