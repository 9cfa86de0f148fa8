"""The serving benchmark: its playback-stall rule, and one end-to-end run against a real server
(figures are never asserted, only that every stream is measured and reported)."""

import re

import pytest
import torch

from audio_pipeline.bench.serve import main, percentile, playback_stall

#: Real servers and whole voices: left out of the quick subset (scripts/test.sh -m "not slow").
pytestmark = pytest.mark.slow


def test_a_player_waits_only_when_a_chunk_arrives_after_the_audio_before_it_ran_out():
    # Chunks of 0.5 s arriving every 0.5 s: the player never waits.
    assert playback_stall([(10.0, 0.5), (10.5, 0.5), (11.0, 0.5)]) == pytest.approx(0.0)
    # The third chunk comes 0.3 s after the first second of audio has played.
    assert playback_stall([(10.0, 0.5), (10.4, 0.5), (11.3, 0.5)]) == pytest.approx(0.3)
    # Early chunks build a lead that later late ones use up.
    assert playback_stall([(0.0, 2.0), (0.1, 0.1), (2.15, 1.0)]) == pytest.approx(0.05)
    assert playback_stall([]) == float("inf")
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([1.0, 2.0, 3.0, 4.0], 99) == 4.0


def test_the_serving_benchmark_runs_against_a_real_server_and_reports_every_stream(capsys):
    threads = torch.get_num_threads()
    try:
        assert main(["--streams", "1,2", "--no-search", "--context", "32", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "plain padded forward" in out and "server: serve" in out
    rows = {int(m.group(1)): m.group(2) for m in re.finditer(r"^\s+(\d+)\s+\d+\s+\d+\s+[\d.]+\s+(\d+/\d+)", out, re.M)}
    assert set(rows) == {1, 2} and rows[2].endswith("/2")
    assert re.search(r"engine time per decode forward pass at N=1: [\d.]+ ms", out)
    # The built-in voice samples two tokens per 20 ms frame: about 100 passes per second of audio.
    budget = re.search(r"forward passes per second of audio \(N=1\): ([\d.]+); real time needs a forward pass "
                       r"of batch N within ([\d.]+) ms", out)
    assert budget and 60 < float(budget.group(1)) < 140
    assert float(budget.group(2)) == pytest.approx(1000 / float(budget.group(1)), rel=0.01)


def test_the_random_model_benchmark_forces_fixed_length_streams_and_reports_the_bandwidth_floor(capsys):
    """--random-model serves a model of a real shape drawn at load (here the tiny one, on the CPU):
    every stream is exactly --utterance-tokens long, and each N's step time is set against the
    memory-bandwidth floor measured in the same run."""
    assert main(["--random-model", "orpheus-tiny", "--device", "cpu", "--streams", "1,2", "--no-search",
                 "--utterance-tokens", "56"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"orpheus-tiny on cpu: a decode step reads [\d.]+ GB of weights .* copy bandwidth \d+ GB/s", out)
    rows = {int(m.group(1)): m.group(2) for m in re.finditer(r"^\s+(\d+)\s+\d+\s+\d+\s+[\d.]+\s+(\d+/\d+)", out, re.M)}
    assert set(rows) == {1, 2}
    for count in (1, 2):
        assert re.search(rf"N={count}: [\d.]+ ms per forward pass .* bandwidth floor [\d.]+ ms at mean context 58: "
                         r"[\d.]+x the floor", out)


def test_a_random_orpheus_3b_has_the_real_models_shape(tmp_path):
    """The GPU benchmark's model: Orpheus-3B's config (Llama 3.2 3B) and a decoder, no checkpoint."""
    import json

    from audio_pipeline.bench.serve import StepFloor
    from audio_pipeline.layouts.manifest import ModelManifest
    from audio_pipeline.models.random_models import write_random_model

    model_dir = write_random_model(tmp_path / "m", "orpheus-3b")
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"]) == (3072, 28, 8)
    assert ModelManifest.read(model_dir).random_weights and not list(model_dir.glob("*.safetensors"))
    weights = StepFloor.of("orpheus-3b", "cpu", 2).weight_bytes
    assert 5.5e9 < weights < 6.6e9  # 3.2 B parameters in bf16, less most of the 156,940-row table
