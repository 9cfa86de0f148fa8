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
