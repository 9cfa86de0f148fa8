"""Mel-cepstral distortion against the teacher on the held-out sentences: of the codec's round
trip and of a voice through the engine (DTW-aligned, since a voice's timing differs from the
teacher's).

    python -m recipes.builtin_voice.distortion --decoder /tmp/bv3/mcep            # codec round trip
    python -m recipes.builtin_voice.distortion --model builtin:slt-en [--temperature 0]

MCD in dB over c1..c24 of the mel-cepstrum (alpha 0.42, 16 kHz; WORLD's envelope): (10 / ln 10)
* sqrt(2 * sum of squared differences), averaged over the DTW path's frames (speech frames only:
the teacher's leading and trailing silence is cut at -50 dB below its loudest frame).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np

COEFFICIENTS = 24


def cepstra(samples: np.ndarray, rate: int) -> np.ndarray:
    from recipes.builtin_voice.mcep_codec import Analyzer

    cepstrum, _, _ = Analyzer().analyze(samples, rate)
    return cepstrum


def trim(cepstrum: np.ndarray) -> np.ndarray:
    """Frames from the first to the last within 50 dB (in c0) of the loudest."""
    loud = cepstrum[:, 0] > cepstrum[:, 0].max() - 50 / (20 / math.log(10))
    index = np.nonzero(loud)[0]
    return cepstrum[index[0]:index[-1] + 1] if index.size else cepstrum


def mcd(reference: np.ndarray, other: np.ndarray) -> float:
    """DTW-aligned mean mel-cepstral distortion (dB) between two [frames, order + 1] cepstra."""
    a, b = reference[:, 1:COEFFICIENTS + 1], other[:, 1:COEFFICIENTS + 1]
    cost = np.sqrt(((a[:, None, :] - b[None, :, :]) ** 2).sum(-1))
    n, m = cost.shape
    total = np.full((n + 1, m + 1), np.inf)
    steps = np.zeros((n + 1, m + 1), dtype=np.int64)
    total[0, 0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            options = (total[i - 1, j - 1], total[i - 1, j], total[i, j - 1])
            k = int(np.argmin(options))
            total[i, j] = cost[i - 1, j - 1] + options[k]
            steps[i, j] = (steps[i - 1, j - 1], steps[i - 1, j], steps[i, j - 1])[k] + 1
    return float((10 / math.log(10)) * math.sqrt(2) * total[n, m] / steps[n, m])


def _distortion(args, texts, utterances, model) -> str:
    """The MCD line of the codec round trip (model None) or of ``model`` through the engine."""
    import soundfile as sf

    engine = None
    if model is None:
        from audio_pipeline.decoders import load_audio_decoder
        from recipes.builtin_voice.mcep_codec import Quantizer, round_trip

        decoder, quantizer = load_audio_decoder("mcep", args.decoder), Quantizer.load(args.decoder)

        def speak(index, text):
            samples, rate = sf.read(utterances[index].wav)
            return round_trip(decoder, quantizer, samples, rate), decoder.sample_rate
        label = f"codec round trip ({args.decoder})"
    else:
        from recipes.builtin_voice.evaluate import engine_synthesizer

        engine, synthesize = engine_synthesizer(model, temperature=args.temperature, flags=args.task_arg)

        def speak(index, text):
            return synthesize(text)
        label = f"{model} (temperature {args.temperature if args.temperature is not None else 'default'}" + "".join(f", {a}" for a in args.task_arg) + ")"
    try:
        values = []
        for index, text in enumerate(texts):
            reference = trim(cepstra(*sf.read(utterances[index].wav)))
            samples, rate = speak(index, text)
            values.append(mcd(reference, trim(cepstra(samples, rate))))
    finally:
        if engine is not None:
            engine.stop()
    return f"{label}: MCD {np.mean(values):.2f} dB (median {np.median(values):.2f}, {len(values)} sentences)"


def main(argv: list[str] | None = None) -> int:
    from recipes.builtin_voice.corpus import evaluation_texts
    from recipes.builtin_voice.teacher import synthesize as teacher_speak

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--decoder", help="the codec round trip of this mcep decoder directory")
    what.add_argument("--model", action="append",
                      help="this model through the engine (a directory or builtin:NAME); repeat it to compare "
                           "models in one run")
    parser.add_argument("--temperature", type=float, help="sampling temperature (default: the engine's)")
    parser.add_argument("--task-arg", action="append", default=[], metavar="NAME=VALUE",
                        help="an engine setting for every model evaluated (as the server's --task-arg), e.g. "
                             "model.prompt_dtype=float32")
    parser.add_argument("--count", type=int, default=40)
    parser.add_argument("--split", default="held-out", choices=["held-out", "validation", "test"],
                        help="held-out: the 40 sentences the first generations were measured on; validation or "
                             "test: the fourth generation's fixed splits (corpus.py split_of; validation chooses "
                             "checkpoints, test is reported once)")
    parser.add_argument("--work", help="where the teacher's speech goes (default /tmp/bv2/SPLIT)")
    args = parser.parse_args(argv)
    texts = evaluation_texts(args.split, args.count)
    from audio_pipeline.text.normalize import normalize

    utterances = teacher_speak([(i, normalize(t).spoken) for i, t in enumerate(texts)],
                             Path(args.work or f"/tmp/bv2/{args.split}"))
    lines = []
    for model in args.model or [None]:
        lines.append(_distortion(args, texts, utterances, model))
        print(lines[-1], flush=True)
    if len(lines) > 1:
        print("\n".join(["side by side:", *lines]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
