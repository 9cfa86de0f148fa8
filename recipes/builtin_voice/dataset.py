"""Training data for the built-in voice: eSpeak NG speech of the corpus, coded by the LPC codec, with
every codec frame labelled by the phoneme eSpeak was saying (its phoneme events: an explicit,
monotonic alignment).

    python -m recipes.builtin_voice.dataset --count 6000 --out data/train.npz

The output holds the phoneme inventory, the envelope codebook, and per utterance the phoneme
sequence, each frame's phoneme index into that sequence, and the frames' codes [F, 3].
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from recipes.builtin_voice.corpus import sentences
from recipes.builtin_voice.espeak import ESpeak
from recipes.builtin_voice.lpc_codec import HOP, RATE, Quantizer, analyse


def align(phonemes: list[tuple[str, int]], espeak_rate: int, frames: int) -> tuple[list[str], np.ndarray]:
    """(phoneme sequence, for each codec frame the index of the phoneme sounding at its centre)."""
    names = [name for name, _ in phonemes]
    starts = np.array([start for _, start in phonemes], dtype=np.float64) / espeak_rate
    centres = (np.arange(frames) * HOP + HOP / 2) / RATE
    index = np.searchsorted(starts, centres, side="right") - 1
    return names, np.clip(index, 0, len(names) - 1)


def build(count: int, *, seed: int = 0, codebook_sentences: int = 600, log_every: int = 500) -> dict:
    engine = ESpeak()
    texts = sentences(count, seed=seed)
    started = time.time()
    utterances = []
    for i, text in enumerate(texts):
        u = engine.synthesize(text)
        params = analyse(u.samples, u.sample_rate)
        names, frame_phoneme = align(u.phonemes, u.sample_rate, len(params["f0"]))
        utterances.append((text, names, frame_phoneme, params))
        if log_every and (i + 1) % log_every == 0:
            print(f"  {i + 1}/{count} utterances, {time.time() - started:.0f} s", flush=True)
    quantizer = Quantizer.fit(np.concatenate([p["lar"] for *_, p in utterances[:codebook_sentences]]))
    inventory = sorted({name for _, names, _, _ in utterances for name in names})
    lookup = {name: i for i, name in enumerate(inventory)}
    return {
        "inventory": np.array(inventory),
        "centroids": quantizer.centroids,
        "texts": np.array([t for t, *_ in utterances]),
        "phonemes": [np.array([lookup[n] for n in names], dtype=np.int16) for _, names, _, _ in utterances],
        "frame_phoneme": [fp.astype(np.int16) for _, _, fp, _ in utterances],
        "codes": [quantizer.encode(p).astype(np.int16) for *_, p in utterances],
    }


def save(data: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    flat = {"inventory": data["inventory"], "centroids": data["centroids"], "texts": data["texts"]}
    for key in ("phonemes", "frame_phoneme", "codes"):
        flat[f"{key}_lengths"] = np.array([len(a) for a in data[key]])
        flat[key] = np.concatenate(data[key])
    np.savez_compressed(path, **flat)


def load(path: Path) -> dict:
    raw = np.load(path)
    data = {"inventory": list(raw["inventory"]), "centroids": raw["centroids"], "texts": list(raw["texts"])}
    for key in ("phonemes", "frame_phoneme", "codes"):
        data[key] = np.split(raw[key], np.cumsum(raw[f"{key}_lengths"])[:-1])
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=6000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    started = time.time()
    data = build(args.count, seed=args.seed)
    save(data, args.out)
    frames = sum(len(c) for c in data["codes"])
    print(f"wrote {args.out}: {len(data['codes'])} utterances, {frames} frames ({frames / 50 / 3600:.2f} h), "
          f"{len(data['inventory'])} phonemes, {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
