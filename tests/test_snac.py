"""SNAC decoder: equality with the reference ``snac`` package, layout, validation, loading.

The reference package is used here only, to build randomly initialised models and to compute the
expected outputs. Decoding is compared with ``atol=1e-5`` (in practice the outputs differ by less
than 1e-6, the upsampling being a matrix product instead of torch's transposed convolution);
encoding must give identical codes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

snac = pytest.importorskip("snac")

from audio_pipeline.decoders import audio_decoder_class, available_audio_decoders, load_audio_decoder  # noqa: E402
from audio_pipeline.decoders.snac import (  # noqa: E402
    SNAC_24KHZ_CONFIG,
    SNACDecoder,
    codebooks_to_codes,
    codes_to_codebooks,
    receptive_field_frames,
)
from audio_pipeline.testing.random_decoders import TINY_SNAC_CONFIG, save_random_snac_checkpoint  # noqa: E402

ATOL = 1e-5
#: Tiny model with local attention in encoder and decoder (attended widths must be multiples of 64).
TINY_ATTN_CONFIG = {**TINY_SNAC_CONFIG, "encoder_dim": 4, "decoder_dim": 64, "attn_window_size": 8}


def _legacy_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``parametrizations.weight.original0/1`` -> ``weight_g/weight_v`` (the pre-2.1 torch style)."""
    out = {}
    for k, v in state.items():
        k = k.replace("parametrizations.weight.original0", "weight_g")
        k = k.replace("parametrizations.weight.original1", "weight_v")
        out[k] = v
    return out


def _write(directory: Path, cfg: dict, state: dict[str, torch.Tensor], fmt: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg))
    if fmt == "bin":
        torch.save(state, directory / "pytorch_model.bin")
    else:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"))
    return directory


def _reference(cfg: dict, seed: int) -> "snac.SNAC":
    torch.manual_seed(seed)
    return snac.SNAC(**cfg).eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(reference model, dir with legacy-key .bin, dir with new-key .safetensors)."""
    ref = _reference(TINY_SNAC_CONFIG, 1)
    state = ref.state_dict()
    # The installed package uses torch.nn.utils.parametrizations.weight_norm (new-style keys).
    assert any("parametrizations.weight.original0" in k for k in state)
    root = tmp_path_factory.mktemp("snac")
    bin_dir = _write(root / "bin", TINY_SNAC_CONFIG, _legacy_keys(state), "bin")
    st_dir = _write(root / "st", TINY_SNAC_CONFIG, state, "safetensors")
    return ref, bin_dir, st_dir


@pytest.fixture(scope="module")
def tiny_attn(tmp_path_factory):
    ref = _reference(TINY_ATTN_CONFIG, 2)
    state = ref.state_dict()
    assert any(k.endswith("rel_pos.inv_freq") for k in state)
    d = _write(tmp_path_factory.mktemp("snac_attn"), TINY_ATTN_CONFIG, _legacy_keys(state), "safetensors")
    return ref, d


pytestmark = pytest.mark.usefixtures("one_thread")


def _random_codes(frames: int, seed: int = 0, size: int = 4096) -> torch.Tensor:
    return torch.randint(0, size, (frames * 7,), generator=torch.Generator().manual_seed(seed))


def _ref_decode(ref, codes: torch.Tensor, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    with torch.inference_mode():
        return ref.decode([c[None] for c in codes_to_codebooks(codes)])[0, 0]


# ---------------------------------------------------------------------------- layout


def test_interleave_layout_and_round_trip():
    frames = 5
    c0, c1, c2 = torch.arange(frames), 100 + torch.arange(2 * frames), 1000 + torch.arange(4 * frames)
    codes = codebooks_to_codes([c0, c1, c2])
    for i in range(frames):
        assert codes[7 * i: 7 * i + 7].tolist() == [
            c0[i], c1[2 * i], c2[4 * i], c2[4 * i + 1], c1[2 * i + 1], c2[4 * i + 2], c2[4 * i + 3]]
    back = codes_to_codebooks(codes)
    assert [b.tolist() for b in back] == [c0.tolist(), c1.tolist(), c2.tolist()]
    flat = _random_codes(9)
    assert torch.equal(codebooks_to_codes(codes_to_codebooks(flat)), flat)
    batched = torch.stack([flat, flat.flip(0)])
    assert torch.equal(codebooks_to_codes(codes_to_codebooks(batched)), batched)
    with pytest.raises(ValueError):
        codes_to_codebooks(torch.zeros(8, dtype=torch.long))
    with pytest.raises(ValueError):
        codebooks_to_codes([c0, c1, c2[:-1]])


def test_traits_and_registry(tiny):
    assert "snac" in available_audio_decoders()
    assert audio_decoder_class("snac") is SNACDecoder
    assert SNACDecoder.tokens_per_frame == 7 and SNACDecoder.supports_block_causal is True
    dec = load_audio_decoder("snac", str(tiny[1]))
    assert isinstance(dec, SNACDecoder)
    assert dec.sample_rate == 24000 and dec.samples_per_frame == 2048
    assert dec.supports_block_causal == (dec.attn_window_size is None)
    assert dec.samples_per_token == pytest.approx(2048 / 7)
    assert dec.receptive_field_frames == receptive_field_frames(SNAC_24KHZ_CONFIG) == 3


# ---------------------------------------------------------------------------- reference equality


@pytest.mark.parametrize("fmt", ["bin", "st"])
@pytest.mark.parametrize("style", ["weight_g/weight_v", "parametrizations"])
def test_decode_matches_reference(tiny, tmp_path, fmt, style):
    ref = tiny[0]
    state = ref.state_dict() if style == "parametrizations" else _legacy_keys(ref.state_dict())
    dec = SNACDecoder.load(_write(tmp_path / "m", TINY_SNAC_CONFIG, state, fmt))
    for frames in (1, 3, 8):
        codes = _random_codes(frames, seed=frames)
        out = dec.decode(codes, generator=torch.Generator().manual_seed(7))
        expected = _ref_decode(ref, codes, seed=7)
        assert out.dtype == torch.float32 and out.device.type == "cpu"
        assert out.shape == (frames * 2048,)
        torch.testing.assert_close(out, expected, atol=ATOL, rtol=0)


def test_decode_global_rng_mode_matches_reference(tiny):
    ref, bin_dir, _ = tiny
    dec = SNACDecoder.load(bin_dir, {"noise_seed": None})
    codes = _random_codes(4)
    torch.manual_seed(123)
    out = dec.decode(codes)
    torch.testing.assert_close(out, _ref_decode(ref, codes, seed=123), atol=ATOL, rtol=0)


def test_decode_with_generator_and_without_noise(tiny):
    ref, bin_dir, _ = tiny
    dec = SNACDecoder.load(bin_dir)
    codes = _random_codes(3)
    out = dec.decode(codes, generator=torch.Generator().manual_seed(99))
    torch.testing.assert_close(out, _ref_decode(ref, codes, seed=99), atol=ATOL, rtol=0)
    # Reproducible by default: the same codes give the same audio on every call.
    assert torch.equal(dec.decode(codes), dec.decode(codes))
    # Noise disabled equals the reference with its noise blocks zeroed.
    quiet = SNACDecoder.load(bin_dir, {"noise_scale": 0.0})
    with torch.inference_mode():
        z = ref.quantizer.from_codes([c[None] for c in codes_to_codebooks(codes)])
        x = z
        for layer in ref.decoder.model:
            if isinstance(layer, snac.layers.DecoderBlock):
                for sub in layer.block:
                    if not isinstance(sub, snac.layers.NoiseBlock):
                        x = sub(x)
            else:
                x = layer(x)
    torch.testing.assert_close(quiet.decode(codes), x[0, 0], atol=ATOL, rtol=0)


def test_attention_model_matches_reference(tiny_attn):
    ref, d = tiny_attn
    dec = SNACDecoder.load(d, with_encoder=True)
    codes = _random_codes(4, seed=5)
    out = dec.decode(codes, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(out, _ref_decode(ref, codes, seed=3), atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="window"):
        dec.decode(_random_codes(3))  # 12 latent steps, window 8
    wav = 0.3 * torch.sin(torch.arange(20000) * 0.05) + 0.05 * torch.randn(20000, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = codebooks_to_codes([c[0] for c in ref.encode(wav[None, None])])
    assert torch.equal(dec.encode(wav), expected)


def test_encode_matches_reference_and_is_lazy(tiny):
    ref, bin_dir, st_dir = tiny
    gen = torch.Generator().manual_seed(1)
    wav = 0.5 * torch.sin(torch.arange(30000) * 0.03) * torch.rand(30000, generator=gen)
    with torch.inference_mode():
        expected = codebooks_to_codes([c[0] for c in ref.encode(wav[None, None])])
    for d in (bin_dir, st_dir):
        dec = SNACDecoder.load(d)
        assert dec._analysis is None  # serving without cloning does not build the encoder
        codes = dec.encode(wav)
        assert codes.dtype == torch.long and codes.dim() == 1
        assert codes.numel() == math.ceil(30000 / 2048) * 7
        assert torch.equal(codes, expected)
    eager = SNACDecoder.load(st_dir, {"with_encoder": True})
    assert eager._analysis is not None
    assert torch.equal(eager.encode(wav), expected)
    with pytest.raises(ValueError):
        eager.encode(wav[None])


# ---------------------------------------------------------------------------- behaviour


def test_each_frame_is_2048_samples_of_the_audio_a_longer_decode_gives_there(tiny):
    """N frames of codes are N x 2048 samples in [-1, 1], and they are the audio a longer decode of
    the same codes gives at those positions, up to the last receptive field (frames that have not
    heard the codes after them yet)."""
    dec = SNACDecoder.load(tiny[2])
    rf, spf = dec.receptive_field_frames, dec.samples_per_frame
    codes = _random_codes(12, seed=12)
    whole = dec.decode(codes)
    for frames in (1, 4, 7, 10):
        out = dec.decode(codes[:7 * frames])
        assert out.shape == (frames * spf,)
        assert out.abs().max() <= 1.0 and torch.isfinite(out).all()
        settled = (frames - rf) * spf if frames > rf else 0
        torch.testing.assert_close(out[:settled], whole[:settled], atol=ATOL, rtol=0)


def test_bad_codes_rejected(tiny):
    dec = SNACDecoder.load(tiny[2])
    codes = _random_codes(2)
    bad = codes.clone()
    bad[12] = 4096
    with pytest.raises(ValueError, match=r"position 12 .*codebook 2"):
        dec.decode(bad)
    bad = codes.clone()
    bad[8] = -1
    with pytest.raises(ValueError, match=r"position 8 .*codebook 1"):
        dec.decode(bad)
    for wrong in (codes[:-1], codes[:0], codes.reshape(2, 7), codes.float()):
        with pytest.raises(ValueError):
            dec.decode(wrong)
    with pytest.raises(ValueError):
        dec.decode_batch([codes, bad])
    assert torch.equal(dec.decode(codes.int()), dec.decode(codes))  # other integer dtypes give the same audio


def test_decode_batch_equals_per_item(tiny):
    for noise_seed in (0, None):
        dec = SNACDecoder.load(tiny[1], {"noise_seed": noise_seed, "noise_scale": 0.0 if noise_seed is None else 1.0})
        batch = [_random_codes(n, seed=i) for i, n in enumerate((3, 1, 3, 5, 1, 3))]
        outs = dec.decode_batch(batch)
        assert len(outs) == len(batch)
        for codes, out in zip(batch, outs):
            torch.testing.assert_close(out, dec.decode(codes), atol=ATOL, rtol=0)
    small_runs = SNACDecoder.load(tiny[1], {"max_batch_frames": 4})  # the 3-frame group: 3 runs
    for codes, out in zip(batch, small_runs.decode_batch(batch)):
        torch.testing.assert_close(out, small_runs.decode(codes), atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="max_batch_frames"):
        SNACDecoder.load(tiny[1], {"max_batch_frames": 0})
    dec = SNACDecoder.load(tiny[1])
    gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
    outs = dec.decode_batch(batch[:3], generators=gens + [torch.Generator().manual_seed(3)])
    torch.testing.assert_close(outs[2], dec.decode(batch[2], generator=torch.Generator().manual_seed(3)), atol=ATOL, rtol=0)
    offsets = [0, 5, 9, 2, 700, 0]
    for codes, off, out in zip(batch, offsets, dec.decode_batch(batch, frame_offsets=offsets)):
        torch.testing.assert_close(out, dec.decode(codes, frame_offset=off), atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="offset"):
        dec.decode_batch(batch, frame_offsets=[0])
    with pytest.raises(ValueError, match="offset"):
        dec.decode(batch[0], frame_offset=-1)


def test_positional_noise_makes_windows_match_one_shot(tiny):
    """A window decoded with its frame offset reproduces the one-shot audio away from its edges."""
    dec = SNACDecoder.load(tiny[1])
    rf, spf, frames = dec.receptive_field_frames, dec.samples_per_frame, 20
    codes = _random_codes(frames, seed=11)
    whole = dec.decode(codes)
    start, stop = 5, 16
    window = dec.decode(codes[7 * start: 7 * stop], frame_offset=start)
    inner = slice((start + rf) * spf, (stop - rf) * spf)
    torch.testing.assert_close(window[rf * spf: (stop - start - rf) * spf], whole[inner], atol=ATOL, rtol=0)
    # The noise matters: without the offset, or without noise, the window differs.
    shifted = dec.decode(codes[7 * start: 7 * stop])
    assert (shifted[rf * spf: (stop - start - rf) * spf] - whole[inner]).abs().max() > 1e-3
    # The positional tables repeat after NOISE_PERIOD_FRAMES frames.
    from audio_pipeline.decoders.snac import NOISE_PERIOD_FRAMES

    assert torch.equal(dec.decode(codes, frame_offset=NOISE_PERIOD_FRAMES), whole)
    other_seed = SNACDecoder.load(tiny[1], {"noise_seed": 1})
    assert not torch.equal(other_seed.decode(codes), whole)


def test_receptive_field_is_respected(tiny):
    dec = SNACDecoder.load(tiny[2], {"noise_scale": 0.0})
    rf, spf, frames, k = dec.receptive_field_frames, dec.samples_per_frame, 13, 6
    codes = _random_codes(frames, seed=3)
    changed = codes.clone()
    changed[7 * k: 7 * k + 7] = (changed[7 * k: 7 * k + 7] + 1234) % 4096
    diff = (dec.decode(codes) - dec.decode(changed)).abs().reshape(frames, spf).amax(dim=1)
    assert (diff[: k - rf] == 0).all() and (diff[k + rf + 1:] == 0).all()
    assert diff[k - rf] > 0 or diff[k + rf] > 0  # the figure is tight
    assert receptive_field_frames({**SNAC_24KHZ_CONFIG, "attn_window_size": 32}) > 3


@pytest.mark.parametrize("stride", [2, 3, 4, 8])
def test_upsampling_by_matrix_product_equals_the_transposed_convolution(stride):
    from audio_pipeline.decoders.snac_layers import Conv

    gen = torch.Generator().manual_seed(stride)
    conv = Conv(6, 5, 2 * stride, "up", stride=stride, padding=math.ceil(stride / 2), output_padding=stride % 2,
                transposed=True)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=gen))
        conv.bias.copy_(torch.randn(5, generator=gen))
    assert conv.upsamples_by_matmul
    for steps in (1, 2, 5):
        x = torch.randn(2, 6, steps, generator=gen)
        expected = torch.nn.functional.conv_transpose1d(x, conv.weight, conv.bias, stride, conv.padding,
                                                        conv.output_padding)
        with torch.no_grad():
            torch.testing.assert_close(conv(x), expected, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------- loading errors


def test_missing_files(tmp_path, tiny):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        SNACDecoder.load(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="no SNAC weights"):
        SNACDecoder.load(tmp_path)
    (tmp_path / "model.safetensors").write_bytes((tiny[2] / "model.safetensors").read_bytes())
    with pytest.raises(FileNotFoundError, match="config.json"):
        SNACDecoder.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(TINY_SNAC_CONFIG))
    assert SNACDecoder.load(tmp_path / "model.safetensors").sample_rate == 24000  # a file path works too


def test_bad_configs_and_state(tmp_path, tiny):
    ref = tiny[0]
    state = ref.state_dict()
    _write(tmp_path / "strides", {**TINY_SNAC_CONFIG, "vq_strides": [8, 4, 2, 1]}, state, "st")
    with pytest.raises(ValueError, match="vq_strides"):
        SNACDecoder.load(tmp_path / "strides")
    _write(tmp_path / "rates", {**TINY_SNAC_CONFIG, "decoder_rates": [8, 8, 4, 4]}, state, "st")
    with pytest.raises(ValueError, match="decoder_rates"):
        SNACDecoder.load(tmp_path / "rates")
    with pytest.raises(ValueError, match="unknown SNAC decoder setting 'bogus'"):
        SNACDecoder.load(tiny[2], {"bogus": 1})
    missing = {k: v for k, v in state.items() if not k.startswith("decoder.model.3.")}
    _write(tmp_path / "missing", TINY_SNAC_CONFIG, missing, "st")
    with pytest.raises(ValueError, match=r"missing, e\.g\. \['decoder\.model\.3\."):
        SNACDecoder.load(tmp_path / "missing")
    _write(tmp_path / "extra", TINY_SNAC_CONFIG, {**state, "decoder.extra.weight": torch.zeros(1)}, "st")
    with pytest.raises(ValueError, match=r"unexpected.*decoder\.extra\.weight"):
        SNACDecoder.load(tmp_path / "extra")
    _write(tmp_path / "shape", {**TINY_SNAC_CONFIG, "decoder_dim": 64}, state, "st")
    with pytest.raises(ValueError, match="shape"):
        SNACDecoder.load(tmp_path / "shape")
    # A checkpoint without encoder tensors still decodes; encode then says what is missing.
    decoder_only = {k: v for k, v in state.items() if not k.startswith("encoder.")}
    _write(tmp_path / "deconly", TINY_SNAC_CONFIG, decoder_only, "bin")
    dec = SNACDecoder.load(tmp_path / "deconly")
    assert torch.equal(dec.decode(_random_codes(1)), SNACDecoder.load(tiny[2]).decode(_random_codes(1)))
    with pytest.raises(ValueError, match="encoder.block.0"):
        dec.encode(torch.zeros(4096))


# ---------------------------------------------------------------------------- random checkpoints


@pytest.mark.parametrize("use_safetensors", [True, False])
def test_save_random_checkpoint(tmp_path, use_safetensors):
    d = save_random_snac_checkpoint(tmp_path / "m", seed=4, safetensors=use_safetensors, **TINY_SNAC_CONFIG)
    assert (d / ("model.safetensors" if use_safetensors else "pytorch_model.bin")).is_file()
    dec = SNACDecoder.load(d)
    out = dec.decode(_random_codes(4))
    assert torch.isfinite(out).all() and out.abs().max() <= 1.0
    assert out.std() > 1e-3  # audible, not silence
    assert out.std() < 0.9  # and not saturated
    # Published layout: the reference package loads it too and decodes the same audio.
    if not use_safetensors:
        ref = snac.SNAC(**json.loads((d / "config.json").read_text())).eval()
        ref.load_state_dict(torch.load(d / "pytorch_model.bin", weights_only=True))
        codes = _random_codes(4)
        out = dec.decode(codes, generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(out, _ref_decode(ref, codes, seed=0), atol=ATOL, rtol=0)
    # Same seed, same model; another seed, another model.
    again = SNACDecoder.load(save_random_snac_checkpoint(tmp_path / "again", seed=4, **TINY_SNAC_CONFIG))
    other = SNACDecoder.load(save_random_snac_checkpoint(tmp_path / "other", seed=5, **TINY_SNAC_CONFIG))
    codes = _random_codes(2)
    assert torch.equal(again.decode(codes), dec.decode(codes))
    assert not torch.equal(other.decode(codes), dec.decode(codes))


def test_lower_precision_load(tiny):
    dec = SNACDecoder.load(tiny[2], dtype=torch.bfloat16)
    codes = _random_codes(2)
    out = dec.decode(codes)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    full = SNACDecoder.load(tiny[2]).decode(codes)
    assert (out - full).abs().max() < 0.2
