"""How streaming is judged as listeners hear it: the audible onset (two 20 ms frames at -45 dBFS),
the playback model (underruns, stalls, the player's clock) and the server's streaming metrics."""

import numpy as np
import pytest

from audio_pipeline.audio.audibility import OnsetTracker, audible_end, audible_onset
from audio_pipeline.audio.playback import Playback

RATE = 16000


def tone(seconds: float, dbfs: float, rate: int = RATE, offset: float = 0.0) -> np.ndarray:
    """A 440 Hz tone whose RMS is ``dbfs`` (plus a DC ``offset``, which the analysis removes)."""
    t = np.arange(round(seconds * rate)) / rate
    return (np.sqrt(2) * 10 ** (dbfs / 20) * np.sin(2 * np.pi * 440 * t) + offset).astype(np.float32)


def silence(seconds: float, rate: int = RATE) -> np.ndarray:
    return np.zeros(round(seconds * rate), np.float32)


def test_the_onset_is_the_first_of_two_audible_frames_on_a_10_ms_grid():
    signal = np.concatenate([silence(0.2), tone(0.5, -20)])
    # Frames start every 160 samples; the first frame wholly inside the tone starts at 0.2 s, and
    # the one before it (0.19-0.21 s, half tone at -20 dBFS) is already loud: -23 dB.
    assert audible_onset(signal, RATE) == round(0.19 * RATE)
    # Leading and trailing silence, read from both ends.
    padded = np.concatenate([signal, silence(0.3)])
    assert len(padded) - audible_end(padded, RATE) == pytest.approx(0.3 * RATE, abs=160)


def test_quiet_sound_a_dc_offset_and_a_lone_click_are_not_audible():
    quiet = tone(0.5, -50)
    assert audible_onset(quiet, RATE) is None
    # A constant offset is not sound: each frame's mean is removed first.
    assert audible_onset(quiet + 0.3, RATE) is None
    # A 10 ms click fills half of the two frames that hold it: -26 dB, audible...
    click = np.concatenate([silence(0.1), tone(0.01, -20), silence(0.2)])
    assert audible_onset(click, RATE) == round(0.09 * RATE)
    # ...a 2 ms one at -40 dBFS is spread over 20 ms frames: -50 dB, not.
    blip = np.concatenate([silence(0.1), tone(0.002, -40), silence(0.2)])
    assert audible_onset(blip, RATE) is None
    assert audible_onset(np.zeros(10, np.float32), RATE) is None


@pytest.mark.parametrize("piece_ms", [7, 20, 33, 160])
def test_an_onset_found_piece_by_piece_is_the_whole_signals(piece_ms):
    signal = np.concatenate([silence(0.137), tone(0.01, -40), silence(0.05), tone(0.4, -30)])
    tracker = OnsetTracker(RATE)
    step = round(piece_ms / 1000 * RATE)
    found = [tracker.feed(signal[i:i + step]) for i in range(0, len(signal), step)]
    assert [f for f in found if f is not None] == [audible_onset(signal, RATE)]
    assert tracker.onset == audible_onset(signal, RATE)


def test_a_piece_that_arrives_after_the_audio_ran_out_is_an_underrun_that_shifts_what_follows():
    player = Playback()
    assert player.arrive(10.0, 0.2) == 0  # starts playing; holds 0.2 s
    assert player.slack(10.1) == pytest.approx(0.1)
    assert player.arrive(10.15, 0.2) == 0  # in time: plays at 10.2
    assert player.arrive(10.5, 0.1) == pytest.approx(0.1)  # ran out at 10.4
    assert player.arrive(10.55, 0.3) == 0  # in time on the shifted clock (the last piece plays 10.5-10.6)
    assert (player.underruns, player.largest_stall) == (1, pytest.approx(0.1))
    assert player.arrive(11.0, 0.1) == pytest.approx(0.1)  # ran out at 10.9
    assert player.underruns == 2 and player.stalled == pytest.approx(0.2)
    # The player's clock: a sample 0.45 s in is in the third piece (0.4-0.5 s), which played from 10.5.
    assert player.plays_at(0.45) == pytest.approx(10.55)
    assert player.plays_at(0.05) == pytest.approx(10.05)
    assert player.plays_at(0.85) == pytest.approx(11.05)
    assert player.plays_at(0.9) is None  # one past the last sample received
    assert player.plays_at(5.0) is None


def metric(registry, name: str, **labels) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def test_the_servers_watch_plays_each_stream_as_it_leaves_and_counts_the_underruns_it_caused():
    from prometheus_client import CollectorRegistry

    from audio_pipeline.service.stream_metrics import StreamMetrics

    registry = CollectorRegistry()
    watch = StreamMetrics(registry).watch(RATE, opened=100.0)
    speech = np.concatenate([silence(0.1), tone(0.3, -20)])
    # Admitted at 100.0; 0.2 s at 100.05 (0.1 s silence, then speech), 0.2 s at 100.2 (in time), 0.1 s at
    # 100.5 (the client ran out at 100.45: a 50 ms underrun).
    for samples, now in [(speech[:3200], 100.05), (speech[3200:6400], 100.2), (tone(0.1, -20), 100.5)]:
        watch.audio(samples)
        watch.sent(len(samples) / RATE, now=now)
    watch.end()
    assert metric(registry, "tts_stream_time_to_first_byte_seconds_sum") == pytest.approx(0.05)
    # The onset is 0.09 s into the stream (the frame pair straddling the silence's end): it plays at 100.14.
    assert metric(registry, "tts_stream_leading_silence_seconds_sum") == pytest.approx(0.09)
    assert metric(registry, "tts_stream_time_to_first_audible_seconds_sum") == pytest.approx(0.14)
    assert metric(registry, "tts_stream_chunk_gap_seconds_count") == 2
    assert metric(registry, "tts_stream_chunk_gap_seconds_sum") == pytest.approx(0.15 + 0.3)
    # Slack when the second and third chunks left: 0.05 s, then -0.05 s (counted at or below 0).
    assert metric(registry, "tts_stream_slack_seconds_sum") == pytest.approx(0.0)
    assert metric(registry, "tts_stream_slack_seconds_bucket", le="0.0") == 1
    assert metric(registry, "tts_stream_slack_seconds_bucket", le="0.05") == 2
    assert metric(registry, "tts_stream_underruns_total") == 1
    assert metric(registry, "tts_stream_stall_seconds_total") == pytest.approx(0.05)
    assert metric(registry, "tts_streams_stalled_total") == 1


@pytest.mark.slow
def test_a_real_servers_metrics_show_each_http_stream_as_its_client_heard_it(tiny_model_dir):
    """Through the OpenAI route, streamed raw PCM: /metrics gains one first byte, one audible onset
    at the leading silence the client measured, and one gap and one slack per later chunk."""
    import httpx

    from audio_pipeline.testing.background import BackgroundServer
    from helpers import make_config, pcm16_to_float

    server = BackgroundServer(make_config(tiny_model_dir, "chunk_size=7,14", "sampling.top_k=50"), http_port=0).start()
    try:
        registry = server.engine.metrics.registry
        before = {name: metric(registry, name) for name in (
            "tts_stream_time_to_first_byte_seconds_count", "tts_stream_time_to_first_audible_seconds_count",
            "tts_stream_chunk_gap_seconds_count", "tts_stream_slack_seconds_count")}
        pieces = []
        with httpx.stream("POST", f"{server.http_url}/v1/audio/speech", timeout=120,
                          json={"input": "Metrics for a stream, please.", "response_format": "pcm", "stream": True,
                                "seed": 3}) as response:
            assert response.status_code == 200
            for piece in response.iter_raw():
                pieces.append(piece)
        audio = pcm16_to_float(b"".join(pieces))
        onset = audible_onset(audio, 24000)
        assert onset is not None
        grew = {name: metric(registry, name) - value for name, value in before.items()}
        assert grew["tts_stream_time_to_first_byte_seconds_count"] == 1
        assert grew["tts_stream_time_to_first_audible_seconds_count"] == 1
        sends = grew["tts_stream_chunk_gap_seconds_count"] + 1
        assert sends >= 3 and grew["tts_stream_slack_seconds_count"] == sends - 1
        # The server found the onset on its own audio (16 kHz... or the model's rate) where the client did.
        assert metric(registry, "tts_stream_leading_silence_seconds_sum") == pytest.approx(onset / 24000, abs=0.011)
    finally:
        server.stop()
