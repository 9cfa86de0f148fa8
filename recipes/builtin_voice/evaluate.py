"""Intelligibility with an offline recogniser (pocketsphinx's US English model): closed-set sentence
identification through a JSGF grammar of the candidate sentences, and word error rate with the
general language model.

    python -m recipes.builtin_voice.evaluate --espeak            # the synthesizer the data came from
"""

from __future__ import annotations

import argparse
import re
from typing import Callable, Sequence

import numpy as np
import soxr

RATE = 16000


def _words(text: str) -> list[str]:
    return re.sub(r"[^a-z' ]", " ", text.lower()).split()


def _decoder(**kwargs):
    from pocketsphinx import Decoder

    return Decoder(loglevel="FATAL", **kwargs)


def _pcm16(samples: np.ndarray, rate: int) -> bytes:
    if rate != RATE:
        samples = soxr.resample(samples.astype(np.float32), rate, RATE)
    return (np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()


def _recognise(decoder, pcm: bytes) -> str:
    decoder.start_utt()
    decoder.process_raw(pcm, full_utt=True)
    decoder.end_utt()
    hypothesis = decoder.hyp()
    return hypothesis.hypstr if hypothesis else ""


def jsgf_grammar(sentences: Sequence[str]) -> str:
    alternatives = " | ".join(" ".join(_words(s)) for s in sentences)
    return f"#JSGF V1.0;\ngrammar candidates;\npublic <sentence> = {alternatives};\n"


def word_errors(reference: str, hypothesis: str) -> tuple[int, int]:
    ref, hyp = _words(reference), _words(hypothesis)
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        previous, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (r != h))
    return row[-1], len(ref)


def evaluate(sentences: Sequence[str], synthesize: Callable[[str], tuple[np.ndarray, int]],
             grammar_file: str) -> dict[str, float]:
    """Closed-set identification accuracy and WER of ``synthesize`` on ``sentences``."""
    with open(grammar_file, "w") as f:
        f.write(jsgf_grammar(sentences))
    closed = _decoder(jsgf=grammar_file)
    open_set = _decoder()
    correct = errors = words = 0
    for text in sentences:
        pcm = _pcm16(*synthesize(text))
        if _words(_recognise(closed, pcm)) == _words(text):
            correct += 1
        e, n = word_errors(text, _recognise(open_set, pcm))
        errors, words = errors + e, words + n
    return {"identified": correct, "sentences": len(sentences), "accuracy": correct / len(sentences),
            "wer": errors / max(words, 1)}


def main(argv: list[str] | None = None) -> int:
    import tempfile

    from recipes.builtin_voice.corpus import held_out, sentences

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--espeak", action="store_true", help="evaluate eSpeak NG itself")
    parser.add_argument("--count", type=int, default=40)
    args = parser.parse_args(argv)
    test = held_out(args.count, train=sentences(6000))
    if args.espeak:
        from recipes.builtin_voice.espeak import ESpeak

        engine = ESpeak()

        def synthesize(text):
            u = engine.synthesize(text)
            return u.samples, u.sample_rate
    else:
        parser.error("choose what to evaluate (--espeak)")
    with tempfile.NamedTemporaryFile(suffix=".jsgf") as grammar:
        result = evaluate(test, synthesize, grammar.name)
    print(f"closed-set identification {result['identified']}/{result['sentences']} "
          f"({result['accuracy']:.0%}), WER {result['wer']:.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
