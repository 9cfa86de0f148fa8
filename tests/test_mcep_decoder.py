"""The mcep decoder (the second-generation codec): frame layout, pitch and loudness from the codes,
streaming equal to one-shot exactly at every setting, and its checks."""

import numpy as np
import pytest
import torch

from audio_pipeline.decoders import load_audio_decoder
from audio_pipeline.decoders.mcep import DEFAULT_CONFIG, save_mcep_decoder
from audio_pipeline.decoders.streaming import DecoderStream, decode_windows
from vocoder_checks import assert_frames_are_four_codes_and_twenty_milliseconds

ORDER, BANDS = DEFAULT_CONFIG["order"], len(DEFAULT_CONFIG["aperiodicity_bands"]) - 1
GAINS = DEFAULT_CONFIG["gain_levels"]


def random_codebook(size=64, seed=0):
    """Envelopes that fall off like speech (decaying cepstra) with random band aperiodicities."""
    rng = np.random.default_rng(seed)
    cepstra = rng.normal(0, 1, (size, ORDER)) * 0.6 / np.arange(1, ORDER + 1)
    aperiodicity = rng.uniform(-40, -1, (size, BANDS))
    return np.concatenate([cepstra, aperiodicity], 1)


@pytest.fixture(scope="module", params=[1, 4], ids=["steps1", "steps4"])
def decoder(request, tmp_path_factory):
    path = save_mcep_decoder(tmp_path_factory.mktemp("mcep"), random_codebook())
    return load_audio_decoder("mcep", str(path), {"interpolation_steps": request.param})


def codes(frames=30, seed=0, entries=64):
    rng = np.random.default_rng(seed)
    f0 = np.where(rng.random(frames) < 0.3, 0, rng.integers(1, 32, frames))
    rows = np.stack([rng.integers(0, 90, frames), rng.integers(0, 20, frames), rng.integers(0, entries, frames),
                     f0 * GAINS + rng.integers(10, 30, frames)], axis=1)
    return torch.from_numpy(rows.reshape(-1))


def steady(f0_code, gain_code, entry=0, frames=25):
    rows = np.tile([5, 6, entry, f0_code * GAINS + gain_code], (frames, 1))
    return torch.from_numpy(rows.reshape(-1))


def test_a_frame_is_four_codes_and_twenty_milliseconds(decoder):
    """30 frames are 30 x 320 samples at 16 kHz, and frame k's codes sound from sample 320 k on,
    never before: with its envelope code changed, the audio before it stays as it was and its own
    20 ms change."""
    assert_frames_are_four_codes_and_twenty_milliseconds(decoder, codes(30))


def test_the_prosody_code_sets_the_pitch_and_the_loudness(tmp_path):
    flat = np.zeros((2, ORDER + BANDS))
    flat[:, ORDER:] = -60.0  # no noise: pure pulses
    decoder = load_audio_decoder("mcep", str(save_mcep_decoder(tmp_path, flat)))
    lo, hi = DEFAULT_CONFIG["log_f0_range"]
    for f0_code in (4, 16, 28):
        audio = decoder.decode(steady(f0_code, 20)).numpy()[3200:]  # past the first frames
        expected = np.exp(lo + (f0_code - 1) / 30 * (hi - lo))
        correlation = np.correlate(audio, audio, "full")[audio.size - 1:]
        window = correlation[40:400]  # lags of 400-40 Hz: the first one near the best is the period
        lag = np.nonzero(window > 0.8 * window.max())[0][0] + 40
        assert abs(16000 / lag - expected) / expected < 0.02, (f0_code, 16000 / lag, expected)
    quiet = decoder.decode(steady(16, 10)).numpy()[3200:]
    loud = decoder.decode(steady(16, 20)).numpy()[3200:]
    step = (DEFAULT_CONFIG["gain_range"][1] - DEFAULT_CONFIG["gain_range"][0]) / (GAINS - 1)
    ratio = np.sqrt(np.mean(loud ** 2) / np.mean(quiet ** 2))
    assert ratio == pytest.approx(np.exp(10 * step), rel=0.02)
    # Unvoiced frames are noise: no pitch period stands out.
    noise = decoder.decode(steady(0, 25, entry=1)).numpy()[3200:]
    correlation = np.correlate(noise, noise, "full")[noise.size - 1:]
    assert np.max(correlation[40:400]) < 0.3 * correlation[0]


@pytest.mark.parametrize("chunk_size,block_causal", [([4], True), ([8, 40], True), ([160], True), ([12, 28], False)])
def test_streaming_equals_one_shot_exactly(decoder, chunk_size, block_causal):
    tokens = codes(25, seed=1)
    stream = DecoderStream(decoder, chunk_size=chunk_size, block_causal=block_causal, buffer=8)
    parts, known = [], 0
    while True:
        known = min(known + 12, tokens.numel())
        finished = known == tokens.numel()
        while (window := stream.next_window(known, finished)) is not None:
            parts.append(decode_windows(decoder, [(stream, window, tokens[window.start:window.end])])[0])
        if finished:
            break
    torch.testing.assert_close(torch.cat(parts), decoder.decode(tokens), atol=0, rtol=0)


def test_the_alignment_slots_do_not_change_the_audio(decoder):
    a = codes(10, seed=2)
    b = a.clone()
    b[0::4] = 7
    b[1::4] = 3
    torch.testing.assert_close(decoder.decode(a), decoder.decode(b))


def test_codes_out_of_range_are_refused(decoder):
    bad = codes(3)
    bad[2] = 64  # the codebook has 64 entries
    with pytest.raises(ValueError, match="frame position 2"):
        decoder.decode(bad)
    bad = codes(3)
    bad[3] = 32 * GAINS  # prosody: 31 F0 levels + unvoiced, times the gain levels
    with pytest.raises(ValueError, match="frame position 3"):
        decoder.decode(bad)
    with pytest.raises(ValueError, match="whole number of 4-code frames"):
        decoder.decode(codes(3)[:-1])


def test_bad_weights_are_reported(tmp_path):
    with pytest.raises(ValueError, match="envelope_codebook.npy"):
        load_audio_decoder("mcep", str(tmp_path))
    save_mcep_decoder(tmp_path, np.zeros((8, ORDER)))
    with pytest.raises(ValueError, match=f"must be \\[size, {ORDER + BANDS}\\]"):
        load_audio_decoder("mcep", str(tmp_path))


def test_responses_ring_on_across_frame_edges(tmp_path):
    """The pulses near a frame's end sound on into the next frame (the stream's tail): after one
    loud voiced frame, the next frame starts with its ringing, not with the quiet frame's noise."""
    decoder = load_audio_decoder("mcep", str(save_mcep_decoder(tmp_path, random_codebook(4, seed=3))))
    quiet = [5, 6, 0, 0 * GAINS + 0]  # unvoiced, the lowest gain
    loud = [5, 6, 1, 31 * GAINS + 31]  # voiced at the highest pitch, the highest gain
    rows = np.array([quiet] * 10 + [loud] + [quiet] * 5)
    audio = decoder.decode(torch.from_numpy(rows.reshape(-1))).numpy().reshape(-1, 320)
    after, before = audio[11, :64], audio[5, :64]
    assert np.sqrt(np.mean(after ** 2)) > 5 * np.sqrt(np.mean(before ** 2))


def pulse_by_pulse(codebook, frames, config=DEFAULT_CONFIG):
    """The codec's definition, one frame and one pulse at a time (interpolation_steps 1): white
    noise through the frame's noise response, and each pitch pulse adding the periodic response
    where it falls, everything ringing on into the frames after."""
    from audio_pipeline.decoders.mcep import band_interpolation, mcep_basis, minimum_phase

    hop, length, rate, fft = config["hop"], config["response_length"], config["sample_rate"], config["fft_size"]
    bins = fft // 2 + 1
    envelope = codebook[:, :ORDER] @ mcep_basis(bins, ORDER, config["alpha"])[:, 1:].T
    share = np.clip(10 ** (codebook[:, ORDER:] @ band_interpolation(bins, rate, config["aperiodicity_bands"]).T / 20),
                    1e-4, 1.0)
    periodic = minimum_phase(envelope + 0.5 * np.log(np.maximum(1 - share ** 2, 1e-4)), fft, length)
    aperiodic, unvoiced = minimum_phase(envelope + np.log(share), fft, length), minimum_phase(envelope, fft, length)
    lo, hi = config["gain_range"]
    f0_lo, f0_hi = config["log_f0_range"]
    noise = np.random.default_rng(config["noise_seed"])
    audio = np.zeros((len(frames) + 2) * hop)
    phase, previous_f0 = 0.0, 0.0
    for index, (_, _, entry, prosody) in enumerate(frames):
        f0_code, gain_code = divmod(prosody, GAINS)
        gain = np.exp(lo + gain_code / (GAINS - 1) * (hi - lo))
        f0 = np.exp(f0_lo + (f0_code - 1) / (config["f0_levels"] - 1) * (f0_hi - f0_lo)) if f0_code else 0.0
        at = index * hop
        audio[at:at + hop + length - 1] += np.convolve(noise.standard_normal(hop), (aperiodic if f0 else unvoiced)[entry] * gain)
        if f0:
            start = previous_f0 if previous_f0 else f0
            for sample in range(hop):
                pitch = start + (f0 - start) * (sample + 1) / hop
                if np.floor(phase + pitch / rate) != np.floor(phase):
                    audio[at + sample:at + sample + length] += periodic[entry] * gain * np.sqrt(rate / pitch)
                phase = (phase + pitch / rate) % 1.0
        else:
            phase = 0.0
        previous_f0 = f0
    return np.clip(audio[:len(frames) * hop], -1, 1)


def test_a_block_sounds_as_the_codec_defines_it_pulse_by_pulse(tmp_path):
    """The block synthesis (spectra of pulse trains and noise times spectra of responses) gives
    the samples of adding each response where its pulse or noise sample falls: no wrap-around, no
    lost ring at the frame or block edges, pitch phase carried across unvoiced gaps and blocks."""
    codebook = random_codebook(64, seed=5)
    decoder = load_audio_decoder("mcep", str(save_mcep_decoder(tmp_path, codebook)))
    tokens = codes(40, seed=6)
    frames = tokens.numpy().reshape(-1, 4)
    expected = pulse_by_pulse(codebook, frames)
    assert np.abs(expected).max() > 0.05
    np.testing.assert_allclose(decoder.decode(tokens).numpy(), expected, atol=2e-6, rtol=0)
    state, parts = None, []
    for start, stop in ((0, 1), (1, 9), (9, 40)):
        (audio, state), = decoder.decode_blocks([tokens[start * 4:stop * 4]], [state])
        parts.append(audio.numpy())
    np.testing.assert_allclose(np.concatenate(parts), expected, atol=2e-6, rtol=0)


def test_an_envelope_offset_sounds_as_the_codebook_shifted_by_it(tmp_path):
    """envelope_offset (a fixed equalisation in config.json) is added to every entry's c1..c_order:
    the audio equals that of a codebook with the offset added, and differs from the plain one; an
    offset of the wrong length is refused at load, naming the key."""
    codebook = random_codebook()
    offset = 0.1 * (-1.0) ** np.arange(1, ORDER + 1)
    shifted = codebook.copy()
    shifted[:, :ORDER] += offset
    with_offset = load_audio_decoder("mcep", str(save_mcep_decoder(tmp_path / "a", codebook,
                                                                   envelope_offset=offset.tolist())))
    audio = with_offset.decode(codes()).numpy()
    np.testing.assert_allclose(audio, load_audio_decoder("mcep", str(save_mcep_decoder(tmp_path / "b", shifted)))
                               .decode(codes()).numpy(), atol=1e-6)
    plain = load_audio_decoder("mcep", str(save_mcep_decoder(tmp_path / "c", codebook))).decode(codes()).numpy()
    assert np.abs(audio - plain).max() > 1e-3
    with pytest.raises(ValueError, match="envelope_offset has 3 values, order is 40"):
        load_audio_decoder("mcep", str(save_mcep_decoder(tmp_path / "d", codebook, envelope_offset=[0.1, 0.2, 0.3])))
