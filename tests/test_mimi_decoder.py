"""Mimi decoder: equality with transformers' MimiModel (decode and encode), block-causal streaming
and batching against the one-shot decode, loading from Mimi and CSM directories, validation.

A tiny random MimiModel is built with transformers' own classes and written with save_pretrained
(save_random_mimi_checkpoint); the CSM directory is a tiny CsmForConditionalGeneration holding the
same codec, saved in shards. Nothing is fetched.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import CsmConfig, CsmForConditionalGeneration, MimiModel

from audio_pipeline.decoders import audio_decoder_class, available_audio_decoders, load_audio_decoder
from audio_pipeline.decoders.mimi import MimiDecoder, MimiState
from audio_pipeline.testing.random_decoders import TINY_MIMI_CONFIG, save_random_mimi_checkpoint

CODEBOOKS, CODEBOOK_SIZE, SPF = TINY_MIMI_CONFIG["num_quantizers"], TINY_MIMI_CONFIG["codebook_size"], 1920
#: Block-by-block and batched decoding against one-shot (measured: under 5e-7 on this model).
ATOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def mimi_dir(tmp_path_factory) -> Path:
    return save_random_mimi_checkpoint(tmp_path_factory.mktemp("mimi"), seed=3)


@pytest.fixture(scope="module")
def reference(mimi_dir) -> MimiModel:
    return MimiModel.from_pretrained(str(mimi_dir)).eval()


@pytest.fixture(scope="module")
def decoder(mimi_dir) -> MimiDecoder:
    return load_audio_decoder("mimi", str(mimi_dir))


@pytest.fixture(scope="module")
def csm_dir(tmp_path_factory, mimi_dir, reference) -> Path:
    """A tiny CSM model whose codec is the Mimi of ``mimi_dir``, saved in several shards."""
    config = CsmConfig(
        num_codebooks=CODEBOOKS, vocab_size=CODEBOOK_SIZE, text_vocab_size=128, hidden_size=16, intermediate_size=32,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        pad_token_id=3, bos_token_id=1, audio_token_id=2, audio_eos_token_id=3,
        codebook_pad_token_id=CODEBOOK_SIZE - 1, codebook_eos_token_id=0,
        depth_decoder_config=dict(num_codebooks=CODEBOOKS, backbone_hidden_size=16, vocab_size=CODEBOOK_SIZE,
                                  hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  num_key_value_heads=1, max_position_embeddings=CODEBOOKS + 1),
        codec_config=json.loads((mimi_dir / "config.json").read_text()))
    model = CsmForConditionalGeneration(config)
    model.codec_model.load_state_dict(reference.state_dict())
    path = tmp_path_factory.mktemp("csm")
    model.save_pretrained(str(path), max_shard_size="100KB")
    assert len(list(path.glob("*.safetensors"))) > 1
    return path


def random_codes(frames: int, seed: int, codebooks: int = CODEBOOKS) -> torch.Tensor:
    """(codebooks, frames) codes."""
    return torch.randint(0, CODEBOOK_SIZE, (codebooks, frames), generator=torch.Generator().manual_seed(seed))


def flat(codes: torch.Tensor) -> torch.Tensor:
    """(codebooks, frames) -> frame-major 1-D."""
    return codes.T.reshape(-1)


def reference_decode(reference: MimiModel, codes: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        audio = reference.decode(codes[None]).audio_values[0, 0]
    assert audio.abs().max() < 1  # the decoder clamps; the comparison must not depend on it
    return audio


def decode_in_blocks(decoder: MimiDecoder, codes: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    state, parts, start = decoder.init_state(), [], 0
    for size in sizes:
        [(audio, state)] = decoder.decode_blocks([flat(codes[:, start:start + size])], [state])
        parts.append(audio)
        start += size
    assert start == codes.shape[1]
    return parts


# --- traits and registry -------------------------------------------------------------------------


def test_traits(decoder):
    assert "mimi" in available_audio_decoders() and audio_decoder_class("mimi") is MimiDecoder
    assert MimiDecoder.tokens_per_frame == 32  # CSM-1B's, before any checkpoint is read
    assert decoder.tokens_per_frame == CODEBOOKS
    assert (decoder.sample_rate, decoder.samples_per_frame) == (24000, SPF)
    assert decoder.supports_block_causal and decoder.causal_state and decoder.supports_encoding


def test_receptive_field_is_respected(decoder):
    """A changed frame reaches no earlier frame and no frame more than receptive_field_frames later;
    the bound is tight within a frame (2 attention layers x 15 steps = 15 frames, the rest kernels)."""
    rf, frames, changed = decoder.receptive_field_frames, 40, 10
    codes = random_codes(frames, 1)
    other = codes.clone()
    other[:, changed] = (other[:, changed] + 1) % CODEBOOK_SIZE
    a, b = decoder.decode(flat(codes)), decoder.decode(flat(other))
    torch.testing.assert_close(a[:changed * SPF], b[:changed * SPF], atol=0, rtol=0)  # causal
    assert (a[changed * SPF:(changed + 1) * SPF] - b[changed * SPF:(changed + 1) * SPF]).abs().max() > 1e-3
    after = (changed + rf + 1) * SPF
    torch.testing.assert_close(a[after:], b[after:], atol=0, rtol=0)
    assert (a - b)[(changed + rf - 1) * SPF:(changed + rf) * SPF].abs().max() > 0


# --- one-shot decoding ---------------------------------------------------------------------------


@pytest.mark.parametrize("frames", [1, 7, 40])
def test_decode_equals_transformers(decoder, reference, frames):
    codes = random_codes(frames, frames)
    audio = decoder.decode(flat(codes))
    assert audio.shape == (frames * SPF,) and audio.dtype == torch.float32
    torch.testing.assert_close(audio, reference_decode(reference, codes), atol=1e-6, rtol=0)


def test_decode_batch_equals_each_alone(decoder):
    batch = [flat(random_codes(frames, seed)) for seed, frames in enumerate([5, 12, 5, 1, 12, 5])]
    worst = max((got - decoder.decode(codes)).abs().max().item()
                for got, codes in zip(decoder.decode_batch(batch), batch))
    print(f"decode_batch vs alone: max |diff| {worst:.2e}")
    assert worst <= ATOL


# --- block-causal decoding -----------------------------------------------------------------------

SPLITS = {"1": [1] * 30, "2": [2] * 15, "3": [3] * 10, "uneven": [4, 1, 7, 2, 9, 5, 2], "whole": [30]}


@pytest.mark.parametrize("split", sorted(SPLITS))
def test_blocks_equal_one_shot(decoder, reference, split):
    codes = random_codes(30, 7)
    parts = decode_in_blocks(decoder, codes, SPLITS[split])
    assert [p.numel() for p in parts] == [size * SPF for size in SPLITS[split]]  # no lookahead, nothing held back
    worst = (torch.cat(parts) - reference_decode(reference, codes)).abs().max().item()
    print(f"blocks of {split} frames vs one-shot (30 frames, past the 8-frame window): max |diff| {worst:.2e}")
    assert worst <= ATOL


def test_states_are_not_modified(decoder):
    codes = random_codes(12, 2)
    [(_, state)] = decoder.decode_blocks([flat(codes[:, :9])], [decoder.init_state()])
    kept = [t.clone() for t in (*state.convs, *state.keys, *state.values)]
    assert isinstance(state, MimiState)
    [(first, new)] = decoder.decode_blocks([flat(codes[:, 9:])], [state])
    [(again, _)] = decoder.decode_blocks([flat(codes[:, 9:])], [state])
    assert torch.equal(first, again) and new is not state and new.steps == 2 * 12
    assert all(torch.equal(a, b) for a, b in zip(kept, (*state.convs, *state.keys, *state.values)))
    assert state.keys[0].shape[1] == TINY_MIMI_CONFIG["sliding_window"] - 1  # only the window is kept


def test_batched_blocks_equal_each_stream_alone(decoder):
    """Streams at different positions (fresh, young, past the window) and of different block
    lengths in one call each get their own audio and state."""
    lengths, seeds = [20, 31, 9, 26], [11, 12, 13, 14]
    streams = [random_codes(n, seed) for n, seed in zip(lengths, seeds)]
    alone = [decoder.decode(flat(codes)) for codes in streams]
    starts = [0, 12, 3, 17]  # frames each stream decodes alone before the batched calls
    states, parts = [], []
    for codes, start in zip(streams, starts):
        state, done = decoder.init_state(), []
        if start:
            [(audio, state)] = decoder.decode_blocks([flat(codes[:, :start])], [state])
            done.append(audio)
        states.append(state)
        parts.append(done)
    positions, worst = list(starts), 0.0
    while active := [i for i, codes in enumerate(streams) if positions[i] < codes.shape[1]]:
        # blocks of 3 and 2 frames: two groups per call, each with streams at different positions
        sizes = {i: min(2 if i % 2 else 3, streams[i].shape[1] - positions[i]) for i in active}
        out = decoder.decode_blocks([flat(streams[i][:, positions[i]:positions[i] + sizes[i]]) for i in active],
                                    [states[i] for i in active])
        for i, (audio, state) in zip(active, out):
            parts[i].append(audio)
            states[i] = state
            positions[i] += sizes[i]
    for i, codes in enumerate(streams):
        got = torch.cat(parts[i])
        assert got.numel() == alone[i].numel()
        worst = max(worst, (got - alone[i]).abs().max().item())
        # each state owns its tensors: none keeps a batch's activations alive
        assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size()
                   for t in (*states[i].convs, *states[i].keys, *states[i].values))
    print(f"batched blocks vs each stream alone: max |diff| {worst:.2e}")
    assert worst <= ATOL


def test_decode_blocks_checks_its_arguments(decoder):
    with pytest.raises(ValueError, match="one state per block"):
        decoder.decode_blocks([flat(random_codes(2, 0))], [])
    with pytest.raises(ValueError, match="init_state"):
        decoder.decode_blocks([flat(random_codes(2, 0))], [None])


# --- encoding ------------------------------------------------------------------------------------


def test_encode_equals_transformers_and_round_trips(decoder, reference):
    waveform = 0.1 * torch.randn(5 * SPF + 700, generator=torch.Generator().manual_seed(5))
    codes = decoder.encode(waveform)
    with torch.no_grad():
        expected = reference.encode(waveform[None, None]).audio_codes[0]
    assert expected.shape == (CODEBOOKS, 6)  # the partial last frame is padded to a whole one
    assert torch.equal(codes, flat(expected)) and codes.dtype == torch.long
    assert decoder.decode(codes).numel() == 6 * SPF


def test_encode_rejects_bad_waveforms(decoder):
    for bad in (torch.zeros(0), torch.zeros(2, SPF), torch.zeros(SPF, dtype=torch.long), [0.0] * SPF):
        with pytest.raises(ValueError):
            decoder.encode(bad)


# --- loading -------------------------------------------------------------------------------------


def test_csm_directory_gives_the_same_decoder(decoder, csm_dir):
    from_csm = load_audio_decoder("mimi", str(csm_dir))
    assert from_csm.tokens_per_frame == CODEBOOKS
    codes = flat(random_codes(9, 4))
    assert torch.equal(from_csm.decode(codes), decoder.decode(codes))
    waveform = 0.1 * torch.randn(3 * SPF, generator=torch.Generator().manual_seed(6))
    assert torch.equal(from_csm.encode(waveform), decoder.encode(waveform))


def test_module_names_layout_loads(decoder, mimi_dir, reference, tmp_path):
    """Tensors under MimiModel's own names (a plain state_dict) load like the published layout."""
    (tmp_path / "config.json").write_text((mimi_dir / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(tmp_path / "model.safetensors"))
    codes = flat(random_codes(4, 8))
    assert torch.equal(load_audio_decoder("mimi", str(tmp_path)).decode(codes), decoder.decode(codes))


def test_fewer_codebooks(mimi_dir, reference):
    few = load_audio_decoder("mimi", str(mimi_dir), {"num_codebooks": 3})
    assert few.tokens_per_frame == 3
    codes = random_codes(6, 9, codebooks=3)
    torch.testing.assert_close(few.decode(flat(codes)), reference_decode(reference, codes), atol=1e-6, rtol=0)
    waveform = 0.1 * torch.randn(2 * SPF, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = reference.encode(waveform[None, None], num_quantizers=3).audio_codes[0]
    assert torch.equal(few.encode(waveform), flat(expected))


@pytest.mark.parametrize("setting", [{"num_codebooks": 0}, {"num_codebooks": CODEBOOKS + 1}, {"num_codebooks": "8"},
                                     {"noise_seed": 1}])
def test_bad_settings(mimi_dir, setting):
    with pytest.raises(ValueError):
        load_audio_decoder("mimi", str(mimi_dir), setting)


def test_bad_directories(mimi_dir, tmp_path):
    with pytest.raises(FileNotFoundError):
        load_audio_decoder("mimi", str(mimi_dir / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="neither a Mimi config"):
        load_audio_decoder("mimi", str(tmp_path))
    config = json.loads((mimi_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "use_causal_conv": False}))
    with pytest.raises(ValueError, match="use_causal_conv"):
        load_audio_decoder("mimi", str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_size": 64, "upsample_groups": 64}))
    (tmp_path / "model.safetensors").write_bytes((mimi_dir / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="do not fit its config"):
        load_audio_decoder("mimi", str(tmp_path))


# --- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [
    flat(random_codes(2, 0)).clone().index_fill_(0, torch.tensor([5]), CODEBOOK_SIZE),  # out of range
    flat(random_codes(2, 0)).clone().index_fill_(0, torch.tensor([0]), -1),
    flat(random_codes(2, 0))[:-1],  # not whole frames
    torch.zeros(0, dtype=torch.long),
    random_codes(2, 0),  # 2-D
    flat(random_codes(2, 0)).float(),
])
def test_bad_codes(decoder, bad):
    with pytest.raises(ValueError):
        decoder.decode(bad)
    with pytest.raises(ValueError):
        decoder.decode_blocks([bad], [decoder.init_state()])
