"""Qwen3-TTS 12 Hz speech tokenizer (decoder "qwen3-tts-12hz"): equality with the reference package's
golden outputs (tests/fixtures/qwen3_tts/, see scripts/qwen3_tts_reference/README.md), block-causal
streaming and batching against the whole-sequence forward, bounded stream state, encode, loading and
validation.

The fixture is a tiny random checkpoint with the published layout: 16 codebooks of 64 codes, a
72-frame attention window, 192 samples a frame (published: 1920). Nothing is fetched.
"""

from __future__ import annotations

import json
import shutil
import wave
from pathlib import Path

import numpy as np
import pytest
import torch

from audio_pipeline.decoders import audio_decoder_class, available_audio_decoders, load_audio_decoder
from audio_pipeline.decoders.qwen3_tts_12hz import PIECE_FRAMES, Qwen3TTS12HzDecoder, Qwen3TTS12HzState
from helpers import pcm16_to_float

FIXTURES = Path(__file__).parent / "fixtures" / "qwen3_tts"
MODEL_DIR = FIXTURES / "models" / "base"
TOKENIZER_DIR = MODEL_DIR / "speech_tokenizer"
GOLDEN = FIXTURES / "speech_tokenizer"
CODEBOOKS, CODEBOOK_SIZE, SPF, WINDOW = 16, 64, 192, 72
#: Against the reference and between our own paths (measured: at most 4e-6, from rounding).
ATOL = 1e-5

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def decoder() -> Qwen3TTS12HzDecoder:
    return load_audio_decoder("qwen3-tts-12hz", str(TOKENIZER_DIR))


def golden(name: str) -> torch.Tensor:
    return torch.from_numpy(np.load(GOLDEN / f"{name}.npy"))


def fixture_codes(frames: int) -> torch.Tensor:
    """The reference's (frames, 16) codes."""
    return golden(f"decode_codes_{frames}")


def random_codes(frames: int, seed: int) -> torch.Tensor:
    return torch.randint(0, CODEBOOK_SIZE, (frames, CODEBOOKS), generator=torch.Generator().manual_seed(seed))


def flat(codes: torch.Tensor) -> torch.Tensor:
    """(frames, codebooks) -> frame-major 1-D, the decoder's input."""
    return codes.reshape(-1)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


def state_tensors(state: Qwen3TTS12HzState) -> list[torch.Tensor]:
    """The tensors a state holds (its convs, keys and values are views of them)."""
    return [state.conv_data, state.cache]


# --- traits and loading --------------------------------------------------------------------------


def test_traits(decoder):
    assert "qwen3-tts-12hz" in available_audio_decoders()
    assert audio_decoder_class("qwen3-tts-12hz") is Qwen3TTS12HzDecoder
    assert Qwen3TTS12HzDecoder.tokens_per_frame == 16  # the published checkpoints', before any is read
    assert (decoder.tokens_per_frame, decoder.codebook_size) == (CODEBOOKS, CODEBOOK_SIZE)
    assert (decoder.sample_rate, decoder.samples_per_frame) == (24000, SPF)  # read from config.json
    assert decoder.supports_block_causal and decoder.causal_state and decoder.supports_encoding
    Qwen3TTS12HzDecoder.check_streaming_settings(block_causal=True, prepend_causal=True)


@pytest.mark.parametrize("directory", [MODEL_DIR, FIXTURES / "models" / "custom_voice"], ids=["base", "custom_voice"])
def test_a_model_directory_loads_its_speech_tokenizer(decoder, directory):
    """A Qwen3-TTS checkpoint directory works as audio_decoder_weights (custom_voice's speech_tokenizer/
    is a symlink)."""
    codes = flat(fixture_codes(40))
    assert torch.equal(load_audio_decoder("qwen3-tts-12hz", str(directory)).decode(codes), decoder.decode(codes))


def test_loading_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="must be a directory"):
        Qwen3TTS12HzDecoder.load(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="takes none"):
        Qwen3TTS12HzDecoder.load(str(TOKENIZER_DIR), {"num_codebooks": 8})
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_tts_tokenizer_25hz"}))
    with pytest.raises(ValueError, match="not a Qwen3-TTS 12 Hz speech tokenizer"):
        Qwen3TTS12HzDecoder.load(str(tmp_path))
    broken = tmp_path / "broken"
    shutil.copytree(TOKENIZER_DIR, broken)
    config = json.loads((broken / "config.json").read_text())
    for top, decoder_config, message in (
            ({"encoder_valid_num_quantizers": 8}, {"num_quantizers": 8}, "config.json says 8, the checkpoint has 16"),
            ({}, {"num_quantizers": 8}, "encoder_valid_num_quantizers must be"),
            ({"decode_upsample_rate": 1920}, {}, "not the 192 samples"),
            ({}, {"latent_dim": None}, "lacks latent_dim")):
        changed = {**config, **top, "decoder_config": {**config["decoder_config"], **decoder_config}}
        changed["decoder_config"] = {k: v for k, v in changed["decoder_config"].items() if v is not None}
        (broken / "config.json").write_text(json.dumps(changed))
        with pytest.raises(ValueError, match=message):
            Qwen3TTS12HzDecoder.load(str(broken))


# --- whole sequences against the reference -------------------------------------------------------


@pytest.mark.parametrize("frames", [40, 330])
def test_decode_equals_reference_forward(decoder, frames):
    """The reference decoder's whole-sequence forward (``model.decoder(codes)``). Past 300 frames
    ``decode`` runs in pieces on the stream state: still the whole-sequence result."""
    audio = decoder.decode(flat(fixture_codes(frames)))
    assert audio.shape == (frames * SPF,) and audio.dtype == torch.float32
    worst = max_diff(audio, golden(f"decoder_forward_{frames}"))
    print(f"decode vs reference forward, {frames} frames: max |diff| {worst:.2e}")
    assert worst <= ATOL


@pytest.mark.parametrize("frames", [40, 330])
def test_decode_equals_reference_decode_for_its_first_chunk(decoder, frames):
    """The reference's ``decode()`` (chunks of 300 frames, 25 of left context) up to 300 frames.

    Beyond 300 frames the reference restarts with only 25 frames of context, which differs from its
    own whole-sequence forward (by up to 0.04 here); the engine streams the whole-sequence result,
    so there ``decode`` follows the forward (test above), not the chunked ``decode()``.
    """
    audio, expected = decoder.decode(flat(fixture_codes(frames))), golden(f"decode_{frames}")
    upto = min(frames, PIECE_FRAMES) * SPF
    worst = max_diff(audio[:upto], expected[:upto])
    print(f"decode vs reference decode(), first {upto // SPF} frames: max |diff| {worst:.2e}")
    assert worst <= ATOL
    if frames > PIECE_FRAMES:
        assert max_diff(golden(f"decoder_forward_{frames}")[upto:], expected[upto:]) > 1e-2


def test_decode_batch_of_ragged_sequences_equals_each_alone(decoder):
    batch = [flat(random_codes(frames, seed)) for seed, frames in enumerate([5, 12, 1, 80, 12, 310])]
    got = decoder.decode_batch(batch)
    worst = max(max_diff(audio, decoder.decode(codes)) for audio, codes in zip(got, batch))
    print(f"decode_batch (5 to 310 frames) vs each alone: max |diff| {worst:.2e}")
    assert worst <= ATOL


def test_receptive_field_is_respected(decoder):
    """A changed frame reaches no earlier frame and no frame more than receptive_field_frames later
    (2 attention layers x 71 frames, the convolutions the rest), and reaches past one attention
    window. The bound is structural: near it the effect fades below float resolution (about 1e-15
    at the last frame in float64), so it cannot be measured tight."""
    rf, changed = decoder.receptive_field_frames, 10
    assert rf == 2 * (WINDOW - 1) + 17
    codes = random_codes(changed + rf + 4, 1)
    other = codes.clone()
    other[changed] = (other[changed] + 1) % CODEBOOK_SIZE
    a, b = decoder.decode(flat(codes)), decoder.decode(flat(other))
    assert torch.equal(a[:changed * SPF], b[:changed * SPF])  # causal
    assert (a - b)[changed * SPF:(changed + 1) * SPF].abs().max() > 1e-3
    assert (a - b)[(changed + WINDOW) * SPF:(changed + WINDOW + 1) * SPF].abs().max() > 1e-4
    assert torch.equal(a[(changed + rf + 1) * SPF:], b[(changed + rf + 1) * SPF:])


# --- block-causal streaming ----------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 2, 7])
def test_blocks_equal_reference_forward(decoder, size):
    """330 frames block by block (past the 72-frame window and the 300-frame chunk): each block
    yields exactly its frames' samples, and together they are the reference's whole forward."""
    codes, state, parts = fixture_codes(330), decoder.init_state(), []
    for start in range(0, 330, size):
        [(audio, state)] = decoder.decode_blocks([flat(codes[start:start + size])], [state])
        assert audio.numel() == min(size, 330 - start) * SPF
        parts.append(audio)
    worst = max_diff(torch.cat(parts), golden("decoder_forward_330"))
    print(f"blocks of {size} vs reference forward (330 frames): max |diff| {worst:.2e}")
    assert worst <= ATOL


def test_ragged_batch_of_streams_equals_each_alone(decoder):
    """Streams with different block sizes in the same calls, fresh and long-running ones together,
    one of them the 330-frame reference, one sending a 310-frame block (decoded in pieces)."""
    streams = [fixture_codes(330), random_codes(90, 2), random_codes(41, 3), random_codes(320, 4)]
    sizes = [[5, 3, 11], [2], [17, 1], [310, 4]]  # each stream's block sizes, cycled
    expected = [golden("decoder_forward_330")] + [decoder.decode(flat(codes)) for codes in streams[1:]]
    states = [decoder.init_state() for _ in streams]
    parts, done, calls = [[] for _ in streams], [0] * len(streams), 0
    while active := [i for i, codes in enumerate(streams) if done[i] < len(codes)]:
        blocks = [streams[i][done[i]:done[i] + sizes[i][calls % len(sizes[i])]] for i in active]
        out = decoder.decode_blocks([flat(block) for block in blocks], [states[i] for i in active])
        for i, block, (audio, state) in zip(active, blocks, out):
            assert audio.numel() == len(block) * SPF
            parts[i].append(audio)
            states[i] = state
            done[i] += len(block)
        calls += 1
    worst = max(max_diff(torch.cat(got), want) for got, want in zip(parts, expected))
    print(f"ragged batched blocks vs each stream alone / the reference: max |diff| {worst:.2e}")
    assert worst <= ATOL
    for state in states:  # each state owns its tensors: none keeps a batch's activations alive
        assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in state_tensors(state))


def test_state_is_bounded_and_never_modified(decoder):
    """The state holds the convolutions' pasts and the window's keys: its size stops growing once
    the stream is past the window, and decoding on a state leaves it as it was."""
    codes = random_codes(330, 5)
    sizes = []
    state = decoder.init_state()
    for start in range(0, 330, 10):
        [(_, state)] = decoder.decode_blocks([flat(codes[start:start + 10])], [state])
        sizes.append(sum(t.numel() for t in state_tensors(state)))
    assert sizes[7:] == [sizes[7]] * len(sizes[7:])  # constant from 80 frames on
    assert sizes[0] < sizes[7]  # only the keys of the frames seen so far
    assert all(k.shape[1] == WINDOW - 1 for k in (*state.keys, *state.values))
    kept = [t.clone() for t in state_tensors(state)]
    block = flat(random_codes(3, 6))
    [(first, new)] = decoder.decode_blocks([block], [state])
    [(again, _)] = decoder.decode_blocks([block], [state])
    assert torch.equal(first, again) and new is not state
    assert all(torch.equal(a, b) for a, b in zip(kept, state_tensors(state)))


# --- encoding ------------------------------------------------------------------------------------


def read_reference_wav() -> torch.Tensor:
    with wave.open(str(FIXTURES / "reference_24k.wav"), "rb") as f:
        assert (f.getframerate(), f.getnchannels(), f.getsampwidth()) == (24000, 1, 2)
        return torch.from_numpy(pcm16_to_float(f.readframes(f.getnframes())))


def test_encode_equals_reference(decoder):
    waveform = read_reference_wav()
    codes = decoder.encode(waveform)
    expected = golden("encode_reference_codes")  # (19 = ceil(36000 / 1920) frames, 16)
    assert codes.dtype == torch.long and torch.equal(codes, flat(expected))
    assert decoder.decode(codes).numel() == len(expected) * SPF


def test_encode_rejects_bad_waveforms(decoder):
    for bad in (torch.zeros(0), torch.zeros(2, 1920), torch.zeros(1920, dtype=torch.long), [0.0] * 1920):
        with pytest.raises(ValueError):
            decoder.encode(bad)


# --- validation ----------------------------------------------------------------------------------


def test_clear_errors_for_bad_codes(decoder):
    codes = random_codes(4, 7)
    for value, frame, book in ((CODEBOOK_SIZE, 2, 5), (-1, 0, 15)):
        bad = codes.clone()
        bad[frame, book] = value
        with pytest.raises(ValueError, match=rf"code {value} .*frame {frame}, codebook {book}.* outside \[0, 64\)"):
            decoder.decode(flat(bad))
    with pytest.raises(ValueError, match="whole number of 16-code frames"):
        decoder.decode(flat(codes[:, :15]))  # 15 codebooks: 60 codes are not whole frames
    with pytest.raises(ValueError, match=r"1-D and frame-major .*got shape \(4, 15\)"):
        decoder.decode(codes[:, :15])
    with pytest.raises(ValueError, match="integer"):
        decoder.decode(flat(codes).float())
    with pytest.raises(ValueError, match="non-empty"):
        decoder.decode(torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="one state per block"):
        decoder.decode_blocks([flat(codes)], [])
    with pytest.raises(ValueError, match="init_state"):
        decoder.decode_blocks([flat(codes)], [None])
