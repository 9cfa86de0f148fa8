"""The speech service under every front door, on a real engine in this process: a request is
checked before it is admitted, its label is held while it runs, a seeded long text uses seed + i
for segment i, resampling, encoding and segmentation run off the event loop, and every way a
request ends is counted once and frees what it held."""

import asyncio
import threading

import numpy as np
import pytest

from helpers import make_config, wait_idle

TWO_SENTENCES = "The first sentence is here. And the second one follows it."


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from audio_pipeline.service.engine import TTSEngine

    engine = TTSEngine(make_config(tiny_model_dir))
    engine.start()
    yield engine
    engine.stop(0.0)


@pytest.fixture
def service(engine):
    from audio_pipeline.service.speech import SpeechService

    outcomes = []
    service = SpeechService(engine, count=outcomes.append)
    service.ready = True
    service.outcomes = outcomes
    yield service
    service.close()
    wait_idle(engine)


def speak(service, **fields):
    """(events, the stream) of one request read to its end."""
    from audio_pipeline.service.request import SpeechRequest

    async def run():
        stream = await service.open(SpeechRequest(**fields))
        return [event async for event in stream.events()], stream
    return asyncio.run(run())


def test_a_request_is_checked_before_it_is_admitted(service, engine):
    from audio_pipeline.errors import InvalidArgument

    for fields, field in (({"text": " "}, "text"), ({"text": "Hi.", "format": "wma"}, "format"),
                          ({"text": "Hi.", "sample_rate": 5}, "sample_rate"), ({"text": "Hi.", "speed": 9.0}, "speed"),
                          ({"text": "Hi.", "sampling": {"temperature": -1.0}}, "sampling.temperature")):
        with pytest.raises(InvalidArgument) as refused:
            speak(service, **fields)
        assert refused.value.field == field
    assert service.outcomes == ["invalid"] * 5
    assert not service._labels and engine.core.load == (0, 0)


def test_a_label_names_one_running_request_and_is_free_once_it_ends(service):
    from audio_pipeline.errors import AlreadyExists
    from audio_pipeline.service.request import SpeechDone, SpeechRequest

    async def run():
        first = await service.open(SpeechRequest(text="Hello there.", label="mine", sampling={"seed": 1}))
        with pytest.raises(AlreadyExists) as taken:
            await service.open(SpeechRequest(text="Hello again.", label="mine"))
        events = [event async for event in first.events()]
        again = await service.open(SpeechRequest(text="Hello again.", label="mine", sampling={"seed": 1}))
        return taken.value, events, [event async for event in again.events()]

    taken, first, again = asyncio.run(run())
    assert taken.field == "request_id"
    assert isinstance(first[-1], SpeechDone) and isinstance(again[-1], SpeechDone)
    assert service.outcomes == ["rejected", "ok", "ok"]


def test_segment_i_of_a_seeded_request_draws_with_seed_plus_i(service):
    """The two sentences are two engine requests; the second's seed is the request's plus one, so
    the same seed gives the same audio, and the segments do not repeat one another's draws."""
    from audio_pipeline.service.request import SpeechRequest

    async def seeds_and_samples(seed):
        stream = await service.open(SpeechRequest(text=TWO_SENTENCES, sampling={"seed": seed}, format="float32"))
        data = b"".join([event.data async for event in stream.events() if hasattr(event, "data")])
        return [context.sampling.seed for context in stream.synthesis._submitted], data

    def samples(seed):
        seeds, data = asyncio.run(seeds_and_samples(seed))
        return seeds, np.frombuffer(data, dtype="<f4")

    seeds, first = samples(41)
    assert seeds == [41, 42]
    again, other = samples(41)[1], samples(40)[1]
    # The same tokens (batched decoding may differ in the last bits of a float).
    assert again.size == first.size and np.abs(again - first).max() < 1e-4
    assert other.size != first.size or np.abs(other - first).max() > 1e-2


def test_an_ssml_voice_speaks_its_segments_in_the_voice_it_names(service, engine):
    """A <voice>'s segment is its own generation in the voice it names, with the request's other
    settings: the document's audio is the first sentence as the request's voice speaks it, the
    sentence's pause, then the second as a request in that voice (seed + 1: it is segment 1)
    speaks it. An unknown voice is refused before any audio, naming the element."""
    from audio_pipeline.errors import NotFound
    from audio_pipeline.service.request import SpeechRequest

    def run(text, **fields):
        async def go():
            stream = await service.open(SpeechRequest(text=text, format="float32", **fields))
            data = b"".join([event.data async for event in stream.events() if hasattr(event, "data")])
            return [(c.voice, c.sampling.seed) for c in stream.synthesis._submitted], np.frombuffer(data, dtype="<f4")
        return asyncio.run(go())

    first, second = TWO_SENTENCES.split(". ")
    document = f"<speak>{first}. <voice name='leah'>{second}</voice></speak>"
    voices, whole = run(document, sampling={"seed": 5})
    assert voices == [("tara", 5), ("leah", 6)]
    alone = [run(f"{first}.", sampling={"seed": 5})[1], run(second, voice="leah", sampling={"seed": 6})[1]]
    pause = round(0.35 * engine.sample_rate)
    assert whole.size == alone[0].size + pause + alone[1].size
    np.testing.assert_allclose(whole[:alone[0].size], alone[0], atol=1e-4)
    np.testing.assert_allclose(whole[-alone[1].size:], alone[1], atol=1e-4)
    assert not whole[alone[0].size:alone[0].size + pause].any()
    with pytest.raises(NotFound) as refused:
        run("<speak>Hi. <voice name='nobody'>There.</voice></speak>")
    assert refused.value.field == "text" and "<voice name='nobody'>: unknown voice 'nobody'" in str(refused.value)


def test_resampling_encoding_and_segmentation_run_off_the_event_loop(service, monkeypatch):
    """mp3 at 16 kHz (the engine makes 24 kHz): every resample and encode call, and the live text's
    segmenter, run on the service's threads while the event loop's thread only awaits them."""
    from audio_pipeline.service import live_text, output
    from audio_pipeline.service.request import SpeechAudio, SpeechDone, SpeechRequest

    threads = []

    def spy(function):
        def called(*args, **kwargs):
            threads.append(threading.current_thread().name)
            return function(*args, **kwargs)
        return called

    monkeypatch.setattr(output.AudioOutput, "chunk", spy(output.AudioOutput.chunk))
    monkeypatch.setattr(output.AudioOutput, "end", spy(output.AudioOutput.end))
    monkeypatch.setattr(live_text, "segments", spy(live_text.segments))

    async def run():
        loop_thread = threading.current_thread().name
        stream = service.open_live(SpeechRequest(format="mp3", sample_rate=16000, sampling={"seed": 2}))
        await stream.text.add("Spoken as it comes. And ")
        await stream.text.end()
        await stream.start()
        return loop_thread, [event async for event in stream.events()]

    loop_thread, events = asyncio.run(run())
    assert threads and loop_thread not in threads
    assert all(name.startswith(("encoder", "frontend")) for name in threads)
    audio = b"".join(e.data for e in events if isinstance(e, SpeechAudio))
    assert audio[:3] == b"ID3" or audio[0] == 0xFF  # an MP3 stream
    assert isinstance(events[-1], SpeechDone) and events[-1].sample_rate == 16000


def test_a_client_that_stops_reading_is_counted_once_and_frees_everything(service, engine):
    from audio_pipeline.service.request import SpeechRequest

    async def run():
        stream = await service.open(SpeechRequest(text=" ".join(["A long text to keep it busy."] * 8),
                                                  label="leaver"))
        events = stream.events()
        await anext(events)
        await events.aclose()
        return stream

    stream = asyncio.run(run())
    wait_idle(engine)
    assert service.outcomes == ["client_cancelled"] and not service._labels
    stream.close()  # idempotent: nothing counted twice
    assert service.outcomes == ["client_cancelled"]


def test_a_whole_file_output_comes_as_one_piece_with_every_sample(service):
    """FLAC (and a WAV not streamed) come as one complete file: its header holds the length."""
    import io

    import soundfile

    from audio_pipeline.service.request import SpeechAudio, SpeechDone

    for fields in ({"format": "flac"}, {"format": "wav", "streamed": False}):
        events, _ = speak(service, text="Hello there.", sampling={"seed": 3}, **fields)
        audio = [e for e in events if isinstance(e, SpeechAudio)]
        done = events[-1]
        assert len(audio) == 1 and isinstance(done, SpeechDone) and audio[0].num_samples == done.audio_samples
        with soundfile.SoundFile(io.BytesIO(audio[0].data)) as sound:
            assert sound.frames == done.audio_samples > 0
            assert np.abs(sound.read()).max() > 0
