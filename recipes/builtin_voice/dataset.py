"""Training data for the built-in voice: eSpeak NG speech of the corpus, coded by the LPC codec, with
every phoneme's length in frames from eSpeak's phoneme events (an explicit, monotonic alignment,
computed exactly as the engine's front-end computes it at run time).

    python -m recipes.builtin_voice.dataset --count 12000 --out data/train.npz [--workers 2]

The output holds the phoneme inventory, the envelope codebook, the texts, and per utterance the
phoneme sequence (inventory indices), each phoneme's frames, and the frames' codes [F, 2]
(envelope, prosody).
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from pathlib import Path

import numpy as np

from audio_pipeline.layouts.phoneme_lpc import FRAME_RATE
from recipes.builtin_voice.corpus import training_texts
from recipes.builtin_voice.espeak import ESpeak, frame_count, phoneme_frames
from recipes.builtin_voice.lpc_codec import Quantizer, analyse


def speak(text: str) -> tuple[str, list[tuple[str, int]], dict[str, np.ndarray]]:
    """(text, (phoneme, frames) pairs, codec parameters of every frame) of one text."""
    u = ESpeak().synthesize(text)
    phonemes = phoneme_frames(u.phonemes, u.length, u.sample_rate, FRAME_RATE)
    params = analyse(u.samples, u.sample_rate, frames=frame_count(u.length, u.sample_rate, FRAME_RATE))
    return text, phonemes, {k: v.astype(np.float32) for k, v in params.items()}


def build(texts: list[str], *, workers: int = 1, codebook_utterances: int = 1500, log_every: int = 1000) -> dict:
    started = time.time()
    utterances = []
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        for i, item in enumerate(pool.imap(speak, texts, chunksize=16)):
            utterances.append(item)
            if log_every and (i + 1) % log_every == 0:
                print(f"  {i + 1}/{len(texts)} utterances, {time.time() - started:.0f} s", flush=True)
    utterances = [u for u in utterances if u[1]]
    lars = np.concatenate([p["lar"] for *_, p in utterances[:codebook_utterances]]).astype(np.float64)
    quantizer = Quantizer.fit(lars)
    print(f"  envelope codebook fitted on {len(lars)} frames, {time.time() - started:.0f} s", flush=True)
    inventory = sorted({name for _, phonemes, _ in utterances for name, _ in phonemes})
    lookup = {name: i for i, name in enumerate(inventory)}
    return {
        "inventory": np.array(inventory),
        "centroids": quantizer.centroids,
        "texts": np.array([t for t, *_ in utterances]),
        "phonemes": [np.array([lookup[n] for n, _ in ph], dtype=np.int16) for _, ph, _ in utterances],
        "durations": [np.array([f for _, f in ph], dtype=np.int16) for _, ph, _ in utterances],
        "codes": [quantizer.encode({k: v.astype(np.float64) for k, v in p.items()}).astype(np.int16)
                  for *_, p in utterances],
    }


def save(data: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    flat = {"inventory": data["inventory"], "centroids": data["centroids"], "texts": data["texts"]}
    for key in ("phonemes", "durations", "codes"):
        flat[f"{key}_lengths"] = np.array([len(a) for a in data[key]])
        flat[key] = np.concatenate(data[key])
    np.savez_compressed(path, **flat)


def load(path: Path) -> dict:
    raw = np.load(path)
    data = {"inventory": [str(p) for p in raw["inventory"]], "centroids": raw["centroids"],
            "texts": [str(t) for t in raw["texts"]]}
    for key in ("phonemes", "durations", "codes"):
        data[key] = np.split(raw[key], np.cumsum(raw[f"{key}_lengths"])[:-1])
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=12000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    started = time.time()
    data = build(training_texts(args.count, seed=args.seed), workers=args.workers)
    save(data, args.out)
    frames = sum(len(c) for c in data["codes"])
    print(f"wrote {args.out}: {len(data['codes'])} utterances, {frames} frames ({frames / FRAME_RATE / 3600:.2f} h), "
          f"{len(data['inventory'])} phonemes, {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
