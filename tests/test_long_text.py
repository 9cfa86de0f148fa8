"""A text of many sentences through a real server: one continuous stream, every sentence in order,
silences by the punctuation between them; a cancel mid-way frees everything."""

import grpc
import numpy as np
import pytest

from audio_pipeline.text.segment import PAUSES
from audio_pipeline_client._proto import tts_pb2, tts_pb2_grpc
from helpers import pcm_of

#: Real servers and whole voices: left out of the quick subset (scripts/test.sh -m "not slow").
pytestmark = pytest.mark.slow

SENTENCES = ["First one here.", "Second one there, and on.", "Is this the third?", "Last."]


def test_a_long_text_is_one_stream_of_its_sentences_in_order(idle_server):
    with grpc.insecure_channel(idle_server.target) as channel:
        stub = tts_pb2_grpc.TextToSpeechStub(channel)

        def speak(text):
            return list(stub.Synthesize(tts_pb2.SynthesizeRequest(
                text=text, sampling=tts_pb2.SamplingParams(temperature=0.0)), timeout=300))

        whole = speak(" ".join(SENTENCES))
        alone = [speak(sentence) for sentence in SENTENCES]
    kinds = [m.WhichOneof("content") for m in whole]
    assert kinds[0] == "format" and kinds[-1] == "complete" and set(kinds[1:-1]) == {"audio"}
    chunks = [m.audio.chunk_index for m in whole if m.HasField("audio")]
    assert chunks == list(range(len(chunks)))
    rate = whole[0].format.sample_rate
    # Each sentence's audio, as it sounds alone (greedy), then the pause its punctuation asks for.
    expected = []
    for sentence, messages in zip(SENTENCES, alone):
        expected.append(pcm_of(messages))
        if sentence is not SENTENCES[-1]:
            pause = PAUSES["comma" if sentence.endswith(",") else "sentence"]
            expected.append(np.zeros(int(round(pause * rate)), dtype="<i2"))
    # Equal up to a rounding step: a segment's decode may share a batch with another's.
    np.testing.assert_allclose(pcm_of(whole).astype(np.int32), np.concatenate(expected).astype(np.int32), atol=2)
    usage = whole[-1].complete.usage
    assert usage.prompt_tokens == sum(m[-1].complete.usage.prompt_tokens for m in alone)
    assert usage.generated_tokens == sum(m[-1].complete.usage.generated_tokens for m in alone)
    assert usage.audio_seconds * rate == len(pcm_of(whole))


def test_cancelling_a_long_text_mid_way_frees_every_segment(idle_server):
    """idle_server checks afterwards that no request and no KV block is left."""
    with grpc.insecure_channel(idle_server.target) as channel:
        stub = tts_pb2_grpc.TextToSpeechStub(channel)
        call = stub.Synthesize(tts_pb2.SynthesizeRequest(text=" ".join(SENTENCES * 5)), timeout=300)
        received = [next(call) for _ in range(4)]
        assert received[0].HasField("format")
        call.cancel()


def test_the_long_text_benchmark_speaks_a_file_through_a_real_server(tiny_model_dir, tmp_path, capsys):
    from audio_pipeline.bench.long_text import DEFAULT_FILE, main
    from audio_pipeline.config import AudioGenerationConfig
    from audio_pipeline.service.segmented import HEAD_CHARS
    from audio_pipeline.text.segment import segments

    # The default file is one request a server with default settings takes (sampling.max_text_chars),
    # of many sentences, long enough that its first sentence is spoken long before the rest is
    # segmented (HEAD_CHARS).
    default = DEFAULT_FILE.read_text()
    assert 19 * HEAD_CHARS < len(default) <= AudioGenerationConfig.load(env={}).sampling.max_text_chars
    assert len(segments(default, 300)) > 100
    text = tmp_path / "short.txt"
    text.write_text(" ".join(SENTENCES))
    assert main(["--file", str(text), "--model", str(tiny_model_dir), "--task-arg", "chunk_size=28,56",
                 "--task-arg", "sampling.max_tokens=70"]) == 0
    out = capsys.readouterr().out
    assert "4 words" not in out and "stream 0: first audio" in out and "longest playback stall" in out
    # The tiny Orpheus-layout model has no word alignment: one timing per sentence, all covered.
    assert "word timings: 4 timings (segment), 13 of 13 written words covered, in order" in out


def test_a_long_text_is_segmented_head_first_into_the_same_segments():
    """The first sentence starts before the whole text is segmented; the pieces add up to exactly
    the whole text's segments (spans included), also when a sentence crosses the head's end."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from audio_pipeline.bench.long_text import DEFAULT_FILE
    from audio_pipeline.service.segmented import HEAD_CHARS, SegmentedSynthesis
    from audio_pipeline.text.segment import segments

    crossing = "Short one. " * (HEAD_CHARS // 11) + "A long sentence " * 30 + "ends here. Then one more."
    for text in (DEFAULT_FILE.read_text(), crossing):
        synthesis = SegmentedSynthesis(None, None, executor=ThreadPoolExecutor(1), request_id="r",
                                       max_segment_chars=300)
        asyncio.run(synthesis.add_text(text))
        assert synthesis.segments == segments(text, 300)
