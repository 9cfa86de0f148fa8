"""Kyutai TTS's golden cases (tests/fixtures/kyutai_tts/, made by scripts/kyutai_tts_reference/ with
moshi 0.2.13 on tiny random checkpoints): each case's record, the engine requests that ask for the
same speech, the check of a finished request against it, and a case's dialogue as SSML."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).parent / "fixtures" / "kyutai_tts"


def load_case(name: str) -> dict:
    """A case's record (case.json)."""
    return json.loads((FIXTURES / "cases" / name / "case.json").read_text())


def model_with_options(target: Path, checkpoint: str, options: dict) -> Path:
    """The fixture checkpoint with a manifest giving ``options`` (its files linked, not copied)."""
    source = FIXTURES / "models" / checkpoint
    target.mkdir(parents=True)
    for path in source.iterdir():
        (target / path.name).symlink_to(path.resolve())
    (target / "audio_pipeline.json").write_text(json.dumps({"family": "kyutai-tts", "layout_options": options}))
    return target


def requests_of(engine, names):
    """(context, case name, item) of every item of the cases, greedy."""
    out = []
    for name in names:
        case = load_case(name)
        for item, (script, voice) in enumerate(zip(case["script"], case["voices"])):
            context = engine.create_context(script[0], voice=voice, temperature=0.0)
            out.append((context, name, item))
    return out


def check(context, chunks, name: str, item: int, atol: float = 1e-4) -> None:
    """A finished request against item ``item`` of case ``name``: every text id fed back, the end
    step, the word timestamps and every audio code exactly, the audio (``chunks``, streamed in more
    than one) within ``atol``."""
    directory = FIXTURES / "cases" / name
    case = load_case(name)
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
    np.testing.assert_allclose(audio, np.load(directory / f"audio_{item}.npy"), atol=atol, rtol=0)
    assert len(chunks) > 1  # streamed in chunks


def dialogue(case: dict, item: int) -> tuple[str, str]:
    """(an SSML document, the request's voice) speaking a case's dialogue: the main speaker's turns
    in the request's voice, the other's in a <voice> naming the second voice (an empty first turn:
    the other speaker starts)."""
    script, voices = case["script"][item], case["voices"][item]
    turns = [text if turn % 2 == 0 else f"<voice name='{voices[1]}'>{text}</voice>"
             for turn, text in enumerate(script) if text]
    return "<speak>" + " ".join(turns) + "</speak>", voices[0]
