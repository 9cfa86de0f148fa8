"""The NeuCodec decoder against transformers' NeuCodecModel on a tiny random checkpoint: decoding,
batching, encoding (the reference encoder's padding and features), loading, and what its
non-causal decoder means for pieces of a stream."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import NeuCodecModel

from audio_pipeline.decoders import audio_decoder_class, load_audio_decoder
from audio_pipeline.decoders.neucodec import NeuCodecDecoder
from audio_pipeline.testing.random_decoders import save_random_neucodec_checkpoint
from helpers import warble


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_random_neucodec_checkpoint(tmp_path_factory.mktemp("neucodec"), seed=0)


@pytest.fixture(scope="module")
def decoder(checkpoint):
    return load_audio_decoder("neucodec", str(checkpoint))


@pytest.fixture(scope="module")
def reference(checkpoint):
    return NeuCodecModel.from_pretrained(str(checkpoint)).eval()


def codes(frames, seed):
    return torch.randint(0, 65536, (frames,), generator=torch.Generator().manual_seed(seed))


def test_the_published_rates_and_codebook(decoder):
    assert audio_decoder_class("neucodec") is NeuCodecDecoder
    assert (decoder.sample_rate, decoder.samples_per_frame, decoder.tokens_per_frame) == (24000, 480, 1)
    assert (decoder.encode_rate, decoder.encode_hop, decoder.codebook_size) == (16000, 320, 65536)
    assert decoder.supports_encoding and not decoder.supports_block_causal
    assert decoder.receptive_field_frames == float("inf")


def test_decode_is_transformers_decode(decoder, reference):
    for frames in (1, 7, 30):
        ours = decoder.decode(codes(frames, frames))
        with torch.no_grad():
            theirs = reference.decode(codes(frames, frames)[None, None]).audio_values[0, 0]
        assert ours.shape == (frames * 480,) and ours.dtype == torch.float32
        torch.testing.assert_close(ours, theirs.clamp(-1, 1), atol=1e-5, rtol=0)  # float32 rounding
    assert 0.02 < decoder.decode(codes(30, 1)).std() < 0.5  # audible, inside the clamp


def test_a_batch_of_mixed_lengths_decodes_each_as_alone(decoder):
    batch = [codes(5, 1), codes(9, 2), codes(5, 3), codes(1, 4)]
    for wave, alone in zip(decoder.decode_batch(batch), batch):
        torch.testing.assert_close(wave, decoder.decode(alone), atol=1e-5, rtol=0)


def test_decoding_in_pieces_is_not_decoding_whole(decoder):
    """Not causal (module docstring): the first half's audio depends on the second half's codes."""
    whole = codes(40, 5)
    first = decoder.decode(whole[:20])
    assert (decoder.decode(whole)[:20 * 480] - first).abs().max() > 1e-3


def test_encode_is_transformers_encode_of_the_reference_encoders_inputs(decoder, reference):
    rate = decoder.sample_rate
    wave = torch.from_numpy(warble(1.3, rate))
    audio, features = decoder.prepare(wave)
    # 1.3 s at 16 kHz (20,800 samples) padded with 1 to 320 zeros: 20,800 is whole frames, so 320.
    assert audio.shape == (1, 1, 20800 + 320) and torch.count_nonzero(audio[..., 20800:]) == 0
    assert features.shape[0] == 1 and features.shape[2] == 160
    ours = decoder.encode(wave)
    with torch.no_grad():
        theirs = reference.encode(audio, input_features=features).audio_codes
    assert ours.dtype == torch.long and ours.dim() == 1
    assert torch.equal(ours, theirs[0, 0].long())
    assert ours.numel() == 65  # one code per 20 ms of the padded audio (66 frames of acoustic steps, 65 semantic)


def test_the_encoder_is_read_on_first_encode_only(checkpoint):
    decoder = load_audio_decoder("neucodec", str(checkpoint))
    assert {name for name, _ in decoder.parts.named_children()} == {"quantizer", "acoustic_decoder"}
    decoder.encode(torch.zeros(4800))
    assert "semantic_encoder" in dict(decoder.parts.named_children())


def test_bad_codes_and_bad_directories_are_clear_errors(decoder, checkpoint, tmp_path):
    with pytest.raises(ValueError, match=r"code 65536 at position 1 \(frame 1\) is outside \[0, 65536\)"):
        decoder.decode(torch.tensor([0, 65536]))
    with pytest.raises(ValueError, match="non-empty whole number"):
        decoder.decode(torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="unknown NeuCodec decoder settings"):
        NeuCodecDecoder.load(str(checkpoint), {"num_codebooks": 1})
    with pytest.raises(FileNotFoundError, match="must be a directory"):
        NeuCodecDecoder.load(str(tmp_path / "missing"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mimi"}))
    with pytest.raises(ValueError, match="model_type must be 'neucodec'"):
        NeuCodecDecoder.load(str(tmp_path))
    config = json.loads((checkpoint / "config.json").read_text())
    wider = tmp_path / "wider"
    wider.mkdir()
    (wider / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    (wider / "model.safetensors").symlink_to(checkpoint / "model.safetensors")
    with pytest.raises(ValueError, match="tensors do not fit its config: 0 missing .* of another shape"):
        NeuCodecDecoder.load(str(wider))
