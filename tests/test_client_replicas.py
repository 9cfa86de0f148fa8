"""The client side of scale-out, against real servers: calls spread over replicas (gRPC's
round_robin), and a call refused with UNAVAILABLE goes to another replica (gRPC's retry policy)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from audio_pipeline.service.engine import TTSEngine
from audio_pipeline.testing.background import BackgroundServer
from audio_pipeline_client import AsyncTTSClient, TTSClient, TTSError
from helpers import make_config

#: Real servers and whole voices: left out of the quick subset (scripts/test.sh -m "not slow").
pytestmark = pytest.mark.slow

TEXT = "Spread me over the replicas."


def finished(server) -> float:
    """Requests a server's engine has finished."""
    return sum(sample.value for metric in server.engine.metrics.requests.collect() for sample in metric.samples
               if sample.name.endswith("_total"))


def refused(server) -> float:
    """Synthesize calls a server refused as unavailable."""
    return server.engine.metrics.registry.get_sample_value("tts_rpc_requests_total", {"outcome": "unavailable"}) or 0


@pytest.fixture(scope="module")
def replicas(tiny_model_dir):
    servers = [BackgroundServer(make_config(tiny_model_dir)).start() for _ in range(2)]
    yield servers
    for server in servers:
        server.stop()


def test_calls_are_spread_over_every_replica(replicas):
    before = [finished(s) for s in replicas]
    with TTSClient([s.target for s in replicas], timeout=60) as client:
        results = [client.synthesize(TEXT, seed=1, max_tokens=56) for _ in range(6)]
    served = [finished(s) - b for s, b in zip(replicas, before)]
    assert all(n >= 2 for n in served), served  # round robin: 3 each, give or take a connection's late start
    assert sum(served) == 6
    # The same text and seed: the same speech whichever replica answered.
    for result in results[1:]:
        np.testing.assert_array_equal(result.samples, results[0].samples)


def test_a_replica_that_refuses_is_retried_on_another(replicas, tiny_model_dir):
    """One replica still warming up (it answers UNAVAILABLE): every call still succeeds, through the
    other replica, and the warming one was asked (so the retry, not luck, carried the calls)."""
    engine = TTSEngine(make_config(tiny_model_dir))
    gate = threading.Event()
    real_warmup = engine.warmup
    engine.warmup = lambda: (gate.wait(120), real_warmup())[1]
    warming = BackgroundServer(engine.config, engine=engine).start(wait_ready=False)
    try:
        ready = replicas[0]
        with TTSClient(ready.target, timeout=60) as alone:
            expected = alone.synthesize(TEXT, seed=1, max_tokens=56).samples
        before = finished(ready)
        with TTSClient([warming.target, ready.target], timeout=60, retries=3) as client:
            for _ in range(6):  # each call gets the whole speech, as the ready replica alone gives it
                np.testing.assert_array_equal(client.synthesize(TEXT, seed=1, max_tokens=56).samples, expected)
            assert [v.name for v in client.list_voices()]
        assert finished(ready) - before == 6
        assert refused(warming) >= 1
        with TTSClient(warming.target, timeout=30, retries=0) as alone, pytest.raises(TTSError) as caught:
            alone.synthesize(TEXT, max_tokens=56)
        assert caught.value.code.name == "UNAVAILABLE" and "warming up" in caught.value.details
    finally:
        gate.set()
        warming.stop()


def test_the_async_client_balances_and_retries_too(replicas, tiny_model_dir):
    engine = TTSEngine(make_config(tiny_model_dir))
    gate = threading.Event()
    real_warmup = engine.warmup
    engine.warmup = lambda: (gate.wait(120), real_warmup())[1]
    warming = BackgroundServer(engine.config, engine=engine).start(wait_ready=False)

    async def run():
        async with AsyncTTSClient([warming.target, *(s.target for s in replicas)], timeout=60) as client:
            # round_robin picks among connected replicas: the first call connects the channel, and
            # the others connect right after it.
            assert await client.list_voices()
            await asyncio.sleep(0.5)
            results = await asyncio.gather(*(client.synthesize(TEXT, seed=1, max_tokens=56) for _ in range(6)))
            return [r.samples for r in results]

    try:
        with TTSClient(replicas[0].target, timeout=60) as alone:
            expected = alone.synthesize(TEXT, seed=1, max_tokens=56).samples
        before = [finished(s) for s in replicas]
        answers = asyncio.run(run())
        for samples in answers:  # batched together on a replica: the same speech up to one PCM16 step
            np.testing.assert_allclose(samples, expected, rtol=0, atol=1.5 / 32768)
        served = [finished(s) - b for s, b in zip(replicas, before)]
        assert sum(served) == 6 and all(n >= 1 for n in served), served
        assert refused(warming) >= 1
    finally:
        gate.set()
        warming.stop()


def test_the_cli_takes_a_list_of_replicas(replicas, tmp_path, capsys):
    import soundfile

    from audio_pipeline_client.cli import main

    from audio_pipeline_client.protocol import float_to_pcm16

    before = sum(finished(s) for s in replicas)
    servers = ",".join(s.target for s in replicas)
    for i in range(2):
        assert main(["--server", servers, "--metadata", "application=tts", "--text", TEXT, "--seed", "1",
                     "--max-tokens", "56", "--output", str(tmp_path / f"{i}.wav"), "--quiet"]) == 0
    assert sum(finished(s) for s in replicas) - before == 2
    with TTSClient(replicas[0].target, timeout=60) as alone:
        expected = float_to_pcm16(alone.synthesize(TEXT, seed=1, max_tokens=56).samples)
    for i in range(2):
        np.testing.assert_array_equal(soundfile.read(str(tmp_path / f"{i}.wav"), dtype="int16")[0], expected)
    assert main(["--server", "tts-a:1,tts-b:2", "--text", TEXT, "--output", str(tmp_path / "x.wav")]) == 1
    error = capsys.readouterr().err
    assert "--server:" in error and "dns:///" in error
    assert main(["--server", servers, "--metadata", "novalue", "--text", TEXT, "--output", str(tmp_path / "y.wav")]) == 1
    assert "--metadata: 'novalue' is not KEY=VALUE" in capsys.readouterr().err
