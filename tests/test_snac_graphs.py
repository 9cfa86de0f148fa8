"""SNAC's captured batched decode (decoders/snac_graphs.py): on the CPU, the function a graph holds
run on the graphs' own buffers (``capture=False``) gives decode_batch's audio: bucket padding, rows
beyond the largest bucket, buffers left over from an earlier call, each row's noise offset. The
replays themselves run in tests/test_cuda.py."""

from __future__ import annotations

import pytest
import torch

from audio_pipeline.decoders import load_audio_decoder
from audio_pipeline.testing.random_decoders import save_random_snac_checkpoint
from audio_pipeline.decoders.snac_graphs import SNACGraphs

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return save_random_snac_checkpoint(tmp_path_factory.mktemp("snac-graphs") / "snac", seed=4)


def _codes(count: int, frames: int, seed: int) -> tuple[torch.Tensor, list[int]]:
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 4096, (count, frames * 7), generator=generator)
    return codes, torch.randint(0, 900, (count,), generator=generator).tolist()


def test_the_buffered_call_gives_each_windows_eager_audio(weights):
    decoder = load_audio_decoder("snac", str(weights))
    assert decoder.graphs is None  # off by default (and on the CPU there is nothing to capture)
    graphs = SNACGraphs(decoder, buckets=(1, 2, 4, 8), capture=False)
    # (windows, frames): a bucket filled, one padded, one longer than the largest bucket (8 + 3 in
    # the bucket of 4 the first call filled), then 3 rows there again (its fourth row left over).
    for count, frames, seed in ((4, 2, 0), (3, 3, 1), (11, 2, 2), (3, 2, 3), (1, 5, 4)):
        codes, offsets = _codes(count, frames, seed)
        want = decoder.decode_batch(list(codes), frame_offsets=offsets)
        got = graphs.decode(codes, offsets)
        assert got.shape == (count, frames * decoder.samples_per_frame) and got.device.type == "cpu"
        for row, expected in zip(got, want):
            torch.testing.assert_close(row, expected, atol=1e-6, rtol=0)
    assert graphs.shapes == [(2, 4), (3, 4), (2, 8), (5, 1)]
    assert graphs.replays == 6  # 11 rows: one call of 8 and one of 4


def test_the_noise_follows_each_rows_offset(weights):
    """Rows with the same codes and different offsets differ; with the same offset they agree."""
    decoder = load_audio_decoder("snac", str(weights))
    graphs = SNACGraphs(decoder, capture=False)
    codes, _ = _codes(1, 3, 5)
    audio = graphs.decode(codes.expand(3, -1), [0, 7, 0])
    torch.testing.assert_close(audio[0], audio[2], atol=0, rtol=0)
    assert (audio[0] - audio[1]).abs().max() > 1e-3


def test_long_windows_and_shapes_past_the_limit_are_left_to_the_eager_call(weights):
    decoder = load_audio_decoder("snac", str(weights))
    graphs = SNACGraphs(decoder, buckets=(1, 2), max_frames=4, max_graphs=2, capture=False)
    codes, offsets = _codes(2, 5, 6)
    assert graphs.decode(codes, offsets) is None  # 5 frames > max_frames
    assert graphs.decode(*_codes(1, 2, 7)) is not None
    assert graphs.decode(*_codes(2, 3, 8)) is not None
    assert graphs.decode(*_codes(1, 4, 9)) is None  # a third shape: the limit of 2 graphs
    assert graphs.shapes == [(2, 1), (3, 2)]
    # decode_batch decodes what the graphs leave eagerly, with the same audio.
    decoder.graphs = graphs
    want = load_audio_decoder("snac", str(weights)).decode_batch(list(codes), frame_offsets=offsets)
    for got, expected in zip(decoder.decode_batch(list(codes), frame_offsets=offsets), want):
        torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_global_rng_noise_is_refused():
    """A graph holds fixed noise; torch's global RNG (noise_seed None) draws anew each call."""
    class Decoder:
        has_noise, noise_scale, noise_seed = True, 1.0, None

    with pytest.raises(ValueError, match="positional noise"):
        SNACGraphs(Decoder(), capture=False)


@pytest.mark.parametrize("settings, message", [
    ({"cuda_graphs": True}, "cuda_graphs=true needs the decoder on a CUDA device"),
    ({"cuda_graphs": "auto"}, "cuda_graphs must be true or false"),
    ({"cuda_graph_max_frames": 0}, "cuda_graph_max_frames must be a positive integer"),
    ({"cuda_graph_max_frames": True}, "cuda_graph_max_frames must be a positive integer"),
])
def test_bad_graph_settings_are_named(weights, settings, message):
    with pytest.raises(ValueError, match=message):
        load_audio_decoder("snac", str(weights), settings)


def test_graphs_off_decode_eagerly(weights):
    assert load_audio_decoder("snac", str(weights), {"cuda_graphs": False, "cuda_graph_max_frames": 8}).graphs is None


def test_prepare_captures_every_bucket_of_the_schedules_windows(weights):
    """The engine captures at start-up what its chunk schedule will decode: here chunks of 28 then
    56 tokens with 28 of left context make windows of 28 and 84 tokens (4 and 12 frames)."""
    from audio_pipeline.decoders.chunker import ChunkSchedule

    assert ChunkSchedule([28, 56], buffer=28).steady_window_lengths() == [28, 84]
    assert ChunkSchedule([28, 56], buffer=28, block_causal=True).steady_window_lengths() == [28, 56]
    assert ChunkSchedule([14], buffer=0).steady_window_lengths(tokens=100) == [14]
    graphs = SNACGraphs(load_audio_decoder("snac", str(weights)), buckets=(1, 4), max_frames=8, capture=False)
    graphs.prepare([4, 12])  # 12 frames: beyond max_frames, left to the eager call
    assert graphs.shapes == [(4, 1), (4, 4)] and graphs.replays == 0
