"""The serving benchmark: its playback-stall rule, and one end-to-end run against a real server
(figures are never asserted, only that every stream is measured and reported)."""

import re

import pytest
import torch

from audio_pipeline.bench.serve import (
    FLOOR_HEADER,
    PassCost,
    RoundSummary,
    ServedSettings,
    StreamResult,
    floor_report,
    main,
    playback_stall,
)
from audio_pipeline.bench.stats import percentile


#: A config small enough to count by hand: q = 2 x 4 = 8, kv = 1 x 4 = 4 wide.
TINY = {"hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 4, "intermediate_size": 16}


def test_a_pass_reads_the_layers_linear_weights_once_and_every_rows_keys_and_values():
    cost = PassCost.of(TINY, "float32", "float16")
    # Per layer: q, k, v 8 x (8 + 4 + 4) = 128; o 8 x 8 = 64; gate, up, down 3 x 8 x 16 = 384: 576.
    assert cost.linear_params == 2 * 576 == 1152
    assert cost.weight_bytes == 1152 * 4 == 4608
    # Keys and values, 2 layers, 1 kv head of 4, float16: 2 x 2 x 1 x 4 x 2 bytes.
    assert cost.kv_bytes_per_token == 32
    assert cost.kv_bytes(rows=3, context=100) == 3 * 100 * 32 == 9600
    assert cost.bytes(3, 100) == 4608 + 9600
    # A multiply and an add per weight per row.
    assert cost.flops(3) == 2 * 1152 * 3 == 6912
    # 14,208 bytes at 14.208 MB/s: 1 ms.
    assert cost.floor_ms(3, 100, bandwidth=14.208e6) == pytest.approx(1.0)
    # Other dtypes scale their own part only.
    bf16 = PassCost.of({**TINY, "head_dim": None}, "bfloat16", "float32")  # head_dim from hidden / heads
    assert (bf16.weight_bytes, bf16.kv_bytes_per_token) == (2304, 64)


def fake_round() -> RoundSummary:
    """4 streams of an 80-token prompt and 40 generated tokens; 400 forward passes in 2 s, 52 of them
    decode, in 26 decode steps of 78 requests in all."""
    results = [StreamResult(ttfa=0.1, rtf=0.5, stall=0.0, audio_seconds=1.0) for _ in range(4)]
    split = {"schedule": 0.1, "inputs": 0.2, "model": 2.0, "sample": 0.3, "update": 0.0, "decode": 0.1, "deliver": 0.0}
    return RoundSummary(4, results, wall=2.0, steps=400, split=split, decode_ms=3.0, prompt_tokens=4 * 80,
                        output_tokens=4 * 40, decode_passes=52, decode_steps=26, decode_step_rows=78)


def test_a_round_gives_the_mean_rows_tokens_and_context_of_a_decode_pass():
    summary = fake_round()
    assert summary.rows_per_pass == pytest.approx(78 / 26)
    # The 156 tokens after each request's first over 52 decode passes; the prompt and half the speech.
    assert summary.tokens_per_pass == pytest.approx(3.0)
    assert summary.mean_context == pytest.approx(80 + 40 / 2)
    unseen = RoundSummary(4, summary.results, 2.0, 400, summary.split, 3.0)  # no decode pass in the scrape
    assert (unseen.rows_per_pass, unseen.tokens_per_pass) == (4.0, 4.0)


def test_the_floor_report_gives_bytes_flops_bandwidth_and_the_distance_to_the_floor():
    served = ServedSettings(TINY, "cpu", "float32", "float16", threads=1)
    lines = floor_report({4: fake_round()}, served, bandwidth=14.208e6)
    assert "float32, 0.00 M linear parameters = 0.00 MB" in lines[0] and "not the whole lm_head" in lines[0]
    assert "KV cache float16 (derived), 32 bytes per context token; read bandwidth 0.0 GB/s" in lines[0]
    assert lines[1] == FLOOR_HEADER
    for column in ("rows", "tokens", "ctx", "KV MB", "W MB", "GFLOP", "model ms", "GB/s", "GFLOP/s", "floor ms",
                   "x floor", "wall ms"):
        assert column in FLOOR_HEADER
    # rows 3, tokens 3, ctx 100: 0.0096 MB of KV, 0.0046 MB of weights, 6912 FLOPs; model 2 ms against
    # a 1 ms floor (14,208 bytes / 2 ms = 0.0071 GB/s); wall 2 s / 400 passes = 5 ms.
    assert lines[2].split() == ["4", "3.0", "3.0", "100", "0.01", "0.00", "0.000", "2.00", "0.0", "0.0", "1.000",
                                "2.0x", "5.00", "5.0x"]
    assert lines[3].startswith("per decode forward pass (/metrics): rows = sequences")
    # The server's logged dtype wins over the derived one.
    logged = floor_report({4: fake_round()}, served, 14.208e6, logged_cache_dtype="float32")
    assert "KV cache float32 (the server's log), 64 bytes" in logged[0]
    assert logged[2].split()[4] == "0.02"  # 3 x 100 x 64 bytes
    assert logged[2].split()[10] == f"{1000 * (4608 + 19200) / 14.208e6:.3f}"


def test_the_served_settings_resolve_as_the_engine_does():
    default = ServedSettings.of(None, "cpu", [])
    assert (default.weight_dtype, default.threads, default.model_config["num_hidden_layers"]) == ("float32", 1, 4)
    # A float32 model's cache is float16 on CPU where the native kernel builds (else float32).
    assert default.cache_dtype in ("float16", "float32")
    chosen = ServedSettings.of(None, "cpu", ["model.kv_cache.cache_dtype=bfloat16", "model.num_threads=2"])
    assert (chosen.cache_dtype, chosen.threads) == ("bfloat16", 2)


def test_a_player_waits_only_when_a_chunk_arrives_after_the_audio_before_it_ran_out():
    # Chunks of 0.5 s arriving every 0.5 s: the player never waits.
    assert playback_stall([(10.0, 0.5), (10.5, 0.5), (11.0, 0.5)]) == pytest.approx(0.0)
    # The third chunk comes 0.3 s after the first second of audio has played.
    assert playback_stall([(10.0, 0.5), (10.4, 0.5), (11.3, 0.5)]) == pytest.approx(0.3)
    # Early chunks build a lead that later late ones use up.
    assert playback_stall([(0.0, 2.0), (0.1, 0.1), (2.15, 1.0)]) == pytest.approx(0.05)
    assert playback_stall([]) == float("inf")
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([1.0, 2.0, 3.0, 4.0], 99) == 4.0


@pytest.mark.slow
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
    # The default voice runs one forward pass per 20 ms frame: about 50 passes per second of audio.
    budget = re.search(r"forward passes per second of audio \(N=1\): ([\d.]+); real time needs a forward pass "
                       r"of batch N within ([\d.]+) ms", out)
    assert budget and 40 < float(budget.group(1)) < 70
    assert float(budget.group(2)) == pytest.approx(1000 / float(budget.group(1)), rel=0.01)


@pytest.mark.slow
def test_the_random_model_benchmark_forces_fixed_length_streams_and_reports_the_bandwidth_floor(capsys):
    """--random-model serves a model of a real shape drawn at load (here the tiny one, on the CPU):
    every stream is exactly --utterance-tokens long, and each N's forward pass is set against the
    memory floor at the read bandwidth measured in the same run."""
    assert main(["--random-model", "orpheus-tiny", "--device", "cpu", "--streams", "1,2", "--no-search",
                 "--utterance-tokens", "56"]) == 0
    out = capsys.readouterr().out
    assert "plain padded forward" not in out
    assert re.search(r"^read bandwidth \(a float32 sum over 512 MiB, best of 5\): 1 thread [\d.]+ GB/s", out, re.M)
    rows = {int(m.group(1)): m.group(2) for m in re.finditer(r"^\s+(\d+)\s+\d+\s+\d+\s+[\d.]+\s+(\d+/\d+)", out, re.M)}
    assert set(rows) == {1, 2}
    # The server logs its KV cache's dtype at start (a float32 model's is float16 where the native kernel builds).
    assert re.search(r"^memory floor per forward pass: .* weights float32, .* KV cache float(16|32) \(the server's "
                     r"log\)", out, re.M)
    floor = {int(m.group(1)): (float(m.group(2)), float(m.group(3)), float(m.group(4)))
             for m in re.finditer(r"^\s+(\d+)\s+([\d.]+)\s+[\d.]+\s+(\d+)(?:\s+[\d.]+){7}\s+([\d.]+)x", out,
                                  re.M)}
    assert set(floor) == {1, 2}
    for count, (rows_per_pass, context, times_floor) in floor.items():
        # 56 speech tokens after a prompt: the mean context is the prompt and 28; a pass is never under the floor.
        assert 0 < rows_per_pass <= count and context > 28 and times_floor > 0
    assert "floor = (KV + weight bytes) / read bandwidth" in out


@pytest.mark.slow
def test_a_random_orpheus_3b_has_the_real_models_shape(tmp_path):
    """The GPU benchmark's model: Orpheus-3B's config (Llama 3.2 3B) and a decoder, no checkpoint."""
    import json

    from audio_pipeline.layouts.manifest import ModelManifest
    from audio_pipeline.testing.random_models import write_random_model

    model_dir = write_random_model(tmp_path / "m", "orpheus-3b")
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"]) == (3072, 28, 8)
    assert ModelManifest.read(model_dir).random_weights and not list(model_dir.glob("*.safetensors"))
    cost = PassCost.of(config, "bfloat16", "bfloat16")
    # Per layer: q, k, v 3072 x (3072 + 2 x 1024), o 3072 x 3072, MLP 3 x 3072 x 8192; 2.8 of the 3.2 B
    # parameters (the 156,940-row table is left out).
    assert cost.linear_params == 28 * (3072 * 5120 + 3072 * 3072 + 3 * 3072 * 8192)
    assert 5.5e9 < cost.weight_bytes < 5.7e9
    assert cost.kv_bytes_per_token == 2 * 28 * 8 * 128 * 2


@pytest.mark.slow
def test_a_server_that_fails_to_start_is_reported_with_its_log_kept(tmp_path):
    """A server that exits before listening (a model that does not exist) fails the benchmark with
    its exit code and the end of its log, and the log stays on disk."""
    from audio_pipeline.bench.server_process import Server, ServerStartError

    log = tmp_path / "server.log"
    with pytest.raises(ServerStartError, match=f"exited .* before listening; its log is kept at {log}") as caught:
        Server(str(tmp_path / "no-such-model"), [], device="cpu", log_path=str(log), start_timeout=120)
    assert "no-such-model" in str(caught.value)
    assert "no-such-model" in log.read_text()


@pytest.mark.slow
def test_a_server_that_does_not_listen_in_time_is_stopped_and_its_log_kept(tmp_path):
    """Past --start-timeout the benchmark stops waiting: the server process is stopped and its log
    (what it printed so far) is kept and named."""
    from audio_pipeline.bench.server_process import Server, ServerStartError

    log = tmp_path / "server.log"
    started = __import__("time").monotonic()
    with pytest.raises(ServerStartError, match=f"did not listen within 0 s .*kept at {log}"):
        Server(None, [], device="cpu", log_path=str(log), start_timeout=0.3)
    assert __import__("time").monotonic() - started < 60
    assert log.exists()
    # No server is left running on this log.
    import subprocess

    assert str(log) not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout


def test_the_benchmark_keeps_and_names_the_log_of_a_failed_start(tmp_path, capsys):
    """A setting the server refuses at start-up (a KV cache too small for one page) ends the
    benchmark with the server's own message, and --server-log keeps the log."""
    log = tmp_path / "kept.log"
    with pytest.raises(Exception, match="before listening(.|\n)*kv_cache_memory_bytes"):
        main(["--random-model", "orpheus-tiny", "--device", "cpu", "--no-search", "--streams", "1",
              "--task-arg", "model.kv_cache.kv_cache_memory_bytes=1", "--server-log", str(log),
              "--start-timeout", "120"])
    assert "kv_cache_memory_bytes" in log.read_text()


def test_the_decode_step_benchmark_reports_each_variant_and_batch_against_the_floor(capsys):
    """python -m audio_pipeline.bench.decode_step on the tiny random shape (CPU): a row per variant and
    batch with both timings and the floor, and the profiled step's summary (times never asserted)."""
    from audio_pipeline.bench.decode_step import main as decode_step

    threads = torch.get_num_threads()
    try:
        assert decode_step(["--random-model", "orpheus-tiny", "--device", "cpu", "--batches", "1,3", "--context", "40",
                            "--steps", "3", "--variants", "graphs,unfused", "--profile", "3", "--engine-loop"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    rows = re.findall(r"^(\w+)\s+(\d+)\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+x\s+\d+\s+\d+\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$",
                      out, re.M)
    assert [row[:2] for row in rows] == [("graphs", "1"), ("graphs", "3"), ("unfused", "1"), ("unfused", "3")]
    # The host's share of a step: staging the inputs took time (a 1-row update may print 0.00 ms).
    assert all(float(row[3]) > 0 and all(float(ms) >= 0 for ms in row[2:]) for row in rows)
    # Per variant, the share at the largest batch and what each extra row adds: the rows' own sums.
    shares = re.findall(r"^# (\w+): host share ([\d.]+) ms a step at 3 rows, (-?[\d.]+) us an extra row \(1 -> 3\)$",
                        out, re.M)
    assert [share[0] for share in shares] == ["graphs", "unfused"]
    for (variant, total, extra), small, large in zip(shares, rows[0::2], rows[1::2]):
        assert float(total) == pytest.approx(sum(float(ms) for ms in large[2:]), abs=0.02)
        assert float(extra) == pytest.approx(
            1000 * (sum(float(ms) for ms in large[2:]) - sum(float(ms) for ms in small[2:])) / 2, abs=20)
    assert len(re.findall(r"profile \(middle fifth of 5 steps, [\d.]+ ms\): device busy", out)) == 2
    # The engine's own loop, per variant and batch: its wall time a pass holds the step and the phases.
    loops = re.findall(r"^engine loop: (\w+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+(-?[\d.]+)\s+((?:[\d.]+\s*){7})$", out, re.M)
    assert [row[:2] for row in loops] == [("graphs", "1"), ("graphs", "3"), ("unfused", "1"), ("unfused", "3")]
    for _, _, wall, step, beyond, phases in loops:
        values = [float(v) for v in phases.split()]
        # Six figures printed to 0.01 ms: their rounding alone may part the sum by 0.03.
        assert float(step) == pytest.approx(sum(values[:5]), abs=0.03) and values[2] > 0  # the model ran
        assert float(wall) == pytest.approx(float(step) + values[5] + float(beyond), abs=0.02)


@pytest.mark.slow
def test_a_spread_round_starts_its_streams_evenly_and_times_each_from_its_own_start(idle_server, monkeypatch):
    """--spread S: stream i of N starts i * S / N seconds into the round; its TTFA counts from there.
    No real time is measured here: each stream reads a clock of its own, set to its start when it
    has waited for it, so a TTFA counted from anything but the stream's own start is not 0."""
    import asyncio
    import contextvars
    from types import SimpleNamespace

    from audio_pipeline.bench import serve

    own_clock, waits = contextvars.ContextVar("own_clock", default=0.0), []

    async def wait(seconds):  # each stream runs as a task of its own: the clock it sets is its own
        waits.append(seconds)
        own_clock.set(seconds)
        await asyncio.sleep(0)

    monkeypatch.setattr(serve, "asyncio", SimpleNamespace(sleep=wait, gather=asyncio.gather))
    monkeypatch.setattr(serve, "time", SimpleNamespace(perf_counter=own_clock.get))
    results, _ = asyncio.run(serve.run_round(idle_server.target, 4, 0, tokens=14, spread=1.2))
    assert len(results) == 4 and all(r.audio_seconds > 0 for r in results)
    assert waits == pytest.approx([0.3, 0.6, 0.9])  # stream 0 starts at once
    assert [r.ttfa for r in results] == [0.0] * 4


def test_with_several_rounds_every_stream_of_every_round_counts_toward_holding():
    """Two rounds of 2 streams: 4 results; one stalled stream means 3/4 hold and N=2 does not pass."""
    held, stalled = StreamResult(0.1, 0.5, 0.0, 1.0), StreamResult(0.1, 0.5, 1.0, 1.0)
    split = fake_round().split
    summary = RoundSummary(2, [held, held, held, stalled], wall=2.0, steps=400, split=split, decode_ms=3.0)
    assert summary.holding == 3 and not summary.passes
    assert "   3/4" in summary.row()
    assert RoundSummary(2, [held] * 4, wall=2.0, steps=400, split=split, decode_ms=3.0).passes


def test_the_server_runs_the_tree_the_benchmark_imported(tmp_path):
    """Whatever the working directory, the spawned server imports this checkout's audio_pipeline:
    its command puts this tree first on sys.path (python -m would put the working directory there)."""
    import subprocess
    import sys
    from pathlib import Path

    import audio_pipeline
    from audio_pipeline.bench import server_process

    decoy = tmp_path / "audio_pipeline"  # another checkout's package in the working directory
    decoy.mkdir()
    (decoy / "__init__.py").write_text("")
    probe = server_process.SERVE_THIS_TREE.split("from audio_pipeline.cli")[0] + "import audio_pipeline; print(audio_pipeline.__file__)"
    printed = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True)
    plain = subprocess.run([sys.executable, "-c", "import audio_pipeline; print(audio_pipeline.__file__)"], cwd=tmp_path,
                           capture_output=True, text=True, check=True)
    assert Path(plain.stdout.strip()) == decoy / "__init__.py"  # what the old `python -m` command ran into
    assert Path(printed.stdout.strip()) == Path(audio_pipeline.__file__)
