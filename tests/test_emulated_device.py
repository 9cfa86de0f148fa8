"""The emulated device (testing/emulated_device.py): the model's step and the decoder's calls are
sleeps, everything else runs as served, so a GPU server's host side can be measured on a CPU."""

import re

import numpy as np
import pytest

from helpers import GREEDY, make_config, run_to_completion


def emulated_engine(model_dir, step_ms=1.0, decoder_ms=1.0):
    from audio_pipeline.engine import TTSEngine
    from audio_pipeline.testing.emulated_device import EmulatedDevice

    engine = TTSEngine(make_config(model_dir))
    device = EmulatedDevice(step_ms, decoder_ms).install(engine)
    engine.start()
    return engine, device


def test_an_emulated_engine_speaks_valid_tokens_as_silence_of_the_right_length(tiny_model_dir):
    engine, device = emulated_engine(tiny_model_dir)
    try:
        greedy, sampled = engine.create_context("The emulated device speaks.", **GREEDY), \
            engine.create_context("The emulated device speaks.", temperature=1.0, seed=3, max_tokens=70)
        chunks = run_to_completion(engine, [greedy, sampled])
    finally:
        engine.stop()
    layout, decoder = engine.layout, engine.decoder
    # Logits peaked at a random code of each row, as a trained model's are: valid codes of each
    # frame slot, greedy or sampled, and speech to max_tokens.
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
