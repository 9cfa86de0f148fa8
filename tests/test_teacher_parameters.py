"""The teacher's own vocoder parameters (recipes/builtin_voice/teacher_parameters.py): its
mel-cepstra become the codec's frame parameters with the same spectrum and level; where Festival
and hts_engine are installed (recipe-time Debian tools), one real utterance goes through them."""

import shutil

import numpy as np
import pytest

from recipes.builtin_voice.teacher_parameters import (SAMPLE_SCALE, TEACHER_ORDER, exact_synthesis, frame_parameters,
                                                      teacher_log_amplitude)


def test_teacher_mel_cepstra_become_the_codecs_spectrum_at_the_frame_centres():
    from audio_pipeline.decoders.mcep import DEFAULT_CONFIG, mcep_basis

    rng = np.random.default_rng(0)
    steps = 40  # 5 ms each: ten 20 ms frames
    mcep = rng.normal(0, 1, (steps, TEACHER_ORDER)) * 0.5 / np.arange(1, TEACHER_ORDER + 1) ** 1.5
    mcep[:, 0] = np.log(SAMPLE_SCALE) + rng.uniform(-6, -2, steps)
    lf0 = np.where(np.arange(steps) % 8 < 4, np.log(rng.uniform(120, 220, steps)), -1e10)
    cepstrum, bands, f0 = frame_parameters(mcep, lf0, frame_ms=20)
    assert cepstrum.shape == (10, DEFAULT_CONFIG["order"] + 1) and bands.shape == (10, 4)
    centres = np.arange(2, steps, 4)
    np.testing.assert_array_equal(f0 > 0, lf0[centres] > -1e9)
    np.testing.assert_allclose(f0[f0 > 0], np.exp(lf0[centres][lf0[centres] > -1e9]))
    # The codec's mel-cepstrum (alpha 0.42, 16 kHz) draws the teacher's curve (alpha 0.45, 32 kHz,
    # below 8 kHz) less the 16 kHz recording's half power, in [-1, 1] units.
    bins = DEFAULT_CONFIG["fft_size"] // 2 + 1
    ours = cepstrum @ mcep_basis(bins, DEFAULT_CONFIG["order"], DEFAULT_CONFIG["alpha"]).T
    theirs = teacher_log_amplitude(mcep[centres], np.linspace(0, 8000, bins)) + 0.5 * np.log(0.5)
    assert np.abs(ours - theirs).max() < 0.05


@pytest.mark.skipif(shutil.which("festival") is None or shutil.which("hts_engine") is None,
                    reason="Festival and hts_engine are recipe-time tools (Debian), not installed here")
def test_the_teachers_parameters_resound_at_the_teachers_level(tmp_path):
    import soundfile as sf
    import soxr

    from recipes.builtin_voice.teacher_parameters import generate, read_parameters

    files = generate([(7, "Paula touched my modern window after lunch.")], tmp_path)[7]
    mcep, lf0 = read_parameters(files)
    teacher, rate = sf.read(files["wav"])
    assert rate == 32000 and mcep.shape == (len(lf0), TEACHER_ORDER) and len(teacher) == len(lf0) * 160
    assert 0.3 < np.mean(lf0 > -1e9) < 0.9  # voiced and unvoiced steps
    audio = exact_synthesis(*frame_parameters(mcep, lf0, 20), 20)
    assert len(audio) == len(lf0) // 4 * 320
    level = np.sqrt(np.mean(audio ** 2)) / np.sqrt(np.mean(soxr.resample(teacher, 32000, 16000) ** 2))
    assert 0.8 < level < 1.25
    # A codec fitted on such parameters quantizes them for the decoder as it is.
    from audio_pipeline.decoders import load_audio_decoder
    from recipes.builtin_voice.mcep_codec import Quantizer, coded_frames

    parameters = frame_parameters(mcep, lf0, 20)
    codec = Quantizer.fit([parameters], size=8).save(tmp_path / "codec")
    decoder = load_audio_decoder("mcep", str(codec))
    audio = decoder.decode(coded_frames(Quantizer.load(codec), parameters)).numpy()
    assert len(audio) == len(lf0) // 4 * 320 and np.sqrt(np.mean(audio ** 2)) > 0.01


@pytest.mark.skipif(shutil.which("festival") is None or shutil.which("hts_engine") is None,
                    reason="Festival and hts_engine are recipe-time tools (Debian), not installed here")
def test_a_dataset_coded_from_the_teachers_parameters_keeps_its_alignment(tmp_path):
    """teacher_dataset --parameters: each utterance's codes are the fitted codec's codes of the
    teacher's own parameters (not of an analysis of its audio), as many frames as its units span."""
    import json

    from recipes.builtin_voice.mcep_codec import Quantizer
    from recipes.builtin_voice.teacher import VOICE, _batch
    from recipes.builtin_voice.teacher_dataset import build
    from recipes.builtin_voice.teacher_parameters import generate, read_parameters

    texts = [(0, "Paula touched my modern window after lunch."), (1, "Is it nine or ten?")]
    teacher = tmp_path / "teacher"
    records = _batch((texts, str(teacher), VOICE, {}))
    (teacher / "index.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    reference = generate(texts, tmp_path / "reference", audio=False)
    parameters = [frame_parameters(*read_parameters(reference[index])) for index, _ in texts]
    codec = Quantizer.fit(parameters, size=16).save(tmp_path / "codec")
    data = build(teacher, 10, workers=1, fit=0, decoder_out=None, codec=codec, parameters=True)
    assert not (teacher / "analysis").exists()  # no WORLD analysis of the audio
    assert sorted(p.name for p in (teacher / "parameters").iterdir())[:3] == ["00000.lab", "00000.lf0", "00000.mcp"]
    quantizer = Quantizer.load(codec)
    for codes, durations, analysis in zip(data["codes"], data["durations"], parameters):
        assert len(codes) == int(durations.sum())
        expected = quantizer.encode(*analysis)
        shared = min(len(codes), len(expected))
        assert 0 <= len(codes) - len(expected) <= 1  # the segments' rounding, padded with the last frame
        np.testing.assert_array_equal(codes[:shared], expected[:shared])


@pytest.mark.skipif(shutil.which("festival") is None or shutil.which("hts_engine") is None,
                    reason="Festival and hts_engine are recipe-time tools (Debian), not installed here")
def test_the_equalization_brings_the_decoders_audio_closer_to_the_teachers(tmp_path):
    """teacher_parameters equalize: the envelope offset measured on two utterances, written into a
    codec's config.json, makes the decoder's audio of a third utterance's parameters closer to the
    teacher's audio by mel-cepstral distortion."""
    pytest.importorskip("pyworld", reason="the distortion's analysis is WORLD's (the recipe extra)")
    import soundfile as sf

    from audio_pipeline.decoders import load_audio_decoder
    from recipes.builtin_voice.distortion import cepstra, mcd, trim
    from recipes.builtin_voice.mcep_codec import Quantizer, coded_frames
    from recipes.builtin_voice.teacher_parameters import equalization, generate, read_parameters

    files = generate([(0, "Where is the blue mouse that Irene built?"), (1, "It costs five dollars, not six."),
                      (2, "Paula touched my modern window after lunch.")], tmp_path)
    offset = equalization([files[0], files[1]])
    assert offset.shape == (40,) and np.isfinite(offset).all()
    parameters = frame_parameters(*read_parameters(files[2]), 20)
    plain = Quantizer.fit([parameters], size=64).save(tmp_path / "plain")
    equalized = Quantizer(Quantizer.load(plain).codebook, {**Quantizer.load(plain).config,
                                                           "envelope_offset": offset.tolist()}).save(tmp_path / "eq")
    teacher = trim(cepstra(*sf.read(files[2]["wav"])))

    def distortion(codec):
        audio = load_audio_decoder("mcep", str(codec)).decode(coded_frames(Quantizer.load(codec), parameters)).numpy()
        return mcd(teacher, trim(cepstra(audio.astype(np.float64), 16000)))
    assert distortion(equalized) < distortion(plain) - 0.3
