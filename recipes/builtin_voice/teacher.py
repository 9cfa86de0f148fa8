"""The second-generation voice's teacher: Festival with the HTS voice ``cmu_us_slt_arctic_hts``.

Recipe only (Debian: ``apt-get install festival festvox-us-slt-hts``; the run time never needs
Festival). For each text it writes the teacher's speech and what Festival knows about it: every
segment (CMU phone set, ``pau`` for pauses) with its end time, its syllable's stress (0/1) and its
word, and every word with its start and end (after Festival's own text normalization: "9:15"
becomes "nine fifteen").

    python -m recipes.builtin_voice.teacher --count 200 --out /tmp/bv2/teacher [--workers 2]

One Festival process synthesizes a whole batch of texts (its start-up, about 0.2 s, is paid once
per batch). Output per utterance ``NNNNN``: ``NNNNN.wav`` (the voice's 32 kHz, as Festival writes
it) and one line of ``index.jsonl``: {"id", "text", "segments": [[name, end_s, stress, word],
...], "words": [[word, start_s, end_s], ...]} (a pause's word is "").

Licences: Festival (X11-style), the voice ``cmu_us_slt_arctic_hts`` (CMU's EST-2003/EST-2000
licences, HTS parts BSD-3-clause; /usr/share/doc/festvox-us-slt-hts/copyright): all permit
redistribution and derived works with the notices kept.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

VOICE = "cmu_us_slt_arctic_hts"
#: Marks Festival's printed lines, so that its own chatter can never be mistaken for ours.
MARK = "@@"


@dataclass
class TeacherUtterance:
    index: int
    text: str
    wav: Path
    #: (phone, end in seconds, stress of its syllable, its word; "" and 0 for a pause)
    segments: list[tuple[str, float, int, str]]
    words: list[tuple[str, float, float]]


def _scheme_string(text: str) -> str:
    """``text`` as a Scheme string literal (Festival reads backslash escapes)."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _script(texts: list[tuple[int, str]], out_dir: Path, voice: str) -> str:
    lines = [f"(voice_{voice})"]
    for index, text in texts:
        wav = out_dir / f"{index:05d}.wav"
        lines += [
            f"(set! utt (Utterance Text {_scheme_string(text)}))",
            "(utt.synth utt)",
            f"(utt.save.wave utt {_scheme_string(str(wav))} 'riff)",
            f'(format t "{MARK}U {index}\\n")',
            f'(mapcar (lambda (s) (format t "{MARK}S %s %f %s %s\\n" (item.name s) (item.feat s "end") '
            '(item.feat s "R:SylStructure.parent.stress") (item.feat s "R:SylStructure.parent.parent.name"))) '
            "(utt.relation.items utt 'Segment))",
            f'(mapcar (lambda (w) (format t "{MARK}W %s %f %f\\n" (item.name w) (item.feat w "word_start") '
            '(item.feat w "word_end"))) (utt.relation.items utt \'Word))',
        ]
    return "\n".join(lines) + "\n"


def parse_output(stdout: str, texts: dict[int, str], out_dir: Path) -> list[TeacherUtterance]:
    """The utterances described by a batch's marked output lines."""
    utterances: list[TeacherUtterance] = []
    for line in stdout.splitlines():
        if not line.startswith(MARK):
            continue
        kind, *fields = line[len(MARK):].split()
        if kind == "U":
            index = int(fields[0])
            utterances.append(TeacherUtterance(index, texts[index], out_dir / f"{index:05d}.wav", [], []))
        elif kind == "S":
            name, end = fields[0], float(fields[1])
            stress = int(fields[2]) if len(fields) > 2 and fields[2].isdigit() else 0
            word = fields[3] if len(fields) > 3 and name != "pau" else ""
            utterances[-1].segments.append((name, end, stress, word))
        elif kind == "W":
            utterances[-1].words.append((fields[0], float(fields[1]), float(fields[2])))
    return utterances


def synthesize(texts: list[tuple[int, str]], out_dir: Path, voice: str = VOICE) -> list[TeacherUtterance]:
    """Speaks ``(index, text)`` pairs with one Festival process; RuntimeError if Festival fails."""
    festival = shutil.which("festival")
    if festival is None:
        raise RuntimeError("festival is not installed (apt-get install festival festvox-us-slt-hts)")
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".scm", delete=False) as script:
        script.write(_script(texts, out_dir, voice))
    try:
        done = subprocess.run([festival, "-b", script.name], capture_output=True, text=True, timeout=3600)
    finally:
        Path(script.name).unlink()
    utterances = parse_output(done.stdout, dict(texts), out_dir)
    if done.returncode != 0 or len(utterances) != len(texts):
        raise RuntimeError(f"festival spoke {len(utterances)} of {len(texts)} texts (exit {done.returncode}): "
                           f"{done.stderr[-500:]}")
    return utterances


def _batch(args: tuple[list[tuple[int, str]], str, str, dict[int, str]]) -> list[dict]:
    texts, out_dir, voice, splits = args
    return [{"id": u.index, "text": u.text, "segments": u.segments, "words": u.words}
            | ({"split": splits[u.index]} if u.index in splits else {})
            for u in synthesize(texts, Path(out_dir), voice)]


def main(argv: list[str] | None = None) -> int:
    from audio_pipeline.text.normalize import normalize
    from recipes.builtin_voice.corpus import training_texts, v4_corpus

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=200, help="texts of the training corpus to speak")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--workers", type=int, default=2, help="Festival processes at once")
    parser.add_argument("--batch", type=int, default=100, help="texts per Festival process")
    parser.add_argument("--voice", default=VOICE, help="Festival voice")
    parser.add_argument("--corpus", default="v3", choices=["v3", "v4"],
                        help="v3: the training texts of the second and third generations; v4: the fourth's, "
                             "each record with its fixed split (train, validation, test)")
    args = parser.parse_args(argv)
    # The teacher reads the text as the server's normalizer writes it out, so that its words are
    # the words the run-time front end sees.
    if args.corpus == "v4":
        drawn = v4_corpus(args.count)
        splits = {i: split for i, (_, split) in enumerate(drawn)}
        texts = [(i, normalize(text).spoken) for i, (text, _) in enumerate(drawn)]
    else:
        splits = {}
        texts = [(i, normalize(text).spoken) for i, text in enumerate(training_texts(args.count))]
    batches = [(texts[i:i + args.batch], args.out, args.voice, splits) for i in range(0, len(texts), args.batch)]
    started = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with multiprocessing.Pool(args.workers) as pool, (out / "index.jsonl").open("w") as index:
        for records in pool.imap(_batch, batches):
            for record in records:
                index.write(json.dumps(record) + "\n")
    seconds = time.monotonic() - started
    print(f"{len(texts)} utterances in {seconds:.1f} s ({1000 * seconds / max(len(texts), 1):.0f} ms each) "
          f"-> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
