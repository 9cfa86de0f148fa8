"""Training data for the second-generation voice: the teacher's speech (teacher.py) coded by the
mcep codec, with the teacher's own units and durations as the explicit alignment.

    python -m recipes.builtin_voice.teacher_dataset --teacher /tmp/bv3/teacher --out /tmp/bv3/train.npz \
        --decoder-out /tmp/bv3/mcep [--count 8000] [--workers 2] [--split train]

``--parameters`` codes the teacher's own vocoder parameters (teacher_parameters.py) instead of
WORLD's analysis of its audio, with a codec fitted on them (``--codec``, from ``teacher_parameters.py
fit``).

A larger run that continues an earlier model keeps that model's codes and unit ids:
``--codec /tmp/bv3/mcep`` reuses the fitted codec instead of fitting one, and ``--inventory
RUN/phonemes.json`` keeps the run's unit order (units it lacks are appended, so ids stay put).

Per utterance: the units (phones with stress, ``pau``; audio_pipeline/text/lexicon.py's names),
each unit's frames (segment ends rounded to the 50 Hz grid), and every frame's (envelope, prosody)
codes. The codec's codebook and levels are fitted on the first ``--fit`` utterances and written
as a decoder directory (``--decoder-out``). The output has the keys of dataset.py's, so train.py
trains on it unchanged.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time
from pathlib import Path

import numpy as np

from recipes.builtin_voice.dataset import save
from recipes.builtin_voice.mcep_codec import Quantizer, _analyze_file
from recipes.builtin_voice.prosody import teacher_units


def _analyze(args: tuple[dict, str]) -> tuple[dict, tuple]:
    """One utterance's analysis, kept beside the teacher's output (``analysis/NNNNN.npz``): WORLD's
    F0 search costs about a second per utterance, and a later, larger run reuses it."""
    record, folder = args
    cache = Path(folder) / "analysis" / f"{record['id']:05d}.npz"
    if cache.is_file():
        with np.load(cache) as saved:
            return record, (saved["cepstrum"], saved["bands"], saved["f0"])
    cepstrum, bands, f0 = _analyze_file(str(Path(folder) / f"{record['id']:05d}.wav"))
    cache.parent.mkdir(exist_ok=True)
    np.savez(cache, cepstrum=cepstrum.astype(np.float32), bands=bands.astype(np.float32), f0=f0.astype(np.float32))
    return record, (cepstrum, bands, f0)


#: Utterances per Festival run when the frames come from the teacher's own parameters.
PARAMETER_BATCH = 50


def _parameters(args: tuple[list[dict], str]) -> list[tuple[dict, tuple]]:
    """A batch of utterances' frame parameters from the teacher's own vocoder parameters
    (teacher_parameters.py: Festival's labels of the same text, hts_engine's mel-cepstra and log F0,
    kept in ``parameters/``) instead of WORLD's analysis of its audio."""
    from recipes.builtin_voice.teacher_parameters import frame_parameters, generate, read_parameters

    records, folder = args
    paths = generate([(r["id"], r["text"]) for r in records], Path(folder) / "parameters", audio=False)
    return [(r, frame_parameters(*read_parameters(paths[r["id"]]))) for r in records]


def build(folder: Path, count: int, *, workers: int, fit: int, decoder_out: Path | None,
          codec: Path | None = None, inventory: list[str] | None = None, split: str | None = None,
          parameters: bool = False) -> dict:
    started = time.time()
    records = [json.loads(line) for line in open(folder / "index.jsonl")]
    if split is not None:
        records = [r for r in records if r.get("split") == split]
        if not records:
            raise SystemExit(f"{folder / 'index.jsonl'} has no records of split {split!r} (teacher --corpus v4 "
                             "writes the splits)")
    records = records[:count]
    analysed = []
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        if parameters:
            batches = [(records[i:i + PARAMETER_BATCH], str(folder)) for i in range(0, len(records), PARAMETER_BATCH)]
            items = (item for batch in pool.imap(_parameters, batches) for item in batch)
        else:
            items = pool.imap(_analyze, [(r, str(folder)) for r in records], chunksize=8)
        for i, item in enumerate(items):
            analysed.append(item)
            if (i + 1) % 500 == 0:
                print(f"  {i + 1}/{len(records)} analysed, {time.time() - started:.0f} s", flush=True)
    if codec is not None:
        quantizer = Quantizer.load(codec)
        print(f"  codec from {codec}", flush=True)
    else:
        quantizer = Quantizer.fit([a for _, a in analysed[:fit]])
        quantizer.save(decoder_out)
        print(f"  codec fitted on {min(fit, len(analysed))} utterances -> {decoder_out}, {time.time() - started:.0f} s",
              flush=True)
    texts, unit_lists, durations, codes = [], [], [], []
    for record, analysis in analysed:
        units, frames = teacher_units(record)
        coded = quantizer.encode(*analysis)
        # The segments end where the audio does, give or take a frame: the last pause absorbs it.
        total = sum(frames)
        if len(coded) < total:
            coded = np.concatenate([coded, np.repeat(coded[-1:], total - len(coded), axis=0)])
        frames[-1] += len(coded) - total
        keep = [i for i, f in enumerate(frames) if f > 0]
        texts.append(record["text"])
        unit_lists.append([units[i].name for i in keep])
        durations.append([frames[i] for i in keep])
        codes.append(coded)
    seen = {u for units in unit_lists for u in units}
    inventory = list(inventory or []) + sorted(seen - set(inventory or []))
    lookup = {u: i for i, u in enumerate(inventory)}
    return {
        "inventory": np.array(inventory),
        "centroids": quantizer.codebook.astype(np.float32),
        "texts": np.array(texts),
        "phonemes": [np.array([lookup[u] for u in units], dtype=np.int16) for units in unit_lists],
        "durations": [np.array(d, dtype=np.int16) for d in durations],
        "codes": [c.astype(np.int16) for c in codes],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--decoder-out", type=Path, help="where the fitted codec is written (without --codec)")
    parser.add_argument("--codec", type=Path, help="reuse this fitted codec (a decoder directory) instead of fitting")
    parser.add_argument("--inventory", type=Path,
                        help="a run's phonemes.json: keep its unit order (for train.py --init-from that run)")
    parser.add_argument("--count", type=int, default=8000)
    parser.add_argument("--fit", type=int, default=1500, help="utterances the codebook is fitted on")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--split", choices=["train", "validation", "test"],
                        help="only the records of this split (a teacher run with --corpus v4)")
    parser.add_argument("--parameters", action="store_true",
                        help="code the teacher's own vocoder parameters (teacher_parameters.py: Festival's labels "
                             "and Debian's hts_engine, about 0.5 s an utterance) instead of WORLD's analysis of its "
                             "audio; use with a codec fitted on them (teacher_parameters.py fit)")
    args = parser.parse_args(argv)
    if args.codec is None and args.decoder_out is None:
        parser.error("give --decoder-out (fit a codec) or --codec (reuse one)")
    started = time.time()
    inventory = json.loads(args.inventory.read_text()) if args.inventory else None
    data = build(args.teacher, args.count, workers=args.workers, fit=args.fit, decoder_out=args.decoder_out,
                 codec=args.codec, inventory=inventory, split=args.split, parameters=args.parameters)
    save(data, args.out)
    frames = sum(len(c) for c in data["codes"])
    print(f"wrote {args.out}: {len(data['codes'])} utterances, {frames} frames ({frames / 50 / 3600:.2f} h), "
          f"{len(data['inventory'])} units, {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
