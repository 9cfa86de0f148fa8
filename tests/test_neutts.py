"""NeuTTS (family "neutts"): a Qwen2 speech LM that speaks as a reference recording, one NeuCodec
code per 20 ms. On a tiny random NeuTTS Air-layout directory the test writes with transformers'
classes: the phonemes, the prompt the reference implementation builds, the tokens read from the
tokenizer, the voices (a shipped reference, none, registered), the family's streaming defaults,
the backbone's tokens against transformers', and, served for real, streamed cloned speech batched
with other requests."""

from __future__ import annotations

import json
import shutil

import grpc
import numpy as np
import pytest
import torch

from audio_pipeline.errors import InvalidArgument, NotFound
from audio_pipeline.layouts import neutts
from audio_pipeline.text.espeak import ipa_with_punctuation
from helpers import (PCM_STEP, TRANSCRIPT, alone_and_together, audio_of, make_config, pcm16, pcm_of, recording,
                     run_to_completion, start_engine, synthesize, wait_idle)
from neutts_model import CODEBOOK, write_tiny_neutts_model

SAMPLES_PER_FRAME = 480


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_neutts_model(tmp_path_factory.mktemp("neutts"), seed=0, preset_voice="dave")


@pytest.fixture(scope="module")
def bare_dir(model_dir, tmp_path_factory):
    """The same checkpoint without a preset voice: every request must bring its reference."""
    bare = tmp_path_factory.mktemp("neutts-bare") / "model"
    shutil.copytree(model_dir, bare, ignore=shutil.ignore_patterns("voices"))
    manifest = json.loads((bare / "audio_pipeline.json").read_text())
    (bare / "audio_pipeline.json").write_text(json.dumps({k: v for k, v in manifest.items()
                                                          if k not in ("voices", "default_voice")}))
    return bare


@pytest.fixture(scope="module")
def engine(model_dir):
    engine = start_engine(model_dir)
    yield engine
    engine.stop(0.0)




# --- phonemes, tokens, prompt ----------------------------------------------------------------------

def test_phonemes_are_espeaks_ipa_with_stress_and_punctuation():
    assert ipa_with_punctuation("Hello, world.") == "həlˈoʊ, wˈɜːld."
    assert ipa_with_punctuation("(Hi) there!") == "(hˈaɪ) ðˈɛɹ!"
    assert ipa_with_punctuation("It costs 42 dollars;  right?") == "ɪt kˈɔsts fˈɔːɹɾi tˈuː dˈɑːlɚz; ɹˈaɪt?"
    assert ipa_with_punctuation("") == ""


def test_the_speech_tokens_and_stop_come_from_the_tokenizer(engine):
    layout, vocab = engine.layout, engine.tokenizer.get_vocab()
    assert isinstance(layout, neutts.NeuTTSLayout) and layout.tokens_per_frame == 1
    assert layout.codebook_size == CODEBOOK
    assert layout.token_range(0) == layout.token_range(5) == (vocab["<|speech_0|>"], vocab["<|speech_65535|>"] + 1)
    assert layout.end_of_speech == vocab["<|SPEECH_GENERATION_END|>"]
    assert layout.min_vocab_size == vocab["<|speech_65535|>"] + 1
    assert layout.token_to_code(vocab["<|speech_65535|>"], 3) == 65535
    assert layout.codes_to_tokens([0, 7, 65535]) == [vocab[f"<|speech_{c}|>"] for c in (0, 7, 65535)]
    assert not layout.is_valid_token(layout.end_of_speech, 0)


def reference_prompt(tokenizer, ref_codes, ref_text, text):
    """The reference implementation's _apply_chat_template for phoneme input, as written there."""
    input_ids = tokenizer.encode(f"{ipa_with_punctuation(ref_text)} {ipa_with_punctuation(text)}",
                                 add_special_tokens=False)
    ids = tokenizer.encode(neutts.CHAT)
    at = ids.index(tokenizer.convert_tokens_to_ids("<|TEXT_REPLACE|>"))
    ids = (ids[:at] + [tokenizer.convert_tokens_to_ids("<|TEXT_PROMPT_START|>")] + input_ids
           + [tokenizer.convert_tokens_to_ids("<|TEXT_PROMPT_END|>")] + ids[at + 1:])
    at = ids.index(tokenizer.convert_tokens_to_ids("<|SPEECH_REPLACE|>"))
    codes = tokenizer.encode("".join(f"<|speech_{i}|>" for i in ref_codes), add_special_tokens=False)
    return ids[:at] + [tokenizer.convert_tokens_to_ids("<|SPEECH_GENERATION_START|>")] + codes


def test_the_prompt_is_the_reference_implementations(engine, model_dir):
    """No voice: the preset voice the directory ships a reference for; its codes end the prompt
    and are the decoder's voice prompt."""
    shipped = np.load(model_dir / "voices" / "dave" / "codes.neucodec.npy")
    context = engine.create_context("Hello there, friend.")
    assert context.voice == "dave"
    assert context.prompt_ids == reference_prompt(engine.tokenizer, shipped, "My name is Dave.", "Hello there, friend.")
    assert context.prompt_speech_codes.tolist() == shipped.tolist()
    # A reference in the request instead: its transcript and codes.
    prompt = engine.requests.reference_prompt(recording(), TRANSCRIPT)
    cloned = engine.create_context("Hello there, friend.", reference=prompt)
    assert cloned.prompt_ids == reference_prompt(engine.tokenizer, prompt.codes.tolist(), TRANSCRIPT,
                                                 "Hello there, friend.")
    assert prompt.codes.numel() == 50  # one code per 20 ms of the 1 s recording, padded to whole frames


def test_a_model_without_a_preset_voice_refuses_a_request_without_a_reference(bare_dir):
    from audio_pipeline.service.engine import TTSEngine

    engine = TTSEngine(make_config(bare_dir))
    with pytest.raises(InvalidArgument) as refused:
        engine.create_context("Hello.")
    assert refused.value.field == "reference" and "reference recording" in str(refused.value)
    with pytest.raises(NotFound):
        engine.create_context("Hello.", voice="dave")
    assert engine.create_context("Hello.", reference=engine.requests.reference_prompt(recording(), TRANSCRIPT)).prompt_ids
    engine.start()
    try:
        assert engine.warmup() > 0  # warms up with a reference of its own
    finally:
        engine.stop(0.0)


# --- loading ---------------------------------------------------------------------------------------

def test_the_directory_is_a_published_checkpoints_layout(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["architectures"] == ["Qwen2ForCausalLM"]
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "Qwen2Tokenizer"
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.q_proj.bias"} <= keys
    assert json.loads((model_dir / "neucodec" / "config.json").read_text())["model_type"] == "neucodec"


def test_greedy_speech_is_transformers_qwen2s_over_the_speech_tokens(engine, model_dir):
    """Our backbone and sampler against transformers' Qwen2ForCausalLM on the served directory:
    greedy, each step's best speech token (or the stop once a frame is out)."""
    from transformers import Qwen2ForCausalLM

    result = engine.create_context("Hello there.", temperature=0.0, repetition_penalty=1.0, max_tokens=12)
    reference = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    start, end = engine.layout.token_range(0)
    ids, expected = list(result.prompt_ids), []
    with torch.no_grad():
        for step in range(12):
            logits = reference(torch.tensor([ids])).logits[0, -1]
            best = start + int(logits[start:end].argmax())
            if step > 0 and logits[engine.layout.end_of_speech] > logits[best]:
                break
            expected.append(best)
            ids.append(best)
    run_to_completion(engine, [result])
    assert result.generated == expected


def small_tokenizer(path, *, drop=(), gap_before=None):
    """A NeuTTS tokenizer with 8 speech tokens, ``drop`` left out, or another token before
    ``<|speech_{gap_before}|>`` (so the speech tokens' ids are not consecutive)."""
    from tokenizers import AddedToken, Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(vocab={chr(c): c - 32 for c in range(32, 127)}, merges=[]))
    tokenizer.add_special_tokens([t for t in neutts.SPECIAL_TOKENS if t not in drop])
    for code in range(8):
        if code == gap_before:
            tokenizer.add_special_tokens(["<|gap|>"])
        tokenizer.add_tokens([AddedToken(neutts.speech_token(code), normalized=False)])
    path.mkdir()
    (path / "config.json").write_text("{}")
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def test_tokenizers_that_are_not_neuttss_are_refused_naming_what_is_wrong(tmp_path, model_dir):
    from audio_pipeline.decoders import load_audio_decoder

    layout = neutts.NeuTTSLayout.from_tokenizer(small_tokenizer(tmp_path / "ok"), tmp_path / "ok")
    assert layout.codebook_size == 8
    with pytest.raises(ValueError, match="'neucodec' has 65536 codes; the model's tokenizer has 8 speech tokens"):
        layout.check_decoder(load_audio_decoder("neucodec", str(model_dir / "neucodec")))
    with pytest.raises(ValueError, match=r"no <\|SPEECH_GENERATION_END\|> token"):
        neutts.NeuTTSLayout.from_tokenizer(small_tokenizer(tmp_path / "a", drop=["<|SPEECH_GENERATION_END|>"]),
                                           tmp_path / "a")
    with pytest.raises(ValueError, match="consecutive ids"):
        neutts.NeuTTSLayout.from_tokenizer(small_tokenizer(tmp_path / "b", gap_before=5), tmp_path / "b")
    (tmp_path / "ok" / "config.json").write_text(json.dumps({"neuphonic": {"input_format": "BPE"}}))
    with pytest.raises(ValueError, match="neuphonic.input_format"):
        neutts.NeuTTSLayout.from_tokenizer(small_tokenizer(tmp_path / "c"), tmp_path / "ok")


def test_a_preset_voice_without_its_reference_is_a_load_error(bare_dir, tmp_path):
    from audio_pipeline.service.engine import TTSEngine

    broken = tmp_path / "model"
    shutil.copytree(bare_dir, broken)
    manifest = json.loads((broken / "audio_pipeline.json").read_text())
    (broken / "audio_pipeline.json").write_text(json.dumps({**manifest, "voices": [{"name": "ann"}],
                                                            "default_voice": "ann"}))
    with pytest.raises(ValueError, match=r"preset voice 'ann' of the neutts model needs its reference: .*voices/ann"):
        TTSEngine(make_config(broken))


def test_the_familys_streaming_and_sampling_defaults_and_flags_over_them(model_dir):
    from audio_pipeline.config import AudioGenerationConfig, PrependPromptSpeechTokens
    from audio_pipeline.decoders.settings_check import check_decoder_settings

    config = AudioGenerationConfig.load(env={}, model={"model_path": str(model_dir)})
    assert (config.chunk_size, config.buffer, config.block_causal) == ([15, 25, 50], 50, False)
    assert config.prepend_prompt_speech_tokens is PrependPromptSpeechTokens.ROLLING
    assert config.resolved_audio_decoder == "neucodec"
    sampling = config.sampling
    assert (sampling.temperature, sampling.top_k, sampling.top_p, sampling.repetition_penalty) == (1.0, 50, 1.0, 1.0)
    mine = AudioGenerationConfig.load(env={}, audio_flags=["buffer=10", "prepend_prompt_speech_tokens=never",
                                                           "sampling.top_k=20"], model={"model_path": str(model_dir)})
    assert (mine.buffer, mine.prepend_prompt_speech_tokens) == (10, PrependPromptSpeechTokens.NEVER)
    assert (mine.sampling.top_k, mine.sampling.temperature) == (20, 1.0)
    # Sampling is the language model's: another decoder keeps it, not the streaming defaults.
    other = AudioGenerationConfig.load(env={}, audio_flags=["audio_decoder=snac"], model={"model_path": str(model_dir)})
    assert (other.sampling.top_k, other.chunk_size, other.buffer) == (50, None, 0)
    with pytest.raises(ValueError, match="block_causal=true is not supported by audio_decoder 'neucodec'"):
        check_decoder_settings(AudioGenerationConfig.load(env={}, audio_flags=["block_causal=true"],
                                                          model={"model_path": str(model_dir)}))


# --- served for real -------------------------------------------------------------------------------







@pytest.mark.slow
@pytest.mark.parametrize("prepend", ["never", "once", "rolling"])
def test_a_reference_streams_cloned_audio_with_its_codes_before_the_decoders_input(model_dir, tmp_path, prepend):
    """Through the real server: a request with a reference recording (a WAV) streams every chunk as
    the decoder makes it from the generated codes and, with once and rolling, the reference's
    codes before them; the samples are exactly the generated frames'."""
    from audio_pipeline.decoders.streaming import DecoderStream, decode_windows
    from audio_pipeline.testing.background import BackgroundServer

    server = BackgroundServer(make_config(model_dir, f"prepend_prompt_speech_tokens={prepend}",
                                          voices_dir=str(tmp_path / "voices"))).start()
    try:
        chunks = synthesize(server.target, "Cloned and streamed.", reference=recording(rate=44100), seed=3,
                            max_tokens=120, min_tokens=120)
        assert chunks[0].format.sample_rate == 24000 and chunks[-1].HasField("complete")
        assert chunks[-1].complete.usage.generated_tokens == 120
        audio = audio_of(chunks)
        assert [a.size for a in audio] == [28 * SAMPLES_PER_FRAME, 56 * SAMPLES_PER_FRAME, 36 * SAMPLES_PER_FRAME]
        # The same request in the engine, for its tokens and the reference's codes.
        engine = server.engine
        context = engine.create_context("Cloned and streamed.", reference=engine.requests.reference_prompt(recording(rate=44100),
                                                                                                  TRANSCRIPT),
                                        seed=3, max_tokens=120, min_tokens=120)
        assert chunks[-1].complete.usage.prompt_tokens == len(context.prompt_ids)
        run_to_completion(engine, [context])
        codes = context.speech_codes(0, 120)
        settings = engine.core.streaming
        assert (settings.buffer, settings.prepend) == (50, prepend)
        stream = DecoderStream(engine.decoder, prompt_codes=context.prompt_speech_codes, chunk_size=settings.chunk_size,
                               buffer=settings.buffer, prepend=settings.prepend)
        expected = []
        while (window := stream.next_window(120, True)) is not None:
            expected.append(decode_windows(engine.decoder, [(stream, window, codes[window.start:window.end])])[0])
        for got, want in zip(audio, expected):
            np.testing.assert_allclose(got / 32768, want.numpy(), rtol=0, atol=PCM_STEP)
        wait_idle(engine)
    finally:
        server.stop()


@pytest.mark.slow
def test_cloned_requests_batched_together_sound_as_they_do_alone(model_dir, tmp_path):
    """Four requests at once (two references, the shipped voice, a registered voice) each give
    the audio they give alone, every one exactly its generated frames' samples; HTTP's speech
    route speaks the registered voice as gRPC does. They sample with
    the family's defaults (temperature 1, top 50, as the reference implementation); the
    configuration's own (top_p 0.95 over all 65,536 codes of a random model's nearly flat
    distribution) would let a batch's other rounding of the logits move a draw."""
    from audio_pipeline_client._proto import tts_pb2, tts_pb2_grpc
    from audio_pipeline.testing.background import BackgroundServer

    server = BackgroundServer(make_config(model_dir, voices_dir=str(tmp_path / "voices")), http_port=0).start()
    try:
        with grpc.insecure_channel(server.target) as channel:
            registered = tts_pb2_grpc.TextToSpeechStub(channel).RegisterVoice(tts_pb2.RegisterVoiceRequest(
                name="amy", reference=tts_pb2.VoiceReference(audio=recording(pitch=240.0), transcript=TRANSCRIPT)),
                timeout=60)
        assert registered.registered
        requests = [dict(reference=recording(pitch=150.0)), dict(reference=recording(rate=22050, pitch=300.0)),
                    dict(), dict(voice="amy")]

        def speak(index):
            return synthesize(server.target, f"Sentence number {index}.", seed=index, max_tokens=70, **requests[index])

        alone, together = alone_and_together(speak, 4)
        prompts = set()
        for one, batched in zip(alone, together):
            usage = batched[-1].complete.usage
            heard = pcm_of(batched).astype(int)
            assert heard.size == usage.generated_tokens * SAMPLES_PER_FRAME
            assert usage.generated_tokens == one[-1].complete.usage.generated_tokens
            same = pcm_of(one).astype(int)
            assert heard.shape == same.shape and np.abs(heard - same).max() <= 1  # batched kernels round otherwise
            prompts.add(usage.prompt_tokens)
        assert len(prompts) > 1  # four voices, four prompts
        import httpx

        body = {"input": "Sentence number 3.", "voice": "amy", "response_format": "pcm", "seed": 3}
        response = httpx.post(f"{server.http_url}/v1/audio/speech", json=body, timeout=120)
        assert response.status_code == 200 and "x-ignored-fields" not in response.headers
        heard = pcm16(response.content).astype(int)
        same = pcm_of(synthesize(server.target, "Sentence number 3.", seed=3, voice="amy")).astype(int)
        assert heard.shape == same.shape and np.abs(heard - same).max() <= 1
        wait_idle(server.engine)
    finally:
        server.stop()
