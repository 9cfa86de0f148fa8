"""Voice cloning over gRPC: RegisterVoice / DeleteVoice / ListVoices, persistence across a restart,
a reference recording in the request, and bad references answered with INVALID_ARGUMENT."""

from __future__ import annotations

import dataclasses
import io
import math

import grpc
import numpy as np
import pytest
import soundfile as sf

from audio_pipeline.layouts.orpheus import END_OF_AI, END_OF_SPEECH, OrpheusLayout
from audio_pipeline.testing.background import BackgroundServer
from audio_pipeline_client._proto import tts_pb2, tts_pb2_grpc
from helpers import (PCM_STEP, TRANSCRIPT, make_config, pcm16_to_float, pcm_bytes, recording, run_to_completion,
                     wait_idle)

#: Real servers and whole voices: left out of the quick subset (scripts/test.sh -m "not slow").
pytestmark = pytest.mark.slow

def reference(**kwargs) -> tts_pb2.VoiceReference:
    return tts_pb2.VoiceReference(audio=kwargs.get("audio", recording()), transcript=kwargs.get("transcript", TRANSCRIPT))


def synthesize(stub, **fields):
    return list(stub.Synthesize(tts_pb2.SynthesizeRequest(
        text="Speak in the cloned voice.", sampling=tts_pb2.SamplingParams(max_tokens=28, temperature=0.0), **fields),
        timeout=120))


@pytest.fixture
def server(tiny_model_dir, tmp_path):
    running = BackgroundServer(make_config(tiny_model_dir, voices_dir=str(tmp_path / "voices"))).start()
    yield running
    running.stop()


def test_register_list_use_restart_and_delete(tiny_model_dir, tmp_path, server):
    with grpc.insecure_channel(server.target) as channel:
        stub = tts_pb2_grpc.TextToSpeechStub(channel)
        flac = recording(rate=44100, fmt="FLAC", channels=2)
        voice = stub.RegisterVoice(tts_pb2.RegisterVoiceRequest(name="alice", reference=reference(audio=flac),
                                                                description="Alice, cloned"), timeout=60)
        assert (voice.name, voice.registered, voice.description) == ("alice", True, "Alice, cloned")
        listed = {v.name: v for v in stub.ListVoices(tts_pb2.ListVoicesRequest(), timeout=10).voices}
        assert listed["alice"].registered and not listed["tara"].registered
        chunks = synthesize(stub, voice="alice")
        assert chunks[-1].HasField("complete")
        spoken = pcm_bytes(chunks)  # the recording's voice: the greedy speech of the same recording sent inline
        assert spoken == pcm_bytes(synthesize(stub, reference=reference(audio=flac))) != pcm_bytes(synthesize(stub))
        with pytest.raises(grpc.RpcError) as taken:
            stub.RegisterVoice(tts_pb2.RegisterVoiceRequest(name="alice", reference=reference()), timeout=60)
        assert taken.value.code() == grpc.StatusCode.ALREADY_EXISTS and "name" in taken.value.details()
    # The prompt starts with the reference exchange: transcript, its speech tokens, end of turn.
    engine = server.engine
    context = engine.create_context("Speak in the cloned voice.", voice="alice")
    codes = engine.voice_catalogue.store.get("alice").prompt.codes
    speech = OrpheusLayout().codes_to_tokens(codes.tolist())
    at = context.prompt_ids.index(speech[0])
    assert context.prompt_ids[at:at + len(speech) + 2] == [*speech, END_OF_SPEECH, END_OF_AI]
    assert context.prompt_speech_codes.equal(codes)
    # The whole recording (1 s, read at the decoder's 24 kHz) is in the voice: 12 frames of 2048 samples.
    assert codes.numel() == math.ceil(engine.decoder.sample_rate / engine.decoder.samples_per_frame) * 7
    server.stop()

    # A restart with the same voices_dir knows the voice; deleting it forgets it for good.
    again = BackgroundServer(make_config(tiny_model_dir, voices_dir=str(tmp_path / "voices"))).start()
    try:
        with grpc.insecure_channel(again.target) as channel:
            stub = tts_pb2_grpc.TextToSpeechStub(channel)
            assert "alice" in [v.name for v in stub.ListVoices(tts_pb2.ListVoicesRequest(), timeout=10).voices]
            assert again.engine.voice_catalogue.store.get("alice").prompt.codes.equal(codes)
            assert pcm_bytes(synthesize(stub, voice="alice")) == spoken  # it speaks as it did before the restart
            stub.DeleteVoice(tts_pb2.DeleteVoiceRequest(name="alice"), timeout=10)
            for call in (lambda: stub.DeleteVoice(tts_pb2.DeleteVoiceRequest(name="alice"), timeout=10),
                         lambda: synthesize(stub, voice="alice")):
                with pytest.raises(grpc.RpcError) as gone:
                    call()
                assert gone.value.code() == grpc.StatusCode.NOT_FOUND
            with pytest.raises(grpc.RpcError) as preset:
                stub.DeleteVoice(tts_pb2.DeleteVoiceRequest(name="tara"), timeout=10)
            assert preset.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert not (tmp_path / "voices" / "alice").exists()
        wait_idle(again.engine)
    finally:
        again.stop()


def test_a_reference_in_the_request_clones_for_that_request_only(server):
    engine = server.engine
    with grpc.insecure_channel(server.target) as channel:
        stub = tts_pb2_grpc.TextToSpeechStub(channel)
        chunks = synthesize(stub, reference=reference())
        plain = synthesize(stub)
        assert chunks[0].HasField("format") and chunks[-1].HasField("complete")
        # The prompt is the reference exchange (the recording's 84 speech tokens among it), then the text ...
        cloned = engine.create_context("Speak in the cloned voice.",
                                       reference=engine.requests.reference_prompt(recording(), TRANSCRIPT))
        assert chunks[-1].complete.usage.prompt_tokens == len(cloned.prompt_ids)
        assert chunks[-1].complete.usage.prompt_tokens >= plain[-1].complete.usage.prompt_tokens + 84
        # ... so the greedy speech is not the default voice's; and nothing was registered.
        assert pcm_bytes(chunks) != pcm_bytes(plain)
        assert [v.name for v in stub.ListVoices(tts_pb2.ListVoicesRequest(), timeout=10).voices if v.registered] == []
        assert pcm_bytes(synthesize(stub)) == pcm_bytes(plain)  # the next request speaks with the default voice again
    wait_idle(server.engine)


def wav_at(rate):
    buffer = io.BytesIO()
    sf.write(buffer, np.zeros(rate // 2, dtype=np.float32) + 0.1, rate, format="WAV")
    return buffer.getvalue()


BAD_REFERENCES = [
    pytest.param(dict(audio=b""), "reference.audio", "empty", id="empty"),
    pytest.param(dict(audio=recording(seconds=31)), "reference.audio", "over the limit", id="too-long"),
    pytest.param(dict(audio=b"RIFF not really a wave file"), "reference.audio", "cannot be read", id="unreadable"),
    pytest.param(dict(audio=wav_at(4000)), "reference.audio", "sample rate 4000 Hz", id="rate"),
    pytest.param(dict(audio=recording(seconds=0.01)), "reference.audio", "too short", id="too-short"),
    pytest.param(dict(transcript=""), "reference.transcript", "required", id="no-transcript"),
    pytest.param(dict(transcript="x" * 5000), "reference.transcript", "over the limit", id="long-transcript"),
]


@pytest.mark.parametrize("fields, field, words", BAD_REFERENCES)
def test_bad_references_are_invalid_argument_naming_the_field(idle_server, fields, field, words):
    with grpc.insecure_channel(idle_server.target) as channel:
        stub = tts_pb2_grpc.TextToSpeechStub(channel)
        for call in (lambda: synthesize(stub, reference=reference(**fields)),
                     lambda: stub.RegisterVoice(tts_pb2.RegisterVoiceRequest(
                         name="bad", reference=reference(**fields)), timeout=60)):
            with pytest.raises(grpc.RpcError) as caught:
                call()
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert caught.value.details().startswith(f"{field}:") and words in caught.value.details()
        # The server goes on serving.
        assert synthesize(stub)[-1].HasField("complete")


@pytest.mark.parametrize("request_fields, field", [
    (dict(name="Bad Name!"), "name"),
    (dict(name="ok", description="d" * 1001), "description"),  # limits.max_description_chars: 1000
])
def test_bad_registrations_name_the_field(idle_server, request_fields, field):
    with grpc.insecure_channel(idle_server.target) as channel:
        stub = tts_pb2_grpc.TextToSpeechStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.RegisterVoice(tts_pb2.RegisterVoiceRequest(reference=reference(), **request_fields), timeout=60)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details().startswith(f"{field}:")


def test_voice_and_reference_together_are_refused(idle_server):
    with grpc.insecure_channel(idle_server.target) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            synthesize(tts_pb2_grpc.TextToSpeechStub(channel), voice="tara", reference=reference())
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and caught.value.details().startswith("voice:")


def decoded_stream(decoder, codes, settings, prompt_codes):
    """The chunks a DecoderStream with ``settings`` decodes from ``codes`` (all known, as at the end)."""
    from audio_pipeline.decoders.streaming import DecoderStream, decode_windows

    stream = DecoderStream(decoder, prompt_codes=prompt_codes, **dataclasses.asdict(settings))
    parts = []
    while (window := stream.next_window(codes.numel(), True)) is not None:
        parts.append(decode_windows(decoder, [(stream, window, codes[window.start:window.end])])[0].numpy())
    return parts


@pytest.mark.parametrize("flags", [
    ("prepend_prompt_speech_tokens=once", "buffer=14"),
    ("prepend_prompt_speech_tokens=rolling", "buffer=28"),
    ("block_causal=true", "prepend_prompt_speech_tokens=once"),
    ("prepend_prompt_speech_tokens=once", "prepend_prompt_speech_tokens_causal=true", "buffer=14"),
])
def test_cloned_voice_prompt_tokens_reach_the_decoder_and_no_audio_is_lost(tiny_model_dir, tmp_path, flags):
    running = BackgroundServer(make_config(tiny_model_dir, *flags, voices_dir=str(tmp_path / "v"))).start()
    try:
        with grpc.insecure_channel(running.target) as channel:
            stub = tts_pb2_grpc.TextToSpeechStub(channel)
            chunks = list(stub.Synthesize(tts_pb2.SynthesizeRequest(
                text="Cloned and streamed.", reference=reference(),
                sampling=tts_pb2.SamplingParams(max_tokens=70, min_tokens=70, seed=1)), timeout=120))
        audio = [c.audio for c in chunks if c.HasField("audio") and c.audio.num_samples]
        # The same request in the engine, for the tokens it generated.
        engine = running.engine
        context = engine.create_context("Cloned and streamed.", reference=engine.requests.reference_prompt(recording(), TRANSCRIPT),
                                        max_tokens=70, min_tokens=70, seed=1)
        run_to_completion(engine, [context])
        assert chunks[-1].complete.usage.generated_tokens == len(context.generated) == 70
        codes = context.speech_codes(0, len(context.generated))
        settings = engine.core.streaming
        expected = decoded_stream(engine.decoder, codes, settings, context.prompt_speech_codes)
        # Every chunk is the decoder's chunk with the voice's prompt codes before it: none lost, none moved ...
        assert [a.num_samples for a in audio] == [part.size for part in expected]
        assert sum(part.size for part in expected) == 70 // 7 * engine.decoder.samples_per_frame
        for got, want in zip(audio, expected):
            np.testing.assert_allclose(pcm16_to_float(got.data), want, rtol=0, atol=PCM_STEP)
        # ... and the prompt codes made a difference: without them the first chunk sounds otherwise.
        alone = decoded_stream(engine.decoder, codes, settings, None)
        assert np.abs(alone[0] - expected[0]).max() > 1e-3
        wait_idle(running.engine)
    finally:
        running.stop()
