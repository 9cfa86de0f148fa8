"""Intelligibility with an offline recogniser (pocketsphinx's US English model): closed-set sentence
identification through a JSGF grammar of the candidate sentences, and word error rate with the
general language model.

    python -m recipes.builtin_voice.evaluate --espeak            # the synthesizer the data came from
    python -m recipes.builtin_voice.evaluate --model builtin:lpc-en --temperature 0   # through the engine
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


def recogniser(**kwargs) -> Callable[[bytes], str]:
    """``recognise(pcm)``: pocketsphinx's words for one utterance of 16 kHz 16-bit PCM.

    The decoder's feature computation (its live cepstral mean normalisation) adapts from each
    utterance to the next, so one sentence's result would depend on the sentences heard before it (a
    sentence missed in a run was identified by a fresh decoder). Each utterance starts from fresh
    features instead (``reinit_feat``, a tenth of a millisecond; setting the mean back with
    ``set_cmn`` is not enough): the result is a fresh decoder's, in any order."""
    from pocketsphinx import Decoder

    decoder = Decoder(loglevel="FATAL", **kwargs)

    def recognise(pcm: bytes) -> str:
        decoder.reinit_feat()
        decoder.start_utt()
        decoder.process_raw(pcm, full_utt=True)
        decoder.end_utt()
        hypothesis = decoder.hyp()
        return hypothesis.hypstr if hypothesis else ""

    return recognise


def _pcm16(samples: np.ndarray, rate: int) -> bytes:
    if rate != RATE:
        samples = soxr.resample(samples.astype(np.float32), rate, RATE)
    return (np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()


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
             grammar_file: str, candidates: Sequence[str] | None = None) -> dict[str, float]:
    """Closed-set identification accuracy (among ``candidates``, default ``sentences``) and WER of
    ``synthesize`` on ``sentences``."""
    with open(grammar_file, "w") as f:
        f.write(jsgf_grammar(candidates or sentences))
    closed = recogniser(jsgf=grammar_file)
    open_set = recogniser()
    correct = errors = words = 0
    missed = []
    for text in sentences:
        pcm = _pcm16(*synthesize(text))
        heard = closed(pcm)
        if _words(heard) == _words(text):
            correct += 1
        else:
            missed.append((text, heard))
        e, n = word_errors(text, open_set(pcm))
        errors, words = errors + e, words + n
    return {"identified": correct, "sentences": len(sentences), "accuracy": correct / len(sentences),
            "wer": errors / max(words, 1), "missed": missed}


def print_missed(result: dict) -> None:
    """Each sentence the closed set did not identify, and what it heard instead."""
    for text, heard in result["missed"]:
        print(f"  missed: {' '.join(_words(text))!r}\n   heard: {' '.join(_words(heard)) or '(nothing)'!r}")


def engine_synthesizer(model_dir: str, *, temperature: float | None = None, flags: Sequence[str] = ()):
    """A started TTSEngine serving ``model_dir`` and a ``synthesize(text)`` that goes through it."""
    from audio_pipeline.config import AudioGenerationConfig
    from audio_pipeline.service.engine import TTSEngine

    config = AudioGenerationConfig.load(
        env={}, audio_flags=list(flags),
        model={"model_path": model_dir, "device": "cpu"})
    engine = TTSEngine(config)
    engine.start()
    overrides = {} if temperature is None else {"temperature": temperature}

    def synthesize(text: str):
        result = engine.synthesize(text, **overrides)
        return result.samples, result.sample_rate

    return engine, synthesize


def main(argv: list[str] | None = None) -> int:
    import tempfile

    from recipes.builtin_voice.corpus import evaluation_texts

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--espeak", action="store_true", help="evaluate eSpeak NG itself")
    parser.add_argument("--model", action="append", default=[],
                        help="evaluate this model directory through the engine (or builtin:NAME); repeat it to "
                             "compare models in one run")
    parser.add_argument("--temperature", type=float, help="sampling temperature (default: the engine's)")
    parser.add_argument("--task-arg", action="append", default=[], metavar="NAME=VALUE",
                        help="an engine setting for every model evaluated (as the server's --task-arg), e.g. "
                             "model.prompt_dtype=float32")
    parser.add_argument("--count", type=int, default=40)
    parser.add_argument("--split", default="held-out", choices=["held-out", "validation", "test"],
                        help="held-out: the 40 sentences the first generations were measured on; validation or "
                             "test: the fourth generation's fixed splits (corpus.py split_of; validation chooses "
                             "checkpoints, test is reported once)")
    parser.add_argument("--show-missed", action="store_true",
                        help="list each sentence the closed set did not identify, with what it heard")
    parser.add_argument("--write", help="write the first sentence's audio here (WAV; the first model's)")
    args = parser.parse_args(argv)
    if not args.espeak and not args.model:
        parser.error("choose what to evaluate (--espeak or --model)")
    test = evaluation_texts(args.split, args.count)
    lines = []
    for model in ([None] if args.espeak else []) + args.model:
        engine = None
        if model is None:
            from recipes.builtin_voice.espeak import ESpeak

            def synthesize(text):
                u = ESpeak().synthesize(text)
                return u.samples, u.sample_rate
            label = "eSpeak NG"
        else:
            engine, synthesize = engine_synthesizer(model, temperature=args.temperature, flags=args.task_arg)
            label = f"{model} (temperature {args.temperature if args.temperature is not None else 'default'}" + "".join(f", {a}" for a in args.task_arg) + ")"
        try:
            if args.write and not lines:
                import soundfile as sf

                audio, rate = synthesize(test[0])
                sf.write(args.write, audio, rate)
            with tempfile.NamedTemporaryFile(suffix=".jsgf") as grammar:
                result = evaluate(test, synthesize, grammar.name)
        finally:
            if engine is not None:
                engine.stop()
        lines.append(f"{label}: closed-set identification {result['identified']}/{result['sentences']} "
                     f"({result['accuracy']:.0%}), WER {result['wer']:.1%}")
        print(lines[-1], flush=True)
        if args.show_missed:
            print_missed(result)
    if len(lines) > 1:
        print("\n".join(["side by side:", *lines]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
