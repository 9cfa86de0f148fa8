"""The open-loop benchmark: its Poisson schedule, its verdict per rate, its search, and a run through
a real server over both doors (figures are never asserted, only that each is measured and reported)."""

import math
import re
import statistics

import pytest

from audio_pipeline.audio.playback import Playback
from audio_pipeline.bench.open_loop import Outcome, RateRun, arrival_times, main, search
from audio_pipeline.bench.serve import main as serve_main
from audio_pipeline.bench.texts import EVERYDAY


def test_arrivals_are_a_poisson_process_at_the_rate_and_the_same_every_run():
    times = arrival_times(8.0, 500.0, seed=0)
    assert times == arrival_times(8.0, 500.0, seed=0) != arrival_times(8.0, 500.0, seed=1)
    assert all(0 <= t < 500 for t in times) and times == sorted(times)
    gaps = [b - a for a, b in zip(times, times[1:])]
    # 4,000 exponential gaps of mean 1/8: the mean within 5 %, the spread of an exponential (sd = mean).
    assert len(times) == pytest.approx(4000, rel=0.05)
    assert statistics.mean(gaps) == pytest.approx(0.125, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(0.125, rel=0.1)


def test_the_text_pool_is_everyday_sentences_of_5_to_25_words():
    assert len(EVERYDAY) >= 30
    assert all(5 <= len(text.split()) <= 25 for text in EVERYDAY)
    assert any("?" in t for t in EVERYDAY) and any("$" in t for t in EVERYDAY)
    assert any(re.search(r"\d", t) for t in EVERYDAY)


def outcome(audible: float, stalls: int = 0, status: str = "ok") -> Outcome:
    playback = Playback()
    playback.underruns = stalls
    return Outcome(sent=0.0, text="x", status=status, audible=audible, playback=playback)


def test_a_rate_passes_only_with_no_stall_nothing_refused_and_audible_p95_within_the_limit():
    good = [outcome(0.05) for _ in range(18)] + [outcome(0.12), outcome(0.12)]
    assert RateRun(4, 30, good).passes(0.15)
    assert not RateRun(4, 30, good).passes(0.10)  # the p95 of 20 (nearest rank) is the 19th value
    assert not RateRun(4, 30, good[:-1] + [outcome(0.05, stalls=1)]).passes(0.15)
    assert not RateRun(4, 30, good[:-1] + [outcome(math.nan, status="refused")]).passes(0.15)
    # A request that never became audible counts as infinitely late.
    assert not RateRun(4, 30, good[:-2] + [outcome(math.nan)] * 2).passes(10.0)
    assert not RateRun(4, 30, []).passes(0.15)


def test_the_search_brackets_the_highest_passing_rate_to_its_precision():
    capacity = 11.3
    probed = []

    def probe(rate):
        probed.append(rate)
        return RateRun(rate, 30, [outcome(0.05 if rate <= capacity else 0.5)])

    measured = {1.0: probe(1.0), 4.0: probe(4.0)}
    best = search(measured, lambda r: measured.setdefault(r, probe(r)), 0.15, 0.1, 256)
    assert best <= capacity and best >= capacity / 1.1 - 0.01
    assert probed[2:4] == [8.0, 16.0]  # doubling past the best measured, then bisecting


@pytest.mark.slow
@pytest.mark.parametrize("door", ["http", "grpc"])
def test_the_open_loop_benchmark_measures_every_request_through_a_real_server(door, tiny_model_dir, capsys):
    assert main(["--rps", "3", "--duration", "2", "--warmup", "0.5", "--door", door, "--model", str(tiny_model_dir),
                 "--device", "cpu", "--task-arg", "chunk_size=7,14", "--task-arg", "sampling.max_tokens=70"]) == 0
    out = capsys.readouterr().out
    assert f"door {door}" in out
    row = re.search(r"^\s+3\.00\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)(.*)$", out, re.M)
    assert row, out
    sent, done, refused, failed = (int(row.group(i)) for i in range(1, 5))
    assert sent >= 1 and done + refused + failed == sent and failed == 0
    # Every figure of the row is measured: percentiles, RTF, load and the server's own underrun count.
    assert "nan" not in row.group(6) and "-" not in row.group(6).split()


@pytest.mark.slow
def test_the_serving_benchmark_runs_the_open_loop_one_with_arrival_poisson(tiny_model_dir, capsys):
    assert serve_main(["--arrival", "poisson", "--rps", "2", "--duration", "1", "--warmup", "0", "--no-search",
                       "--door", "grpc", "--model", str(tiny_model_dir), "--device", "cpu",
                       "--task-arg", "sampling.max_tokens=56"]) == 0
    out = capsys.readouterr().out
    assert "open loop: Poisson arrivals" in out and re.search(r"^\s+2\.00\s+\d+", out, re.M)
