"""Streaming NeuCodec audio as the neutts family does: the prepend modes hand the decoder the
voice's reference codes for real (``once`` and ``rolling`` before the generated codes, their audio
dropped; ``never`` not), every chunk holds exactly its frames' samples, and seams stay as smooth
as the one-shot audio. The tiny random NeuCodec is not causal, so streamed audio is compared with
the one-shot decode within measured tolerances."""

from __future__ import annotations

import math

import pytest
import torch

from audio_pipeline.decoders import load_audio_decoder
from audio_pipeline.testing.random_decoders import save_random_neucodec_checkpoint
from audio_pipeline.decoders.streaming import DecoderStream, decode_windows
from audio_pipeline.layouts.registry import get_family

FAMILY = dict(get_family("neutts").streaming)
SAMPLES_PER_FRAME = 480


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    return load_audio_decoder("neucodec", str(save_random_neucodec_checkpoint(tmp_path_factory.mktemp("nc"))))


@pytest.fixture
def calls(decoder, monkeypatch):
    """Every code sequence the decoder is handed, in order."""
    seen = []
    original = decoder.decode_batch

    def recording(batch):
        seen.extend(codes.tolist() for codes in batch)
        return original(batch)

    monkeypatch.setattr(decoder, "decode_batch", recording)
    return seen


def random_codes(frames, seed):
    return torch.randint(0, 65536, (frames,), generator=torch.Generator().manual_seed(seed))


GENERATED = random_codes(200, 0)  # 4 s of speech
REFERENCE = random_codes(100, 1)  # a 2 s reference recording's codes


def stream(decoder, generated=GENERATED, *, step=5, **settings):
    """The chunks a stream decodes as generation goes (``step`` codes at a time), in order."""
    stream = DecoderStream(decoder, **settings)
    parts, known = [], 0
    while known < generated.numel():
        known = min(known + step, generated.numel())
        while (window := stream.next_window(known, known == generated.numel())) is not None:
            parts.append(decode_windows(decoder, [(stream, window, generated[window.start:window.end])])[0])
    return parts


def chunk_frames(chunk_size, frames):
    out = []
    while frames > 0:
        out.append(min(chunk_size[min(len(out), len(chunk_size) - 1)], frames))
        frames -= out[-1]
    return out


def snr_db(reference, test):
    error = ((test - reference) ** 2).sum().item()
    return math.inf if error == 0 else 10 * math.log10((reference ** 2).sum().item() / error)


def largest_seam_jump(parts):
    audio, seams = torch.cat(parts), torch.tensor([p.numel() for p in parts[:-1]]).cumsum(0)
    return (audio[seams] - audio[seams - 1]).abs().max().item()


# --- what the decoder is handed ----------------------------------------------------------------

def test_never_hands_the_decoder_no_reference_codes(decoder, calls):
    stream(decoder, chunk_size=[15, 25, 50], buffer=50, prepend="never", prompt_codes=REFERENCE)
    g = GENERATED.tolist()
    assert calls == [g[0:15], g[0:40], g[0:90], g[40:140], g[90:190], g[140:200]]


def test_once_puts_the_whole_reference_before_the_first_chunk_only(decoder, calls):
    parts = stream(decoder, chunk_size=[15, 25, 50], buffer=50, prepend="once", prompt_codes=REFERENCE)
    r, g = REFERENCE.tolist(), GENERATED.tolist()
    assert calls == [r + g[0:15], g[0:40], g[0:90], g[40:140], g[90:190], g[140:200]]
    # The first chunk is the audio of its codes decoded after the reference, the reference's dropped.
    after_reference = decoder.decode(torch.cat([REFERENCE, GENERATED[:15]]))
    torch.testing.assert_close(parts[0], after_reference[100 * SAMPLES_PER_FRAME:], atol=1e-6, rtol=0)


def test_rolling_fills_the_buffer_from_the_references_tail_while_the_speech_is_short(decoder, calls):
    parts = stream(decoder, chunk_size=[15, 25, 50], buffer=50, prepend="rolling", prompt_codes=REFERENCE)
    r, g = REFERENCE.tolist(), GENERATED.tolist()
    assert calls == [r + g[0:15],  # chunk 0: the whole reference
                     r[-35:] + g[0:40],  # 15 generated codes of context, 35 from the reference's tail
                     r[-10:] + g[0:90],  # 40 generated, 10 from the reference
                     g[40:140], g[90:190], g[140:200]]  # the buffer is all speech from here on
    second = decoder.decode(torch.tensor(r[-35:] + g[0:40]))
    torch.testing.assert_close(parts[1], second[50 * SAMPLES_PER_FRAME:], atol=1e-6, rtol=0)


@pytest.mark.parametrize("prepend", ["never", "once", "rolling"])
def test_every_chunk_is_exactly_its_frames_and_no_reference_audio(decoder, prepend):
    chunk_size = FAMILY["chunk_size"]
    parts = stream(decoder, chunk_size=chunk_size, buffer=FAMILY["buffer"], prepend=prepend, prompt_codes=REFERENCE)
    assert [p.numel() for p in parts] == [f * SAMPLES_PER_FRAME for f in chunk_frames(chunk_size, 200)]
    assert sum(p.numel() for p in parts) == GENERATED.numel() * SAMPLES_PER_FRAME


def test_the_reference_changes_what_the_first_chunk_sounds_like(decoder):
    """Not causal: the reference before the first chunk is context the decoder uses."""
    alone = stream(decoder, chunk_size=[15], prepend="never", prompt_codes=REFERENCE)[0]
    after = stream(decoder, chunk_size=[15], prepend="once", prompt_codes=REFERENCE)[0]
    assert (alone - after).abs().max() > 1e-3


# --- fidelity against the one-shot decode --------------------------------------------------------

#: The family's settings, measured on the tiny random NeuCodec over the three seeds below: streamed
#: against the one-shot decode (with the reference before it for once and rolling) 9.4 to 11.0 dB
#: over the whole utterance, 13.8 to 16.8 dB away from the chunks' last 5 frames (those are decoded
#: with no frame after them: about 0 dB in the very last one); seams at most 0.57 of the largest
#: step inside the one-shot audio. Without the buffer: 6.4 to 6.9 dB, 7.8 to 8.5 away from the ends.
MIN_SNR_DB, MIN_INNER_SNR_DB, EDGE_FRAMES = 7.0, 12.0, 5


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("prepend", ["never", "once", "rolling"])
def test_streamed_audio_against_one_shot_and_seams(decoder, prepend, seed):
    generated, reference = random_codes(200, 10 + seed), random_codes(100, 20 + seed)
    chunk_size = FAMILY["chunk_size"]
    parts = stream(decoder, generated, chunk_size=chunk_size, buffer=FAMILY["buffer"], prepend=prepend,
                   prompt_codes=reference)
    streamed = torch.cat(parts)
    if prepend == "never":
        one_shot = decoder.decode(generated)
    else:
        one_shot = decoder.decode(torch.cat([reference, generated]))[reference.numel() * SAMPLES_PER_FRAME:]
    assert streamed.numel() == one_shot.numel()
    assert snr_db(one_shot, streamed) > MIN_SNR_DB
    ends = torch.tensor(chunk_frames(chunk_size, 200)).cumsum(0)
    inner = torch.ones(200, dtype=torch.bool)
    for end in ends.tolist():
        inner[max(0, end - EDGE_FRAMES):end] = False
    frames = lambda audio: audio.view(200, SAMPLES_PER_FRAME)[inner]  # noqa: E731
    assert snr_db(frames(one_shot), frames(streamed)) > MIN_INNER_SNR_DB
    assert largest_seam_jump(parts) <= one_shot.diff().abs().max().item()


def test_left_context_makes_streamed_audio_closer_to_one_shot(decoder):
    one_shot = decoder.decode(GENERATED)
    with_buffer = torch.cat(stream(decoder, chunk_size=FAMILY["chunk_size"], buffer=FAMILY["buffer"]))
    without = torch.cat(stream(decoder, chunk_size=FAMILY["chunk_size"], buffer=0))
    assert snr_db(one_shot, with_buffer) > snr_db(one_shot, without) + 2.0
