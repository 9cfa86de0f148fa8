"""The emulated device (testing/emulated_device.py): the model's step and the decoder's calls are
sleeps and the sampling a cheap draw (on a GPU it is device work inside the step), everything else
runs as served, so a GPU server's host side can be measured on a CPU."""

import re

import numpy as np
import pytest

from helpers import GREEDY, make_config, run_to_completion


def emulated_engine(model_dir, step_ms=1.0, decoder_ms=1.0, config=None):
    from audio_pipeline.service.engine import TTSEngine
    from audio_pipeline.testing.emulated_device import EmulatedDevice

    engine = TTSEngine(config or make_config(model_dir))
    device = EmulatedDevice(step_ms, decoder_ms).install(engine)
    engine.start()
    return engine, device


@pytest.fixture
def sampler_calls(monkeypatch):
    """Calls of the real sampler (sample_rows, as the model runner calls it) and of the model's
    candidate logits, counted from here on."""
    from audio_pipeline.core import model_runner
    from audio_pipeline.models.llama_model import LlamaPipelineModel

    calls = {"sample_rows": 0, "logits": 0}

    def counted(name, function):
        def call(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)
        return call

    monkeypatch.setattr(model_runner, "sample_rows", counted("sample_rows", model_runner.sample_rows))
    for method in ("compute_candidate_logits", "compute_slot_logits"):
        monkeypatch.setattr(LlamaPipelineModel, method, counted("logits", getattr(LlamaPipelineModel, method)))
    return calls


def test_an_emulated_engine_speaks_valid_tokens_as_silence_of_the_right_length(tiny_model_dir, sampler_calls):
    engine, device = emulated_engine(tiny_model_dir)
    try:
        greedy, sampled = engine.create_context("The emulated device speaks.", **GREEDY), \
            engine.create_context("The emulated device speaks.", temperature=1.0, seed=3, max_tokens=70)
        chunks = run_to_completion(engine, [greedy, sampled])
    finally:
        engine.stop()
    layout, decoder = engine.layout, engine.decoder
    # A random code of each row, as a trained model's peaked logits give: valid codes of each frame
    # slot, greedy or sampled, and speech to max_tokens.
    for context in (greedy, sampled):
        assert context.stop_reason.value == "max_tokens" and len(context.generated) == 70
        assert all(layout.token_range(i)[0] <= t < layout.token_range(i)[1] for i, t in enumerate(context.generated))
        assert len(set(context.generated)) > 10
    # The audio is silence, as long as the frames the tokens make.
    for context, pieces in zip((greedy, sampled), chunks):
        audio = np.concatenate(pieces)
        assert audio.shape[0] == len(context.generated) // decoder.tokens_per_frame * decoder.samples_per_frame
        assert not np.any(audio)
    # Every pass and decoder call went through the emulation: one pass per token of the longer request
    # at least (the two decode side by side), the prompts' too.
    assert device.steps >= 70 and device.decoder_calls >= 2
    # The sampling is the device's too: the host never ran the sampler nor computed logits.
    assert sampler_calls == {"sample_rows": 0, "logits": 0}


def test_steps_run_on_the_emulated_device_s_timeline_with_no_worker_thread(tiny_model_dir):
    """A step is launched as on a GPU: no worker thread runs it (the CPU's overlap worker is gone
    once the first step is launched, with overlap on as on CUDA), and its result waits until the
    device has spent step_ms on it and on every step queued before it."""
    import threading
    import time

    config = make_config(tiny_model_dir, "enable_overlap_scheduler=true", "max_num_steps=1")
    engine, device = emulated_engine(tiny_model_dir, step_ms=20.0, decoder_ms=0.0, config=config)
    try:
        started = time.monotonic()
        context = engine.create_context("The emulated device keeps its own time.", temperature=0.0, max_tokens=28)
        run_to_completion(engine, [context])
        seconds = time.monotonic() - started
        assert engine.core.runner._worker is None
        assert not [t for t in threading.enumerate() if t.name.startswith("model-runner")]
    finally:
        engine.stop()
    # A lower bound only: every step took its 20 ms of device time, one after the other.
    assert device.steps >= 28 and seconds >= device.steps * 0.020


def test_an_engine_that_is_not_emulated_still_samples_for_real(tiny_model_dir, sampler_calls):
    """The emulated sampling is routed by model: another engine's runner (in the same process, after
    an emulated one) samples as served."""
    from audio_pipeline.service.engine import TTSEngine

    emulated_engine(tiny_model_dir)[0].stop()
    engine = TTSEngine(make_config(tiny_model_dir))
    engine.start()
    try:
        context = engine.create_context("The real device speaks.", temperature=0.0, max_tokens=14)
        run_to_completion(engine, [context])
    finally:
        engine.stop()
    assert len(context.generated) == 14 and sampler_calls["sample_rows"] >= 14 and sampler_calls["logits"] >= 14


@pytest.mark.parametrize("voice", ["builtin:slt-en", "builtin:slt-en-frame"])
def test_an_emulated_aligned_voice_keeps_its_forced_tokens_and_frames(voice, sampler_calls):
    """Layouts with rules: phoneme-lpc's forced alignment tokens (one token a position) and the frame
    voice's frames (a depth-sampled frame a position, some codes fixed by the alignment) come out
    as the alignment says, the drawn codes valid, and the speech ends where the alignment does."""
    from audio_pipeline.config import AudioGenerationConfig

    config = AudioGenerationConfig.load(env={}, audio_flags=["chunk_size=8,40"],
                                        model={"device": "cpu", "model_path": voice})
    engine, device = emulated_engine(None, config=config)
    text = "Please call Stella and ask her to bring these things."
    try:
        contexts = [engine.create_context(text, temperature=0.0), engine.create_context(text, temperature=1.0, seed=2)]
        chunks = run_to_completion(engine, contexts)
    finally:
        engine.stop()
    layout, decoder = engine.layout, engine.decoder
    for context, pieces in zip(contexts, chunks):
        alignment = context.alignment
        assert context.stop_reason.value == "end_of_speech" and len(context.generated) == alignment.tokens > 40
        for position, token in enumerate(context.generated):
            assert alignment.forced(position) in (None, token)
            first, end = layout.token_range(position)
            assert first <= token < end
        if layout.codes_per_token > 1:
            assert len(context.frames) == len(context.generated)
            for position, (token, frame) in enumerate(zip(context.generated, context.frames)):
                assert frame[layout.token_column] == layout.token_to_code(token, position)
                assert all(0 <= code < layout.codebook_size for code in frame)
                assert all(f in (-1, code) for f, code in zip(alignment.frame_codes(position), frame))
            drawn = {code for position, frame in enumerate(context.frames)
                     for column, (fixed, code) in enumerate(zip(alignment.frame_codes(position), frame))
                     if fixed == -1 and column != layout.token_column}
            assert len(drawn) > 10  # the depth decoder's codes, drawn
        audio = np.concatenate(pieces)
        assert audio.shape[0] == context.speech_code_count // decoder.tokens_per_frame * decoder.samples_per_frame
    assert sampler_calls == {"sample_rows": 0, "logits": 0} and device.steps > 40


def test_emulated_times_are_checked(tiny_model_dir):
    from audio_pipeline.testing.emulated_device import EmulatedDevice

    with pytest.raises(ValueError, match="emulated times must be >= 0 ms"):
        EmulatedDevice(-1.0)


@pytest.mark.slow
def test_the_serving_benchmark_runs_on_an_emulated_device(capsys):
    """bench.serve --emulate-step-ms: the server process runs on the emulated device, the report
    says so and has no memory floor; the open loop, judged by audible speech, refuses it."""
    from audio_pipeline.bench.serve import main

    assert main(["--random-model", "orpheus-tiny", "--device", "cpu", "--streams", "2", "--no-search",
                 "--utterance-tokens", "56", "--emulate-step-ms", "2", "--emulate-decoder-ms", "1"]) == 0
    out = capsys.readouterr().out
    assert "emulated device: a model step is 2 ms, an audio decoder call 1 ms" in out
    assert "read bandwidth" not in out and "memory floor" not in out
    assert re.search(r"^\s+2\s+\d+\s+\d+\s+[\d.]+\s+2/2", out, re.M), out
    with pytest.raises(SystemExit):
        main(["--arrival", "poisson", "--rps", "1", "--emulate-step-ms", "2"])
    assert "an emulated device speaks silence" in capsys.readouterr().err
