"""The Qwen3-TTS speaker encoder (audio_pipeline.models.qwen3_tts_speaker) against the reference
package's fixtures (tests/fixtures/qwen3_tts, tiny random Base checkpoint): the log-mel front end,
the x-vector, the Slaney mel filterbank in another setting, and the errors for checkpoints without a
speaker encoder, other sample rates and too short audio."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from safetensors.torch import save_file

from audio_pipeline.models.qwen3_tts_speaker import (Qwen3TTSSpeakerEncoder, load_speaker_encoder,
                                                     log_mel_spectrogram, slaney_mel_filterbank)

pytestmark = pytest.mark.usefixtures("one_thread")

FIXTURES = Path(__file__).parent / "fixtures" / "qwen3_tts"
BASE = FIXTURES / "models" / "base"
#: Reached: both match the reference bit for bit (max |diff| 0.0) on this CPU; the bounds leave room
#: for another CPU's float32 rounding.
MEL_ATOL = 1e-5
XVECTOR_ATOL = 1e-5


def reference_waveform() -> np.ndarray:
    samples, rate = sf.read(str(FIXTURES / "reference_24k.wav"), dtype="float32")  # PCM16 / 32768
    assert rate == 24000 and samples.ndim == 1
    return samples


@pytest.fixture(scope="module")
def encoder() -> Qwen3TTSSpeakerEncoder:
    return load_speaker_encoder(BASE, "cpu", torch.float32)


def test_parameter_names_are_the_checkpoints(encoder):
    keys = json.loads((FIXTURES / "checkpoint_keys.json").read_text())["models/base/model.safetensors"]
    stored = {k[len("speaker_encoder."):]: tuple(shape) for k, (shape, _dtype) in keys.items()
              if k.startswith("speaker_encoder.")}
    ours = {name: tuple(t.shape) for name, t in encoder.state_dict().items()}
    assert len(ours) == 52 and ours == stored
    assert all(t.dtype == torch.float32 and not t.requires_grad for t in encoder.parameters())
    assert not encoder.training


def test_mel_matches_reference(encoder):
    expected = np.load(FIXTURES / "speaker_encoder" / "reference_mel.npy")
    mel = encoder.mel_spectrogram(torch.from_numpy(reference_waveform()))
    assert mel.dtype == torch.float32 and tuple(mel.shape) == expected.shape == (128, 140)
    np.testing.assert_allclose(mel.numpy(), expected, rtol=0, atol=MEL_ATOL)
    # The module-level function is the same front end; numpy input and a batch work too.
    batch = log_mel_spectrogram(np.stack([reference_waveform()] * 2))
    assert tuple(batch.shape) == (2, 128, 140)
    torch.testing.assert_close(batch[1], mel, rtol=0, atol=0)


def test_xvector_matches_reference(encoder):
    expected = np.load(FIXTURES / "speaker_encoder" / "reference_xvector.npy")
    xvector = encoder.embed(torch.from_numpy(reference_waveform()))
    assert xvector.dtype == torch.float32 and tuple(xvector.shape) == expected.shape == (32,)
    np.testing.assert_allclose(xvector.numpy(), expected, rtol=0, atol=XVECTOR_ATOL)
    # The x-vector the reference placed in every Base case's prompt is this one.
    cases = sorted((FIXTURES / "cases").glob("base_*/ref_spk_embedding.npy"))
    assert cases
    for path in cases:
        np.testing.assert_allclose(xvector.numpy(), np.load(path).reshape(-1), rtol=0, atol=XVECTOR_ATOL,
                                   err_msg=str(path))


def test_batch_and_forward_agree_with_embed(encoder):
    wave = torch.from_numpy(reference_waveform())
    shorter = wave[:20000].clone()
    single = encoder.embed(shorter)
    batch = encoder.embed(torch.stack([wave[:20000], wave[4000:24000]]))
    assert tuple(batch.shape) == (2, 32)
    torch.testing.assert_close(batch[0], single, rtol=0, atol=1e-6)
    with torch.no_grad():
        forward = encoder(encoder.mel_spectrogram(shorter).unsqueeze(0))
    torch.testing.assert_close(forward[0], single, rtol=0, atol=0)


def test_bf16_load():
    encoder = load_speaker_encoder(BASE, torch.device("cpu"), torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in encoder.parameters())
    xvector = encoder.embed(torch.from_numpy(reference_waveform()))
    assert xvector.dtype == torch.bfloat16
    expected = torch.from_numpy(np.load(FIXTURES / "speaker_encoder" / "reference_xvector.npy"))
    cosine = torch.nn.functional.cosine_similarity(xvector.float(), expected, dim=0)
    assert cosine > 0.99, cosine


# -- the Slaney mel filterbank ----------------------------------------------------------------

#: librosa 0.11.0's librosa.filters.mel(sr=16000, n_fft=512, n_mels=80) (fmin 0, fmax 8000).
LIBROSA_16K_80 = {
    "sum": 2.55826078139944,
    "max": 0.026406592,
    "entries": {(0, 1): 0.022534560412168503, (5, 7): 0.02347484603524208,
                (40, 55): 0.014444176107645035, (79, 246): 0.0032521483954042196},
    "first_filter_bins": (1, 2), "last_filter_bins": (238, 255),
}
#: librosa.filters.mel(sr=44100, n_fft=2048, n_mels=128, fmin=30, fmax=16000).
LIBROSA_44K_128 = {"sum": 5.944753787363652, "entries": {(40, 57): 0.02226157858967781,
                                                           (127, 722): 0.0021611389238387346},
                   "first_filter_bins": (2, 4), "last_filter_bins": (701, 743)}


def _slaney_mel(hz):
    """Slaney's mel scale, from its definition (linear below 1 kHz at 3 mels per 200 Hz, 27 mels per
    factor 6.4 above), for the properties below."""
    hz = np.asarray(hz, dtype=np.float64)
    return np.where(hz < 1000, hz * 3 / 200, 15 + 27 * np.log(np.maximum(hz, 1000) / 1000) / np.log(6.4))


def _slaney_hz(mel):
    mel = np.asarray(mel, dtype=np.float64)
    return np.where(mel < 15, mel * 200 / 3, 1000 * 6.4 ** ((np.maximum(mel, 15) - 15) / 27))


@pytest.mark.parametrize("setting, golden", [((16000, 512, 80, 0.0, None), LIBROSA_16K_80),
                                             ((44100, 2048, 128, 30.0, 16000.0), LIBROSA_44K_128)])
def test_filterbank_equals_librosa_slaney(setting, golden):
    sr, n_fft, n_mels, fmin, fmax = setting
    bank = slaney_mel_filterbank(sr, n_fft, n_mels, fmin, fmax)
    assert bank.dtype == np.float32 and bank.shape == (n_mels, n_fft // 2 + 1)
    assert float(bank.sum(dtype=np.float64)) == pytest.approx(golden["sum"], rel=1e-7)
    if "max" in golden:
        assert float(bank.max()) == pytest.approx(golden["max"], rel=1e-7)
    for (i, j), value in golden["entries"].items():
        assert float(bank[i, j]) == pytest.approx(value, rel=1e-6, abs=1e-12), (i, j)
    for row, (first, last) in ((0, golden["first_filter_bins"]), (-1, golden["last_filter_bins"])):
        nonzero = np.nonzero(bank[row])[0]
        assert (nonzero[0], nonzero[-1]) == (first, last)


@pytest.mark.parametrize("setting", [(16000, 512, 80, 0.0, None), (44100, 2048, 128, 30.0, 16000.0)])
def test_filterbank_properties(setting):
    sr, n_fft, n_mels, fmin, fmax = setting
    fmax = sr / 2 if fmax is None else fmax
    bank = slaney_mel_filterbank(sr, n_fft, n_mels, fmin, setting[4]).astype(np.float64)
    freqs = np.fft.rfftfreq(n_fft, 1 / sr)
    edges = _slaney_hz(np.linspace(_slaney_mel(fmin), _slaney_mel(fmax), n_mels + 2))
    assert (bank >= 0).all()
    for i in range(n_mels):
        lo, centre, hi = edges[i], edges[i + 1], edges[i + 2]
        # Support strictly inside the neighbours' centres; nothing outside fmin..fmax.
        support = freqs[bank[i] > 0]
        assert support.min() > lo - 1e-6 and support.max() < hi + 1e-6, i
        # Slaney normalisation: a triangle of height 2 / (hi - lo), i.e. unit area over Hz.
        triangle = np.maximum(0, np.minimum((freqs - lo) / (centre - lo), (hi - freqs) / (hi - centre)))
        np.testing.assert_allclose(bank[i], triangle * 2 / (hi - lo), rtol=1e-6, atol=1e-9, err_msg=str(i))
        if (hi - lo) / (sr / n_fft) > 8:  # wide enough for the sampled triangle to integrate to ~1
            area = float(((bank[i][1:] + bank[i][:-1]) / 2 * np.diff(freqs)).sum())
            assert abs(area - 1) < 0.01, i
        assert bank[i].max() <= 2 / (hi - lo) * (1 + 1e-6)


def test_slaney_scale_anchor_points():
    # Checks the definition used above against the scale's anchor points.
    np.testing.assert_allclose(_slaney_mel([0, 200, 1000, 6400]), [0, 3, 15, 42])
    np.testing.assert_allclose(_slaney_hz(_slaney_mel([37.5, 999.0, 1234.5, 7999.0])), [37.5, 999.0, 1234.5, 7999.0])


# -- errors -------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["custom_voice", "voice_design"])
def test_checkpoint_without_speaker_encoder(kind):
    with pytest.raises(ValueError, match="no speaker encoder.*Base checkpoint"):
        load_speaker_encoder(FIXTURES / "models" / kind, "cpu", torch.float32)


def test_config_without_speaker_encoder(tmp_path):
    # A checkpoint whose config has no speaker_encoder_config (and no tts_model_type).
    config = json.loads((BASE / "config.json").read_text())
    del config["speaker_encoder_config"], config["tts_model_type"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({"talker.x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="no speaker_encoder_config"):
        load_speaker_encoder(tmp_path)
    # A Base config whose weights lack the speaker encoder.
    shutil.copy(BASE / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match=r"no speaker_encoder\.\* tensors"):
        load_speaker_encoder(tmp_path)


def test_config_that_does_not_fit_the_weights(tmp_path):
    config = json.loads((BASE / "config.json").read_text())
    config["speaker_encoder_config"]["enc_attention_channels"] = 4
    (tmp_path / "config.json").write_text(json.dumps(config))
    shutil.copy(BASE / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="do not fit its config.*asp"):
        load_speaker_encoder(tmp_path)


def test_wrong_sample_rate(encoder):
    wave = torch.from_numpy(reference_waveform())
    with pytest.raises(ValueError, match="24000 Hz audio, got 16000 Hz"):
        encoder.embed(wave, sample_rate=16000)
    with pytest.raises(ValueError, match="24000 Hz audio, got 44100 Hz"):
        encoder.mel_spectrogram(wave, sample_rate=44100)
    with pytest.raises(ValueError, match="24000 Hz"):
        log_mel_spectrogram(wave, 22050)
    with pytest.raises(ValueError, match="sample_rate 16000 is not supported"):
        Qwen3TTSSpeakerEncoder({**encoder.config, "sample_rate": 16000})


def test_short_and_malformed_audio(encoder):
    wave = torch.from_numpy(reference_waveform())
    assert encoder.min_samples == 1280  # 5 frames: the dilation-4 kernel-3 TDNNs pad 4 each side
    assert tuple(encoder.embed(wave[:encoder.min_samples]).shape) == (32,)
    with pytest.raises(ValueError, match="too short"):
        encoder.embed(wave[:encoder.min_samples - 1])
    with pytest.raises(ValueError, match="too short"):
        encoder.mel_spectrogram(wave[:300])
    with pytest.raises(ValueError, match="mono"):
        encoder.embed(wave.reshape(1, 1, -1))
    with pytest.raises(ValueError, match="floating point"):
        encoder.embed(torch.zeros(4000, dtype=torch.int16))
