"""SynthesizeStream over a real server: live text in (trickled, flushed, cancelled), one audio
stream out, and bad streams answered with INVALID_ARGUMENT naming the field."""

import asyncio
import threading

import grpc
import numpy as np
import pytest

from audio_pipeline_client import FLUSH, AsyncTTSClient, TTSClient, TTSError
from audio_pipeline_client._proto import tts_pb2, tts_pb2_grpc

#: Real servers and whole voices: left out of the quick subset (scripts/test.sh -m "not slow").
pytestmark = pytest.mark.slow

SENTENCES = ["First one here.", "Second one there.", "Is this the third?"]


def tokens(text):
    """The text in small pieces, spaces kept, the way an LLM streams it."""
    pieces, word = [], ""
    for ch in text:
        word += ch
        if ch == " " or len(word) >= 3:
            pieces.append(word)
            word = ""
    return pieces + ([word] if word else [])


def samples_of(chunks):
    return np.concatenate([c.samples for c in chunks if not c.final])


def test_trickled_text_speaks_every_sentence_as_one_stream(idle_server):
    with TTSClient(idle_server.target, timeout=300) as client:
        live = list(client.stream_text(tokens(" ".join(SENTENCES)), temperature=0.0))
        whole = list(client.stream(" ".join(SENTENCES), temperature=0.0))
    assert live[-1].final and live[-1].usage.prompt_tokens == whole[-1].usage.prompt_tokens
    # The same sentences as the whole text in one request, in order, with the same pauses.
    np.testing.assert_allclose(samples_of(live), samples_of(whole), atol=2 / 32768)


def test_the_first_sentence_is_spoken_before_the_text_ends(idle_server):
    """A sentence is spoken once the next one begins: its audio arrives while the client is still
    holding back the rest of the text (the text goes on only once audio has come)."""
    heard = threading.Event()
    held_back = []

    def pieces():  # read by gRPC's own thread while this one reads the audio
        yield SENTENCES[0] + " "
        yield "Sec"
        held_back.append(heard.wait(timeout=120))  # False: no audio came while the text was held back
        yield "ond one there."

    with TTSClient(idle_server.target, timeout=300) as client:
        for chunk in client.stream_text(pieces(), temperature=0.0):
            if not chunk.final:
                heard.set()
    assert held_back == [True]


def test_flush_speaks_an_unfinished_sentence(idle_server):
    """The text before FLUSH is spoken as a piece of its own, then (after a pause) the rest: the
    stream is the two pieces' own speech with silence between."""
    with TTSClient(idle_server.target, timeout=300) as client:
        flushed = samples_of(list(client.stream_text(["No full stop here", FLUSH, " and more after"],
                                                   temperature=0.0)))
        before = samples_of(list(client.stream("No full stop here", temperature=0.0)))
        after = samples_of(list(client.stream("and more after", temperature=0.0)))
    assert flushed.size > before.size + after.size
    np.testing.assert_allclose(flushed[:before.size], before, atol=2 / 32768)
    np.testing.assert_allclose(flushed[-after.size:], after, atol=2 / 32768)
    assert not flushed[before.size:-after.size].any()  # the pause between them


def test_the_async_client_streams_text_from_an_async_source(idle_server):
    async def source():
        for piece in tokens(SENTENCES[0]):
            await asyncio.sleep(0.01)
            yield piece

    async def run():
        async with AsyncTTSClient(idle_server.target, timeout=300) as client:
            return [c async for c in client.stream_text(source(), temperature=0.0)]

    chunks = asyncio.run(run())
    assert chunks[-1].final
    with TTSClient(idle_server.target, timeout=300) as client:  # the sentence sent whole, sync
        whole = samples_of(list(client.stream(SENTENCES[0], temperature=0.0)))
    assert samples_of(chunks).shape == whole.shape
    np.testing.assert_allclose(samples_of(chunks), whole, atol=2 / 32768)


def test_a_cancel_mid_sentence_frees_everything(idle_server):
    """Barge-in: the client stops reading in the middle of a long text; idle_server checks that no
    request, KV block or decoder state is left."""
    with TTSClient(idle_server.target, timeout=300) as client:
        stream = client.stream_text(tokens(" ".join(SENTENCES * 6)))
        next(stream)
        stream.close()


def raw_call(target, messages):
    with grpc.insecure_channel(target) as channel:
        stub = tts_pb2_grpc.TextToSpeechStub(channel)
        try:
            list(stub.SynthesizeStream(iter(messages), timeout=60))
        except grpc.RpcError as error:
            return error.code(), error.details()
    return grpc.StatusCode.OK, ""


SETTINGS = tts_pb2.TextInput(settings=tts_pb2.StreamSettings())
TEXT = tts_pb2.TextInput(text="Hello there.")
END = tts_pb2.TextInput(end_of_input=tts_pb2.EndOfInput())


@pytest.mark.parametrize("messages, field", [
    ([], "settings"),
    ([TEXT, END], "settings"),
    ([SETTINGS, TEXT, SETTINGS, END], "settings"),
    ([SETTINGS, END], "text"),
    ([SETTINGS, tts_pb2.TextInput(), END], "content"),
    ([tts_pb2.TextInput(settings=tts_pb2.StreamSettings(voice="nobody")), TEXT, END], "voice"),
    ([tts_pb2.TextInput(settings=tts_pb2.StreamSettings(sample_rate=5)), TEXT, END], "sample_rate"),
])
def test_bad_streams_are_invalid_with_the_field_named(idle_server, messages, field):
    code, details = raw_call(idle_server.target, messages)
    assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), details
    assert details.startswith(field), details


def test_errors_reach_the_client_library_as_tts_errors(idle_server):
    with TTSClient(idle_server.target, timeout=60) as client, pytest.raises(TTSError) as caught:
        list(client.stream_text(["Hello."], voice="nobody"))
    assert caught.value.code == grpc.StatusCode.NOT_FOUND


def test_tts_client_live_reads_its_input_line_by_line(idle_server, tmp_path, monkeypatch):
    import io

    import soundfile as sf

    from audio_pipeline_client.cli import main as tts_client

    out = tmp_path / "live.wav"
    lines = "First one here.\nSecond one\n\nthere.\n"
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(lines.encode())))
    assert tts_client(["--server", idle_server.target, "--input", "-", "--live", "--output", str(out),
                       "--temperature", "0", "--quiet"]) == 0
    audio, rate = sf.read(out, dtype="float32")
    with TTSClient(idle_server.target, timeout=300) as client:
        expected = samples_of(list(client.stream_text(["First one here. ", "Second one ", FLUSH, "there. "],
                                                    temperature=0.0)))
    assert rate == 24000 and audio.shape == expected.shape
    np.testing.assert_allclose(audio, expected, atol=2 / 32768)  # PCM16 both: the same samples


def test_the_live_text_benchmark_runs_against_a_real_server(tiny_model_dir, capsys):
    from audio_pipeline.bench.live_text import main, sentences

    assert len(sentences(4)) == 4 and all(s.strip()[-1] in ".!?" for s in sentences(4))
    assert main(["--sentences", "2", "--rounds", "1", "--rate", "50", "--model", str(tiny_model_dir),
                 "--task-arg", "chunk_size=28,56", "--task-arg", "sampling.max_tokens=70"]) == 0
    out = capsys.readouterr().out
    assert "after the first sentence's last token" in out and "median delay to first audio" in out
