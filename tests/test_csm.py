"""CSM (family "csm"): a Llama backbone that samples one Mimi frame per pass, codebook 0 from the
backbone and the others from a depth decoder. On a tiny random checkpoint the test writes with
transformers' own CsmForConditionalGeneration (so the files and key names are a real
checkpoint's): detection from the directory alone, the conversation prompt and its audio frames,
greedy frames against transformers' generate alone and batched, seeded frames the same in any
batch, a reference turn reaching the model, and served for real over gRPC and HTTP, streamed."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf
import torch

from audio_pipeline.errors import NotFound
from audio_pipeline.layouts.manifest import ModelManifest, declared_audio_decoder
from audio_pipeline.layouts.registry import detect_family
from csm_model import hf_generate_frames, write_tiny_csm
from helpers import (TRANSCRIPT, alone_and_together, audio_of, make_config, pcm_of, run_to_completion,
                     start_engine, synthesize, wait_idle)
from helpers import recording as any_recording  # this module's recording() is at the model's 24 kHz

#: The tiny checkpoint's Mimi: 8 codebooks a frame.
FLAGS = ("chunk_size=32,64",)


def recording(pitch=180.0) -> bytes:
    return any_recording(rate=24000, pitch=pitch)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_csm(tmp_path_factory.mktemp("csm") / "model", seed=0)


@pytest.fixture(scope="module")
def engine(model_dir):
    engine = start_engine(model_dir, *FLAGS)
    yield engine
    engine.stop(0.0)




def until_stop(frames, stop_code=0):
    """transformers' frames up to its stop frame (codebooks but the last all ``stop_code``)."""
    for index, frame in enumerate(frames):
        if all(code == stop_code for code in frame[:-1]):
            return frames[:index]
    return frames


# --- the checkpoint and the prompt ------------------------------------------------------------------

def test_a_csm_checkpoint_directory_is_detected_with_its_own_mimi(model_dir):
    """No manifest: config.json's model_type says CSM, and its Mimi codec (the checkpoint's
    codec_model.* tensors) is the decoder, read from the same directory."""
    from safetensors import safe_open

    assert not (model_dir / "audio_pipeline.json").exists()
    assert detect_family(model_dir).name == "csm"
    manifest = ModelManifest.read(model_dir)
    assert (manifest.family, manifest.audio_decoder, manifest.default_voice) == ("csm", "mimi", "0")
    assert declared_audio_decoder(str(model_dir)) == "mimi"
    keys = set()
    for path in model_dir.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            keys.update(f.keys())
    for prefix in ("backbone_model.layers.", "depth_decoder.model.layers.", "depth_decoder.codebooks_head",
                   "embed_text_tokens", "codec_model."):
        assert any(k.startswith(prefix) for k in keys), prefix


def test_the_prompt_is_a_speaker_turn_and_a_reference_is_an_earlier_turn_with_its_frames(engine):
    layout, tokenizer = engine.layout, engine.tokenizer
    text_ids = tokenizer("[0]Hello there.", add_special_tokens=False).input_ids
    context = engine.create_context("Hello there.")
    assert context.prompt_ids == [layout.bos, *text_ids, layout.eos]
    assert context.prompt_frames is None
    speaker = engine.create_context("Hello there.", voice="1")
    assert speaker.prompt_ids[1:-1] == tokenizer("[1]Hello there.", add_special_tokens=False).input_ids
    with pytest.raises(NotFound) as error:  # the speakers are the model's: 0 and 1
        engine.create_context("Hello.", voice="narrator")
    assert error.value.field == "voice"

    reference = engine.requests.reference_prompt(recording(), TRANSCRIPT)
    frames = reference.codes.view(-1, layout.codes_per_token)
    cloned = engine.create_context("Hello there.", reference=reference)
    turn = [layout.bos, *tokenizer(f"[0]{TRANSCRIPT}", add_special_tokens=False).input_ids, layout.eos]
    audio = [layout.audio] * frames.shape[0] + [layout.audio_eos]
    assert cloned.prompt_ids == turn + audio + context.prompt_ids
    rows = cloned.prompt_frames
    assert rows.shape == (len(cloned.prompt_ids), layout.codes_per_token)
    assert torch.equal(rows[len(turn):len(turn) + frames.shape[0]], frames)
    assert torch.equal(rows[len(turn) + frames.shape[0]], torch.zeros(layout.codes_per_token, dtype=torch.long))
    assert (rows[:len(turn), 0] == -1).all() and (rows[len(turn) + len(audio):, 0] == -1).all()


def test_the_stop_frame_is_transformers_rule():
    from audio_pipeline.layouts.csm import CsmLayout

    layout = CsmLayout(codebook_size=16, codes_per_token=4, bos=1, eos=4, audio=2, audio_eos=3)
    assert layout.ends_speech([0, 0, 0, 0]) and layout.ends_speech([0, 0, 0, 9])
    assert not layout.ends_speech([0, 5, 0, 0]) and not layout.ends_speech([3, 0, 0, 0])


# --- frames against transformers -------------------------------------------------------------------

TEXTS = ("Hello there.", "A second sentence, a little longer.", "Third.")


def test_greedy_frames_equal_transformers_generate_alone_and_batched(engine, model_dir):
    """Every frame (codebook 0 from the backbone, the others from the depth decoder) equals
    CsmForConditionalGeneration.generate's greedy frames, up to its stop frame."""
    frames = 12
    alone = []
    for text in TEXTS:
        context = engine.create_context(text, temperature=0.0, repetition_penalty=1.0, max_tokens=frames)
        run_to_completion(engine, [context])
        alone.append(context)
    batched = [engine.create_context(text, temperature=0.0, repetition_penalty=1.0, max_tokens=frames)
               for text in TEXTS]
    run_to_completion(engine, batched)
    for one, together in zip(alone, batched):
        expected = until_stop(hf_generate_frames(model_dir, one.prompt_ids, frames))
        assert one.frames == expected
        assert together.frames == expected
        assert one.generated == [frame[0] for frame in expected]
    assert len({tuple(map(tuple, c.frames)) for c in alone}) == len(TEXTS)


def test_seeded_frames_are_the_same_alone_and_in_any_batch(engine):
    """Sampling (backbone and depth decoder) draws from each request's own generator."""
    def contexts():
        return [engine.create_context(text, seed=7 + i, temperature=0.9, top_k=8, max_tokens=10)
                for i, text in enumerate(TEXTS)]

    alone = []
    for context in contexts():
        run_to_completion(engine, [context])
        alone.append(context.frames)
    batched = contexts()
    run_to_completion(engine, batched)
    assert [c.frames for c in batched] == alone
    assert any(len(set(frame)) > 1 for frames in alone for frame in frames)


def test_a_reference_turn_reaches_the_model_and_the_prefix_cache_tells_references_apart(engine):
    """Two references of the same length give two prompts of the same token ids: their frames
    differ, and so does what the model says after them (the prefix cache must not mix them)."""
    from audio_pipeline.service.voices import VoicePrompt

    # Codes as a registered voice holds them (the tiny random codec's encoder hears every
    # recording as nearly the same codes).
    shape = engine.requests.reference_prompt(recording(), TRANSCRIPT).codes.shape
    first, second = (VoicePrompt(TRANSCRIPT, torch.randint(0, 16, shape, generator=torch.Generator().manual_seed(s)))
                     for s in (1, 2))
    outputs = []
    for reference in (first, second, first):
        context = engine.create_context("Hello there.", reference=reference, temperature=0.0, max_tokens=8)
        run_to_completion(engine, [context])
        outputs.append(context.frames)
    plain = engine.create_context("Hello there.", temperature=0.0, max_tokens=8)
    run_to_completion(engine, [plain])
    assert outputs[0] == outputs[2]
    assert outputs[0] != outputs[1]
    assert plain.frames not in (outputs[0], outputs[1])


# --- served ------------------------------------------------------------------------------------------







@pytest.mark.slow
def test_served_streams_batched_sound_as_they_do_alone_and_http_speaks_a_speaker(model_dir):
    """Through the real server: three streams at once (two speakers and a reference turn) each
    stream, chunk by chunk, the audio they give alone (to the last bit's rounding), every one its
    frames' samples;
    OpenAI's speech route writes a WAV of speaker 1."""
    import httpx

    from audio_pipeline.testing.background import BackgroundServer

    server = BackgroundServer(make_config(model_dir, *FLAGS), http_port=0).start()
    try:
        requests = [dict(voice="0"), dict(voice="1"), dict(reference=recording(pitch=240.0))]

        def speak(index):
            return synthesize(server.target, f"Sentence number {index}.", seed=index, max_tokens=24,
                              **requests[index])

        alone, together = alone_and_together(speak, 3)
        samples_per_frame = server.engine.decoder.samples_per_frame
        for one, batched in zip(alone, together):
            usage = batched[-1].complete.usage
            heard = pcm_of(batched)
            assert len(audio_of(batched)) >= 2  # streamed in chunks
            assert heard.size == usage.generated_tokens * samples_per_frame
            assert usage.generated_tokens == one[-1].complete.usage.generated_tokens
            # The same frames; Mimi's batched blocks round differently from a lone stream's (1 LSB).
            np.testing.assert_allclose(heard.astype(int), pcm_of(one).astype(int), rtol=0, atol=1)
        response = httpx.post(f"{server.http_url}/v1/audio/speech", timeout=120,
                              json={"model": "tts", "input": "Hello from speaker one.", "voice": "1",
                                    "response_format": "wav"})
        assert response.status_code == 200, response.text
        wave, rate = sf.read(io.BytesIO(response.content))
        assert rate == 24000 and wave.size > 0 and wave.size % samples_per_frame == 0
        wait_idle(server.engine)
    finally:
        server.stop()


@pytest.mark.parametrize("flags", [("enable_overlap_scheduler=true",), ("max_num_steps=1", "model.kv_cache.enable_prefix_caching=false")])
def test_greedy_frames_are_the_same_with_overlap_and_one_pass_a_round(model_dir, flags):
    """Frames sampled on the device feed the next pass there (overlap, multi-step rounds) or
    through the host (one pass a round): the same frames."""
    engine = start_engine(model_dir, *FLAGS, *flags)
    try:
        contexts = [engine.create_context(text, temperature=0.0, repetition_penalty=1.0, max_tokens=10)
                    for text in TEXTS]
        run_to_completion(engine, contexts)
        for context in contexts:
            assert context.frames == until_stop(hf_generate_frames(model_dir, context.prompt_ids, 10))
    finally:
        engine.stop(0.0)


def test_the_familys_streaming_and_sampling_defaults(model_dir):
    """Without flags a CSM model streams Mimi block-causally from 2 frames and samples as Sesame's
    generator does; flags still win."""
    from audio_pipeline.config import AudioGenerationConfig

    bare = AudioGenerationConfig.load(env={}, audio_flags=[], model={"model_path": str(model_dir)})
    assert bare.resolved_audio_decoder == "mimi"
    assert (bare.sampling.temperature, bare.sampling.top_k, bare.sampling.top_p) == (0.9, 50, 1.0)
    assert (bare.chunk_size, bare.block_causal) == ([64, 128, 256], True)
    flagged = AudioGenerationConfig.load(env={}, audio_flags=["chunk_size=32", "sampling.top_k=5"],
                                         model={"model_path": str(model_dir)})
    assert (flagged.chunk_size, flagged.sampling.top_k) == ([32], 5)


def test_int8_quantization_is_refused_for_csm_before_its_weights_load(model_dir, monkeypatch):
    from audio_pipeline.service.engine import TTSEngine
    from audio_pipeline.models import csm_model

    def no_load(*args, **kwargs):
        raise AssertionError("the weights loaded before the setting was checked")

    monkeypatch.setattr(csm_model, "load_safetensors_into", no_load)
    with pytest.raises(ValueError, match=r"model\.quantization=int8 is not supported for this model \(CsmPipelineModel\)"):
        TTSEngine(make_config(model_dir, *FLAGS, "model.quantization=int8"))
