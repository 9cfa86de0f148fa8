"""Mimi as a Kyutai TTS checkpoint stores it (decoders/mimi_moshi.py): loaded from the model
directory, it turns each fixture case's frames into the reference's audio (simple_generate's:
the frames after the audio delay, the first two frames' audio dropped, cut at the end step), in
one call and in streamed blocks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from audio_pipeline.decoders.mimi import MimiDecoder
from audio_pipeline.decoders.mimi_moshi import PUBLISHED_CONFIG, transformers_config

FIXTURES = Path(__file__).parent / "fixtures" / "kyutai_tts"
CASES = sorted(p.name for p in (FIXTURES / "cases").iterdir())


@pytest.fixture(scope="module")
def decoders():
    return {variant: MimiDecoder.load(FIXTURES / "models" / variant) for variant in ("distilled", "plain")}


def _served_codes(name: str, item: int) -> tuple[torch.Tensor, np.ndarray]:
    """(the codes the served audio is decoded from, the reference's audio)."""
    directory = FIXTURES / "cases" / name
    case = json.loads((directory / "case.json").read_text())
    frames = np.load(directory / "frames.npy")
    start, end = case["delay_steps"], case["end_steps"][item]
    return torch.tensor(frames[start:start + 2 + end, item, 1:]), np.load(directory / f"audio_{item}.npy")


@pytest.mark.parametrize("name", CASES)
def test_decoded_audio_equals_the_references(name, decoders):
    case = json.loads((FIXTURES / "cases" / name / "case.json").read_text())
    decoder = decoders[case["checkpoint"]]
    for item in range(len(case["script"])):
        codes, reference = _served_codes(name, item)
        if codes.shape[1] < decoder.tokens_per_frame:  # fewer codebooks generated: decoded with those only
            decoder = MimiDecoder.load(FIXTURES / "models" / case["checkpoint"], {"num_codebooks": codes.shape[1]})
        audio = decoder.decode(codes.reshape(-1))[2 * decoder.samples_per_frame:]
        np.testing.assert_allclose(audio.numpy(), reference, atol=1e-4, rtol=0)
        state, pieces = decoder.init_state(), []
        for start in range(0, codes.shape[0], 3):
            [(block, state)] = decoder.decode_blocks([codes[start:start + 3].reshape(-1)], [state])
            pieces.append(block)
        streamed = torch.cat(pieces)[2 * decoder.samples_per_frame:]
        np.testing.assert_allclose(streamed.numpy(), reference, atol=1e-4, rtol=0)


def test_the_published_codec_config_translates():
    config = transformers_config(PUBLISHED_CONFIG, Path("published"))
    assert (config["hidden_size"], config["num_quantizers"], config["codebook_size"]) == (512, 32, 2048)
    assert (config["sliding_window"], config["num_hidden_layers"], config["head_dim"]) == (250, 8, 64)
    assert config["upsampling_ratios"] == [8, 6, 5, 4]


def test_an_unknown_tensor_and_a_missing_codec_are_named(tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    source = FIXTURES / "models" / "distilled"
    target = tmp_path / "model"
    shutil.copytree(source, target)
    tensors = load_file(str(target / "mimi_tiny.safetensors"))
    save_file({**tensors, "extra.weight": torch.zeros(1)}, str(target / "mimi_tiny.safetensors"))
    with pytest.raises(ValueError, match="extra.weight"):
        MimiDecoder.load(target)
    (target / "mimi_tiny.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="mimi_name"):
        MimiDecoder.load(target)
