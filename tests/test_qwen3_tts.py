"""Qwen3-TTS served exactly as its reference generates it: the golden fixtures in
tests/fixtures/qwen3_tts/ (made by scripts/qwen3_tts_reference/ with qwen-tts 0.1.1 on tiny random
CustomVoice, VoiceDesign and Base checkpoints) against the engine's own layout, model and runner.

Per case the reference recorded its prompt embeddings, its talker's first logits and its greedy
frames (``generate(do_sample=False, subtalker_dosample=False)`` with its default repetition penalty,
minimum length and suppression). Here the same prompt is built by the layout, the same logits come
from the engine's model on the paged cache, and the same frames come out of the engine, alone and
batched with other requests.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from audio_pipeline.config import AudioGenerationConfig
from audio_pipeline.layouts.qwen3_tts import Qwen3TTSLayout
from audio_pipeline.checkpoints.qwen3_tts_config import read_config
from audio_pipeline.models.qwen3_tts import Qwen3TTSSpeechLM
from audio_pipeline.models.weights import load_safetensors_into
from audio_pipeline.service.voices import VoicePrompt
from helpers import audio_of, recording, run_requests, socket_session, synthesize
from qwen3_tts_cases import CASES, FIXTURES, case_array, case_info, case_request, model_copy


def engine_for(model_dir: Path, *flags: str):
    from audio_pipeline.service.engine import TTSEngine

    # Float32 throughout (model.prompt_dtype): the reference's greedy frames are float32 ones.
    config = AudioGenerationConfig.load(env={}, audio_flags=["normalize_text=false", "grace_period_s=5", *flags],
                                        model={"model_path": str(model_dir), "device": "cpu", "prompt_dtype": "float32"})
    engine = TTSEngine(config)
    engine.start()
    return engine


def load_model(kind: str) -> tuple[Qwen3TTSSpeechLM, Qwen3TTSLayout, object]:
    from transformers import AutoTokenizer

    directory = FIXTURES / "models" / kind
    config = read_config(directory)
    with torch.device("meta"):
        model = Qwen3TTSSpeechLM(config)
    load_safetensors_into(model, directory, torch.float32, torch.device("cpu"), ignore_prefixes=("speaker_encoder.",))
    model.reset_rotary(torch.device("cpu"))
    return model.eval(), Qwen3TTSLayout.from_config(config), AutoTokenizer.from_pretrained(directory)


def case_prompt(name: str):
    info, inputs, kind = case_info(name)
    model, layout, tokenizer = load_model(kind)
    layout = dataclasses.replace(layout, streaming_text=not inputs["non_streaming_mode"])
    request = case_request(name)
    prompt = layout.build_prompt(tokenizer, inputs["text"], request["voice"], request["reference"],
                                 language=inputs["language"], instructions=request.get("instructions"))
    return model, layout, prompt, request["reference"]


@pytest.mark.parametrize("name", CASES)
def test_the_prompt_and_its_text_track_embed_as_the_reference(name):
    """Every mode's prompt (presets in both text modes, dialect speakers, an instruction, a
    designed voice, x-vector and in-context cloning): the codec track, the text track and the
    speaker vector sum to the reference's prompt embeddings, and the generated frames' text track
    is the reference's trailing text."""
    model, layout, prompt, reference = case_prompt(name)
    track = layout.text_track(prompt)
    vectors = None
    if track.vectors:
        rows = torch.tensor(sorted(track.vectors))
        vectors = (rows, torch.stack([track.vectors[int(r)] for r in rows]))
    with torch.no_grad():
        embeds = model.embed(torch.tensor(list(prompt)), layout.prompt_frames(prompt, reference),
                             torch.tensor(track.prompt), vectors)
        trailing = model.project_text(torch.tensor(track.generated or [track.pad]))
    np.testing.assert_allclose(embeds.numpy(), case_array(name, "prompt_embeds.npy"), atol=1e-5, rtol=0)
    np.testing.assert_allclose(trailing.numpy(), case_array(name, "trailing_text_hidden.npy"), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["custom_voice_serena_en_nonstreaming", "voice_design_streaming",
                                  "base_icl_streaming_long_text"])
def test_the_talkers_first_logits_and_the_code_predictors_frame_are_the_reference(name):
    """The talker on the engine's paged cache gives the reference's first-step logits; the code
    predictor, given the reference's codebook 0, its first frame's logits and codes (greedy)."""
    from audio_pipeline.config import KVCacheConfig
    from audio_pipeline.core.kv_cache import PagedKVCacheManager
    from audio_pipeline.models.qwen3_tts_model import Qwen3TTSPipelineModel

    model, layout, prompt, reference = case_prompt(name)
    track = layout.text_track(prompt)
    params = Qwen3TTSPipelineModel.get_kv_params(model.qwen3_tts_config, 1, KVCacheConfig(kv_cache_page_size=4),
                                                 torch.float32)
    kv = PagedKVCacheManager(params, torch.device("cpu"), 64, enable_prefix_caching=False,
                             num_heads=model.config.num_attention_heads)
    kv.claim("r")
    kv.block_manager.alloc("r", len(prompt))
    vectors = None
    if track.vectors:
        rows = torch.tensor(sorted(track.vectors))
        vectors = (rows, torch.stack([track.vectors[int(r)] for r in rows]))
    with torch.no_grad():
        hidden = model(torch.tensor(list(prompt)), torch.arange(len(prompt)), kv.batch(["r"], [0], [len(prompt)]),
                       layout.prompt_frames(prompt, reference), torch.tensor(track.prompt), vectors)
        logits = model.compute_logits(hidden[-1:])[0]
    np.testing.assert_allclose(logits.numpy(), case_array(name, "talker_logits_first_step.npy"), atol=1e-4, rtol=0)
    first = torch.tensor([int(case_array(name, "codes.npy")[0, 0])])
    seen = []

    def greedy(k, scores):
        seen.append(scores[0].numpy().copy())
        return scores.argmax(dim=-1)

    frame = model.depth_frame(hidden[-1:], first, greedy)
    np.testing.assert_allclose(np.stack(seen), case_array(name, "code_predictor_logits.npy")[0], atol=1e-4, rtol=0)
    assert frame[0].tolist() == case_array(name, "codes.npy")[0].tolist()


@pytest.mark.parametrize("name", CASES)
def test_greedy_frames_through_the_engine_are_the_reference(name, tmp_path):
    """Each case alone through the engine (its layout options from a manifest): the reference's
    frames, ending where it ended (on the codec's end of speech, or at its frame budget)."""
    info, inputs, kind = case_info(name)
    engine = engine_for(model_copy(tmp_path, kind, inputs["language"].lower(), not inputs["non_streaming_mode"]))
    try:
        [context] = run_requests(engine, [case_request(name)], [inputs["text"]])
    finally:
        engine.stop()
    assert context.frames == case_array(name, "codes.npy").tolist()
    # Within the 16 frames the reference ended on the codec's end of speech where it made fewer.
    assert context.stop_reason.value == ("end_of_speech" if info["num_frames"] < 16 else "max_tokens")


BATCHES = {  # cases that share a checkpoint, language and text mode, served together
    ("custom_voice", "english", False): ["custom_voice_serena_en_nonstreaming", "custom_voice_ryan_instruct"],
    ("base", "english", True): ["base_icl_streaming_long_text", "base_icl_streaming_short_text",
                                "base_xvector_streaming"],
    ("base", "english", False): ["base_icl_nonstreaming", "base_xvector_nonstreaming"],
}


@pytest.mark.parametrize("key", list(BATCHES), ids=["-".join(map(str, key)) for key in BATCHES])
def test_greedy_frames_batched_with_other_requests_are_the_reference(key, tmp_path):
    """The cases of one checkpoint at once, beside sampled requests of other voices (other prompt
    lengths, both ends of a stop), in-flight batching on: each case's frames are still the
    reference's, and the prefix cache never lends one voice's positions to another."""
    kind, language, streaming = key
    names = BATCHES[key]
    engine = engine_for(model_copy(tmp_path, kind, language, streaming), "enable_in_flight_batching=true",
                        "max_batch_input_tokens=40")
    try:
        requests = [case_request(name) for name in names]
        texts = [case_info(name)[1]["text"] for name in names]
        for index, name in enumerate(names):  # the same voice and text, sampled: a shared prefix
            requests.append({**case_request(name), "temperature": 0.9, "top_k": 50, "seed": index})
            texts.append(texts[index])
        contexts = run_requests(engine, requests, texts)
    finally:
        engine.stop()
    for name, context in zip(names, contexts):
        assert context.frames == case_array(name, "codes.npy").tolist(), name


def test_seeded_sampling_gives_the_same_frames_alone_and_batched(tmp_path):
    model_dir = model_copy(tmp_path, "custom_voice", "english", False)
    text = "Hello world. This is a tiny test."
    request = {"voice": "serena", "temperature": 0.9, "top_k": 50, "seed": 7, "max_tokens": 12}
    engine = engine_for(model_dir)
    try:
        [alone] = run_requests(engine, [request], [text])
        batched = run_requests(engine, [{**request, "voice": "ryan", "seed": 1}, request,
                                        {**request, "voice": "eric", "seed": 2}],
                               ["Other words, here.", text, "And more."])
    finally:
        engine.stop()
    assert alone.frames == batched[1].frames and len(alone.frames) > 1
    assert batched[0].frames != alone.frames


def test_the_code_predictors_frame_on_its_graph_buffers_gives_the_eager_frames(tmp_path):
    """The code predictor's frame as its CUDA graphs hold it (core/depth_graphs.py), run here on the
    graphs' own buffers without a capture: rows copied into a bucket's first rows, the padding rows
    left from an earlier step, the prefix or whole-row rule. A greedy and two seeded requests
    batched speak the frames they speak without it, and the steps went through the buffers."""
    from audio_pipeline.core.depth_graphs import DepthGraphs

    model_dir = model_copy(tmp_path, "custom_voice", "english", False)
    requests = [{"voice": "serena", "temperature": 0.0, "max_tokens": 12},
                {"voice": "ryan", "temperature": 0.9, "top_k": 50, "seed": 7, "max_tokens": 12},
                {"voice": "eric", "temperature": 1.1, "top_p": 0.8, "seed": 3, "max_tokens": 12}]
    texts = ["Hello world. This is a tiny test.", "Other words, here.", "And more."]
    runs = []
    for graphs in (False, True):
        engine = engine_for(model_dir)
        try:
            runner = engine.core.runner
            sampling = runner.frame_sampling
            if graphs:
                sampling.graphs = DepthGraphs(sampling, (1, 2, 4), hidden_size=int(runner.model.model.config.hidden_size),
                                              dtype=runner.model.dtype, device=runner.device,
                                              codebook=runner.layout.codebook_size, capture=False)
            runs.append([context.frames for context in run_requests(engine, requests, texts)])
            replays = sampling.graphs.replays if graphs else 0
        finally:
            engine.stop()
    assert runs[1] == runs[0] and all(len(frames) > 1 for frames in runs[0])
    assert replays >= len(runs[0][0]) - 1


def test_the_prefix_cache_never_shares_two_speaker_vectors(tmp_path):
    """Two x-vector clones with the same text and transcript differ only in the speaker slot: the
    second must not reuse the first's cached positions from there on (its frames are its own)."""
    name = "base_xvector_streaming"
    inputs = case_info(name)[1]
    engine = engine_for(model_copy(tmp_path, "base", "english", True))
    try:
        request = case_request(name)
        other = VoicePrompt("", request["reference"].codes, -request["reference"].speaker_embedding)
        [first] = run_requests(engine, [request], [inputs["text"]])
        [moved] = run_requests(engine, [{**request, "reference": other}], [inputs["text"]])
        [again] = run_requests(engine, [request], [inputs["text"]])
    finally:
        engine.stop()
    assert first.frames == again.frames == case_array(name, "codes.npy").tolist()
    assert moved.frames != first.frames
    assert moved.cache_prompt != first.cache_prompt and moved.cache_prompt[:3] == first.cache_prompt[:3]


@pytest.mark.slow
def test_served_over_grpc_http_and_the_websocket_with_its_presets_and_clear_errors(tmp_path):
    """A CustomVoice checkpoint as published (no manifest) behind the real server: gRPC streams a
    preset speaker's frames in chunks (the first after one frame); /v1/audio/voices lists the
    presets; OpenAI's speech route speaks one with a style instruction (which changes the speech);
    the WebSocket speaks one; a reference recording or an unknown speaker is refused naming the field."""
    import grpc
    import httpx

    from audio_pipeline.testing.background import BackgroundServer

    config = AudioGenerationConfig.load(env={}, audio_flags=["grace_period_s=5", "sampling.max_tokens=48"],
                                        model={"model_path": str(FIXTURES / "models" / "custom_voice"), "device": "cpu"},
                                        voices_dir=str(tmp_path / "voices"))
    server = BackgroundServer(config, http_port=0).start()
    try:
        frame = server.engine.samples_per_frame
        chunks = synthesize(server.target, "Hello world, this is a tiny test.", voice="serena", seed=1, max_tokens=12)
        usage = chunks[-1].complete.usage
        heard = audio_of(chunks)
        assert len(heard) >= 2 and heard[0].size == frame  # the first chunk: one frame (80 ms at 12.5 Hz)
        assert sum(piece.size for piece in heard) == usage.generated_tokens * frame
        voices = httpx.get(f"{server.http_url}/v1/audio/voices", timeout=30).json()
        names = {voice["name"] for voice in voices["voices"] if not voice["registered"]}
        assert names == {"aiden", "dylan", "eric", "ono_anna", "ryan", "serena", "sohee", "uncle_fu", "vivian"}
        body = {"model": "tts", "input": "Today the weather is sunny.", "voice": "ryan", "response_format": "pcm",
                "seed": 3}
        plain = httpx.post(f"{server.http_url}/v1/audio/speech", json=body, timeout=120)
        styled = httpx.post(f"{server.http_url}/v1/audio/speech", timeout=120,
                            json={**body, "instructions": "Speak with a cheerful tone, please."})
        assert plain.status_code == styled.status_code == 200, styled.text
        assert plain.content and styled.content and plain.content != styled.content
        received, audio = socket_session(server, [{"type": "start", "context_id": "a", "voice": "eric", "seed": 2},
                                                  {"type": "text", "context_id": "a", "text": "Hello there."},
                                                  {"type": "end", "context_id": "a"}])
        assert [e["type"] for e in received if e["type"] in ("done", "error")] == ["done"] and audio["a"], received
        styled = synthesize(server.target, "Today the weather is sunny.", voice="ryan", seed=3, max_tokens=12,
                            instructions="Speak with a cheerful tone, please.")
        plain = synthesize(server.target, "Today the weather is sunny.", voice="ryan", seed=3, max_tokens=12)
        assert audio_of(styled) and [a.tolist() for a in audio_of(styled)] != [a.tolist() for a in audio_of(plain)]
        from audio_pipeline_client import TTSClient

        with TTSClient(server.target) as client:  # the client library sends both fields
            spoken = client.synthesize("Today the weather is sunny.", voice="ryan", seed=3, max_tokens=12,
                                       instructions="Speak with a cheerful tone, please.", language="english")
        assert spoken.samples.size > 0
        for fields, name in ((dict(voice="serena", language="klingon"), "language"),
                             (dict(voice="serena", reference=recording(rate=24000)), "voice"),
                             (dict(reference=recording(rate=24000)), "reference"),
                             (dict(voice="nobody"), "voice")):
            with pytest.raises(grpc.RpcError) as error:
                synthesize(server.target, "Hello.", **fields)
            assert error.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
            assert name in error.value.details(), error.value.details()
    finally:
        server.stop()


@pytest.mark.slow
def test_a_base_model_clones_a_registered_voice_by_its_reference_codes_and_speaker_vector(tmp_path):
    """Registering the fixture's recording on a Base checkpoint keeps what the reference computes
    from it: its codes (the speech tokenizer's encode) and its x-vector (the speaker encoder); the
    voice then speaks over gRPC, and after a restart its x-vector is the same (read from its
    reference.flac)."""
    from audio_pipeline_client import TTSClient

    from audio_pipeline.testing.background import BackgroundServer

    wav = (FIXTURES / "reference_24k.wav").read_bytes()
    config = AudioGenerationConfig.load(env={}, audio_flags=["grace_period_s=5", "sampling.max_tokens=48"],
                                        model={"model_path": str(FIXTURES / "models" / "base"), "device": "cpu"},
                                        voices_dir=str(tmp_path / "voices"))
    for attempt in range(2):
        server = BackgroundServer(config).start()
        try:
            with TTSClient(server.target) as client:
                if attempt == 0:
                    client.register_voice("me", wav, "Speak with a cheerful tone.")
                samples = client.synthesize("Hi.", voice="me", seed=1, max_tokens=8).samples
            assert samples.size > 0
            prompt = server.engine.voice_catalogue.store.get("me").prompt
            np.testing.assert_allclose(prompt.speaker_embedding.numpy(),
                                       np.load(FIXTURES / "speaker_encoder" / "reference_xvector.npy"), atol=1e-5, rtol=0)
            assert prompt.codes.view(-1, 16).tolist() == np.load(
                FIXTURES / "speech_tokenizer" / "encode_reference_codes.npy").tolist()
        finally:
            server.stop()


def test_a_random_model_of_a_real_shape_serves_for_the_benchmark(tmp_path):
    """bench.serve --random-model qwen3-tts-*: a CustomVoice directory whose talker is drawn at load,
    with the published decoder's rates (1920 samples a frame at 24 kHz) and preset speakers."""
    from audio_pipeline.layouts.manifest import ModelManifest
    from audio_pipeline.testing.random_models import write_random_model

    model_dir = write_random_model(tmp_path / "random", "qwen3-tts-tiny")
    assert ModelManifest.read(model_dir).random_weights and not (model_dir / "model.safetensors").exists()
    engine = engine_for(model_dir, "sampling.min_tokens=6", "sampling.max_tokens=6")
    try:
        result = engine.synthesize("Hello there.", voice="serena", seed=1)
    finally:
        engine.stop()
    assert result.sample_rate == 24000 and result.samples.size == 6 * 1920


@pytest.mark.parametrize("name,spelling", [("custom_voice_serena_en_nonstreaming", None),
                                           ("custom_voice_serena_en_nonstreaming", "en-US"),
                                           ("custom_voice_eric_dialect_chinese", None),
                                           ("custom_voice_eric_dialect_chinese", "zh")])
def test_a_requests_language_is_the_prompts(name, spelling, tmp_path):
    """The language a request names (here on a model whose setting is auto), as the reference
    names it or as a code or BCP 47 tag, makes the reference's prompt and frames; a dialect speaker
    asked for Chinese speaks its dialect."""
    info, inputs, kind = case_info(name)
    engine = engine_for(model_copy(tmp_path, kind, "auto", False))
    try:
        [context] = run_requests(engine, [{**case_request(name), "language": spelling or inputs["language"]}],
                                 [inputs["text"]])
    finally:
        engine.stop()
    assert context.frames == case_array(name, "codes.npy").tolist()


def test_the_languages_are_the_checkpoints_and_another_is_refused(tmp_path):
    """A Qwen3-TTS model speaks the languages its checkpoint names (its dialects by their names),
    each in any usual spelling, and auto; another is refused naming the field and listing them."""
    from audio_pipeline.errors import InvalidArgument

    engine = engine_for(model_copy(tmp_path, "custom_voice", "english", False))
    try:
        assert engine.languages.entries == ("beijing_dialect", "chinese", "english", "french", "german", "italian",
                                            "japanese", "korean", "portuguese", "russian", "sichuan_dialect",
                                            "spanish")
        for spelling, resolved in (("German", "german"), ("de", "german"), ("deu", "german"), ("ger", "german"),
                                   ("pt-BR", "portuguese"), ("Beijing_Dialect", "beijing_dialect"),
                                   ("Auto", "auto"), ("auto", "auto")):
            assert engine.languages.resolve(spelling) == resolved, spelling
        # Auto is the model's choice even where the manifest names a language: no language id.
        auto = engine.create_context("Hello.", voice="ryan", language="Auto", max_tokens=16)
        english = engine.create_context("Hello.", voice="ryan", max_tokens=16)
        assert engine.layout.language_id("auto", None) is None
        assert len(auto.prompt_ids) == len(english.prompt_ids) - 1
        with pytest.raises(InvalidArgument) as refused:
            engine.create_context("Hello.", voice="ryan", language="Hindi", max_tokens=16)
        assert refused.value.field == "language"
        assert str(refused.value) == (
            "language: 'Hindi' is not a language this model speaks; supported: beijing_dialect, Chinese (zh), "
            "English (en), French (fr), German (de), Italian (it), Japanese (ja), Korean (ko), Portuguese (pt), "
            "Russian (ru), sichuan_dialect, Spanish (es), or auto")
    finally:
        engine.stop()
