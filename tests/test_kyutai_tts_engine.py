"""Kyutai TTS through the engine (the paged KV cache with its sliding window, the runner's text
stream, the request's rule, Mimi streamed): greedy requests give the reference's fixtures
(tests/fixtures/kyutai_tts) exactly: every fed text id, every audio code, the audio within 1e-4,
alone and batched with each other; voices and refusals name their field."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from audio_pipeline.errors import RequestError
from helpers import run_to_completion, start_engine

FIXTURES = Path(__file__).parent / "fixtures" / "kyutai_tts"
#: Cases the engine serves as the reference generated them: one text each, guidance distilled or off.
SERVED = {"distilled": ["distilled_one", "distilled_batch", "distilled_long"], "plain": ["plain_no_cfg"]}


def _case(name: str) -> dict:
    return json.loads((FIXTURES / "cases" / name / "case.json").read_text())


@pytest.fixture(scope="module", params=sorted(SERVED))
def engine(request):
    engine = start_engine(FIXTURES / "models" / request.param, "chunk_size=96,128", "sampling.max_tokens=400",
                          model={"kv_cache": {"cache_dtype": "float32"}})
    engine.variant = request.param
    yield engine
    engine.stop()


def _requests(engine, names):
    """(context, case name, item) of every item of the cases, greedy."""
    out = []
    for name in names:
        case = _case(name)
        for item, (script, voice) in enumerate(zip(case["script"], case["voices"])):
            context = engine.create_context(script[0], voice=voice, temperature=0.0)
            out.append((context, name, item))
    return out


def _check(context, chunks, name: str, item: int) -> None:
    directory = FIXTURES / "cases" / name
    case = _case(name)
    fed = np.load(directory / "text_tokens.npy")[item, :, 1]
    assert context.generated == fed[:len(context.generated)].tolist()
    assert context.text_rule.end_step == case["end_steps"][item]
    assert context.text_rule.state.transcript == [tuple(pair) for pair in case["transcripts"][item]]
    frames = np.load(directory / "frames.npy")[:, item, 1:]
    count = case["end_steps"][item] + 2
    codes = context.layout.audio_codes(context.frames, 0, count).view(count, -1).numpy()
    start = case["delay_steps"]
    np.testing.assert_array_equal(codes, frames[start:start + count])
    audio = np.concatenate(chunks)
    np.testing.assert_allclose(audio, np.load(directory / f"audio_{item}.npy"), atol=1e-4, rtol=0)
    assert len(chunks) > 1  # streamed in chunks


def test_each_case_alone_equals_the_reference(engine):
    for context, name, item in _requests(engine, SERVED[engine.variant]):
        [chunks] = run_to_completion(engine, [context])
        _check(context, chunks, name, item)


def test_the_cases_batched_together_equal_the_reference(engine):
    requests = _requests(engine, SERVED[engine.variant])
    results = run_to_completion(engine, [context for context, _, _ in requests])
    for (context, name, item), chunks in zip(requests, results):
        _check(context, chunks, name, item)


def test_voices_are_named_as_published_and_refusals_name_their_field(engine):
    layout = engine.layout
    assert layout.voice_names == ("expresso/ex03-ex01_happy_001_channel1_334s", "vctk/p225_023")
    for name in ("vctk/p225_023", "vctk/p225_023.wav", "p225_023", "p225_023.wav"):
        assert engine.create_context("Hello.", voice=name).prompt_ids == \
            engine.create_context("Hello.", voice="vctk/p225_023").prompt_ids
    with pytest.raises(RequestError) as refused:
        engine.create_context("Hello.", voice="nobody")
    assert refused.value.field == "voice"


@pytest.mark.slow
def test_served_over_grpc_http_and_the_websocket_with_its_voices_and_clear_errors(tmp_path):
    """A checkpoint laid out as published (no manifest) behind the real server (the engine core in
    its own process): gRPC streams the reference's audio (greedy, as PCM16), /v1/audio/voices lists
    the voices folder, OpenAI's speech route (a voice by its file name) and the WebSocket speak what
    gRPC speaks for the same seed; a reference recording or an unknown voice is refused naming the
    field."""
    import grpc
    import httpx

    from audio_pipeline.config import AudioGenerationConfig
    from audio_pipeline.testing.background import BackgroundServer
    from helpers import pcm_of, recording, socket_session, synthesize

    config = AudioGenerationConfig.load(
        env={}, audio_flags=["grace_period_s=5", "sampling.max_tokens=400"],
        model={"model_path": str(FIXTURES / "models" / "distilled"), "device": "cpu",
               "kv_cache": {"cache_dtype": "float32"}}, voices_dir=str(tmp_path / "voices"))
    server = BackgroundServer(config, http_port=0).start()
    try:
        case = _case("distilled_one")
        text, voice = case["script"][0][0], case["voices"][0]
        reference = np.load(FIXTURES / "cases" / "distilled_one" / "audio_0.npy")
        chunks = synthesize(server.target, text, voice=voice, temperature=0.0)
        np.testing.assert_allclose(pcm_of(chunks).astype(np.float32) / 32768, reference, atol=1e-4, rtol=0)
        voices = httpx.get(f"{server.http_url}/v1/audio/voices", timeout=30).json()
        assert {v["name"] for v in voices["voices"] if not v["registered"]} == set(_case("distilled_batch")["voices"])
        # The other doors take a seed, not a temperature: the family's sampling, the same audio as gRPC's.
        seeded = pcm_of(synthesize(server.target, text, voice=voice, seed=7)).tobytes()
        spoken = httpx.post(f"{server.http_url}/v1/audio/speech", timeout=120,
                            json={"model": "tts", "input": text, "voice": "ex03-ex01_happy_001_channel1_334s.wav",
                                  "response_format": "pcm", "seed": 7})
        assert spoken.status_code == 200, spoken.text
        assert spoken.content == seeded
        received, audio = socket_session(server, [
            {"type": "start", "context_id": "a", "voice": voice, "seed": 7},
            {"type": "text", "context_id": "a", "text": text}, {"type": "end", "context_id": "a"}])
        assert [e["type"] for e in received if e["type"] in ("done", "error")] == ["done"], received
        assert audio["a"] == seeded
        for fields, name in ((dict(reference=recording(rate=24000)), "reference"), (dict(voice="nobody"), "voice")):
            with pytest.raises(grpc.RpcError) as error:
                synthesize(server.target, "Hello.", **fields)
            assert error.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
            assert name in error.value.details(), error.value.details()
    finally:
        server.stop()
