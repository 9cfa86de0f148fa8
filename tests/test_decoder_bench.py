"""The decoder benchmark runs end to end and prints its tables (figures are never asserted)."""

import torch

from audio_pipeline.bench.decoder import main


def test_the_decoder_benchmark_prints_throughput_and_time_to_first_audio(capsys):
    threads = torch.get_num_threads()
    try:
        assert main(["--decoder", "causal-conv", "--streams", "1,2", "--seconds", "0.5", "--repeats", "1",
                     "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "batched / per stream" in out and "time to first audio" in out
    rows = [line.split("|") for line in out.splitlines() if line.strip().startswith(("1 |", "2 |"))]
    assert [int(row[0]) for row in rows] == [1, 2] and all(float(row[1]) > 0 for row in rows)


def test_it_benchmarks_a_vocoder_with_its_own_code_limits(capsys, tmp_path):
    """The built-in voice's vocoder takes codes within each frame position's limit (a prosody code
    past its f0 and gain levels is refused): the benchmark draws them so, and runs block-causally."""
    from audio_pipeline.decoders.mcep import DEFAULT_CONFIG, save_mcep_decoder

    codebook = torch.randn(16, DEFAULT_CONFIG["order"] + len(DEFAULT_CONFIG["aperiodicity_bands"]) - 1).numpy() * 0.1
    weights = save_mcep_decoder(tmp_path / "mcep", codebook)
    assert main(["--decoder", "mcep", "--weights", str(weights), "--streams", "1,2", "--chunk", "160",
                 "--chunk-size", "32,160", "--block-causal", "--seconds", "1", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "decoder mcep" in out and "block-causal" in out and "time to first audio" in out
