"""The second-generation voice's phrase breaks and durations, learned from the teacher's timings
(the models: audio_pipeline/text/prosody.py), and the teacher's units for the voice's training data.

    python -m recipes.builtin_voice.prosody --teacher /tmp/bv3/teacher --lexicon /tmp/bv3/lexicon.txt.gz \
        --out /tmp/bv3/prosody.json

The run-time front end's words (audio_pipeline/text/lexicon.py) are matched to the teacher's
segments by aligning the two phone sequences (they agree on over 99 % of phones), which places
each of the teacher's pauses between two of our words. The last 10 % of the utterances are held
out: the script reports the break model's accuracy there and the duration error, in frames,
against the teacher's, next to the error of each unit's mean duration.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter
from pathlib import Path

import numpy as np

from audio_pipeline.text.lexicon import Lexicon, Phonemizer, Word, punctuation_after, unit, words_to_punctuation
from audio_pipeline.text.prosody import (CAP, PAUSE, Unit, break_features, duration_features,
                                         duration_input_size)

FRAME_RATE = 50


def teacher_units(record: dict) -> tuple[list[Unit], list[int]]:
    """The teacher's units of one utterance (pauses with kind "" for now) and their frames (the
    segment ends rounded to the frame grid; units shorter than half a frame get none)."""
    units, frames, previous_end, word, last_name = [], [], 0, -1, None
    for name, end, stress, word_name in record["segments"]:
        boundary = int(round(float(end) * FRAME_RATE))
        if name == PAUSE:
            units.append(Unit(PAUSE, -1))
            last_name = None
        else:
            if word_name != last_name:
                word += 1
                last_name = word_name
            units.append(Unit(unit(name, int(stress)), word))
        frames.append(max(0, boundary - previous_end))
        previous_end = max(previous_end, boundary)
    return units, frames


def align(ours: list[str], theirs: list[str]) -> list[int | None]:
    """For each of ``theirs``, the index of the element of ``ours`` it aligns with (or None)."""
    n, m = len(ours), len(theirs)
    cost = np.zeros((n + 1, m + 1), dtype=np.int32)
    cost[:, 0] = np.arange(n + 1)
    cost[0, :] = np.arange(m + 1)
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            cost[i, j] = min(cost[i - 1, j] + 1, cost[i, j - 1] + 1, cost[i - 1, j - 1] + (ours[i - 1] != theirs[j - 1]))
    out: list[int | None] = [None] * m
    i, j = n, m
    while i > 0 and j > 0:
        if cost[i, j] == cost[i - 1, j - 1] + (ours[i - 1] != theirs[j - 1]):
            out[j - 1] = i - 1
            i, j = i - 1, j - 1
        elif cost[i, j] == cost[i - 1, j] + 1:
            i -= 1
        else:
            j -= 1
    return out


def _matched(record: dict, phonemizer: Phonemizer):
    """Our words and punctuation for the record's text, the teacher's units (each pause given its
    kind) and frames, and the indices of our words the teacher paused after."""
    items = phonemizer.words(record["text"])
    words = [w for w in items if isinstance(w, Word)]
    marks = punctuation_after(items)  # as the run-time front end reads them
    our_phones, our_word = [], []
    for index, word in enumerate(words):
        our_phones += word.units
        our_word += [index] * len(word.units)
    units, frames = teacher_units(record)
    phone_positions = [i for i, u in enumerate(units) if u.name != PAUSE]
    mapping = align(our_phones, [units[i].name for i in phone_positions])
    word_of_unit = {position: (our_word[k] if k is not None else None) for position, k in zip(phone_positions, mapping)}
    # Pauses: what caused each (their kinds), and which of our word boundaries hold one.
    paused_after: set[int] = set()
    for index, u in enumerate(units):
        if u.name != PAUSE:
            continue
        before = next((word_of_unit[i] for i in range(index - 1, -1, -1) if word_of_unit.get(i) is not None), None)
        if index == 0 or before is None:
            u.kind = "start"
        elif index == len(units) - 1:
            u.kind = "end"
        else:
            u.kind = marks.get(before, "break")
            paused_after.add(before)
    return words, marks, units, frames, paused_after


def examples(record: dict, phonemizer: Phonemizer):
    """(break examples [(features..., label)], duration examples [(units, frames)]) of one utterance."""
    words, marks, units, frames, paused_after = _matched(record, phonemizer)
    breaks = []
    since = 0
    for index in range(len(words) - 1):
        since += 1
        if index in marks:
            since = 0
            continue
        label = index in paused_after
        breaks.append((words[index + 1], since, words_to_punctuation(index, len(words), marks), label,
                       record["text"]))
        if label:
            since = 0
    return breaks, (units, frames)


def comma_openings(record: dict, phonemizer: Phonemizer) -> list[tuple[str, bool]]:
    """(word, paused) for each comma after a one-word phrase (the text's first word, or the first
    after a pause) in one utterance: whether the teacher paused there."""
    words, marks, _, _, paused_after = _matched(record, phonemizer)
    out, since = [], 0
    for index in range(len(words) - 1):
        since += 1
        if marks.get(index) == "," and since == 1:
            out.append((record["text"][words[index].start:words[index].end].lower(), index in paused_after))
        if index in marks or index in paused_after:
            since = 0
    return out


def unpaused_comma_words(openings: list[tuple[str, bool]], min_count: int = 5) -> list[str]:
    """The one-word openings the teacher paused after less than half the time (seen at least
    ``min_count`` times)."""
    seen, paused = Counter(word for word, _ in openings), Counter(word for word, p in openings if p)
    return sorted(w for w, n in seen.items() if n >= min_count and paused[w] < n / 2)


def train_breaks(data, vocabulary: dict[str, int], text_of) -> tuple[np.ndarray, float]:
    import torch

    size = len(vocabulary) + 1 + 2 * CAP
    rows = [break_features(text_of(w), s, r, vocabulary) for w, s, r, _, _ in data]
    x = torch.zeros(len(rows), size)
    for i, active in enumerate(rows):
        x[i, active] = 1.0
    y = torch.tensor([float(label) for *_, label, _ in data])
    weights = torch.zeros(size, requires_grad=True)
    bias = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.Adam([weights, bias], lr=0.05)
    for _ in range(400):
        optimizer.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(x @ weights + bias, y) + 1e-4 * weights.pow(2).sum()
        loss.backward()
        optimizer.step()
    return weights.detach().numpy(), float(bias.detach())


def train_durations(data, inventory: dict[str, int], hidden: int = 64, epochs: int = 30, seed: int = 0):
    import torch

    torch.manual_seed(seed)
    size = duration_input_size(len(inventory))
    rows, targets = [], []
    for units, frames in data:
        for index, count in enumerate(frames):
            if count > 0:
                rows.append(duration_features(units, index, inventory))
                targets.append(math.log(count))
    width = max(len(r) for r in rows)
    index = torch.tensor([r + [size] * (width - len(r)) for r in rows])  # padding row = zeros
    y = torch.tensor(targets)
    w1 = torch.nn.Parameter(torch.randn(size + 1, hidden) * 0.1)
    b1 = torch.nn.Parameter(torch.zeros(hidden))
    w2 = torch.nn.Parameter(torch.randn(hidden) * 0.1)
    b2 = torch.nn.Parameter(torch.tensor(float(y.mean())))
    optimizer = torch.optim.Adam([w1, b1, w2, b2], lr=3e-3)
    for _ in range(epochs):
        order = torch.randperm(len(y))
        for start in range(0, len(y), 512):
            batch = order[start:start + 512]
            with torch.no_grad():
                w1[size].zero_()
            prediction = torch.relu(w1[index[batch]].sum(1) + b1) @ w2 + b2
            loss = torch.nn.functional.mse_loss(prediction, y[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    with torch.no_grad():
        w1[size].zero_()
    return w1[:size].detach().numpy(), b1.detach().numpy(), w2.detach().numpy(), float(b2.detach())


def main(argv: list[str] | None = None) -> int:
    from collections import Counter

    from audio_pipeline.text.prosody import ProsodyModel

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--teacher", required=True, help="a teacher.py output folder (index.jsonl)")
    parser.add_argument("--lexicon", required=True, help="the run-time lexicon (lexicon.py build)")
    parser.add_argument("--out", required=True, help="prosody.json to write")
    parser.add_argument("--count", type=int, default=8000)
    parser.add_argument("--commas-only", action="store_true",
                        help="only learn which one-word openings run on past their comma, and add them to "
                             "the existing --out (its break and duration models stay as they are); "
                             "a v4 teacher folder's training split learns, its validation split measures")
    args = parser.parse_args(argv)
    phonemizer = Phonemizer(Lexicon.load(args.lexicon))
    records = [json.loads(line) for line in open(Path(args.teacher) / "index.jsonl")][:args.count]
    if args.commas_only:
        return _learn_commas(records, phonemizer, Path(args.out))
    held = max(1, len(records) // 10)
    train, test = records[:-held], records[-held:]

    def collect(subset):
        breaks, durations = [], []
        for record in subset:
            b, d = examples(record, phonemizer)
            breaks += b
            durations.append(d)
        return breaks, durations

    train_breaks_data, train_durations_data = collect(train)
    unpaused = unpaused_comma_words([o for record in train for o in comma_openings(record, phonemizer)])
    test_breaks_data, test_durations_data = collect(test)

    # Words are known by their text: keep the texts of next words that break at all often.
    next_words = Counter()
    for word, _, _, label, text in train_breaks_data:
        next_words[(text[word.start:word.end].lower())] += 1
    vocabulary = {w: i for i, w in enumerate(w for w, n in next_words.most_common(300) if n >= 5)}
    as_text = [(text[w.start:w.end], s, r, label, text) for w, s, r, label, text in train_breaks_data]
    weights, bias = train_breaks(as_text, vocabulary, lambda w: w)
    inventory_counts = Counter(u.name for units, _ in train_durations_data for u in units)
    inventory = {name: i for i, name in enumerate(sorted(inventory_counts))}
    w1, b1, w2, b2 = train_durations(train_durations_data, inventory)
    model_data = {"break_words": list(vocabulary), "break_weights": weights.tolist(), "break_bias": bias,
                  "inventory": list(inventory), "w1": w1.round(5).tolist(), "b1": b1.round(5).tolist(),
                  "w2": w2.round(5).tolist(), "b2": round(b2, 5), "comma_unpaused_words": unpaused}
    Path(args.out).write_text(json.dumps(model_data))
    model = ProsodyModel(model_data)

    # Held-out figures.
    truth = [label for *_, label, _ in test_breaks_data]
    guess = [model.is_break(text[w.start:w.end], s, r) for w, s, r, _, text in test_breaks_data]
    hits = sum(g and t for g, t in zip(guess, truth))
    precision = hits / max(sum(guess), 1)
    recall = hits / max(sum(truth), 1)
    accuracy = sum(g == t for g, t in zip(guess, truth)) / max(len(truth), 1)
    means: dict[str, list[int]] = {}
    for units, frames in train_durations_data:
        for u, f in zip(units, frames):
            means.setdefault(u.name, []).append(f)
    mean_of = {k: float(np.mean(v)) for k, v in means.items()}
    errors, baseline = [], []
    for units, frames in test_durations_data:
        predicted = model.frames(units)
        for u, f, p in zip(units, frames, predicted):
            errors.append(p - f)
            baseline.append(mean_of.get(u.name, 5.0) - f)
    rmse = float(np.sqrt(np.mean(np.square(errors))))
    base_rmse = float(np.sqrt(np.mean(np.square(baseline))))
    print(f"trained on {len(train)} utterances, held out {len(test)}; {len(inventory)} units, "
          f"{len(vocabulary)} break words -> {args.out}")
    print(f"phrase breaks (held out, {len(truth)} word boundaries without punctuation, {sum(truth)} breaks): "
          f"accuracy {100 * accuracy:.1f} %, precision {100 * precision:.1f} %, recall {100 * recall:.1f} %")
    print(f"durations (held out, {len(errors)} units): RMSE {rmse:.2f} frames ({20 * rmse:.0f} ms), "
          f"mean absolute {np.mean(np.abs(errors)):.2f} frames; each unit's mean duration: RMSE {base_rmse:.2f} frames")
    return 0


def _learn_commas(records: list[dict], phonemizer: Phonemizer, out: Path) -> int:
    from audio_pipeline.text.prosody import ProsodyModel

    by_split = {"train": [], "validation": []}
    for record in records:
        if record.get("split") in by_split:
            by_split[record["split"]] += comma_openings(record, phonemizer)
    if not by_split["train"]:
        raise SystemExit(f"no training-split utterances among {len(records)} (a v4 teacher folder is needed)")
    words = unpaused_comma_words(by_split["train"])
    data = json.loads(out.read_text())
    data["comma_unpaused_words"] = words
    out.write_text(json.dumps(data))
    model = ProsodyModel(data)
    held = by_split["validation"]
    always = sum(paused for _, paused in held)
    learned = sum(model.pauses_at_comma(word, 1) == paused for word, paused in held)
    print(f"one-word openings before a comma: {len(by_split['train'])} in training, runs on after {words} -> {out}")
    print(f"validation ({len(held)} such commas): the teacher's pause placed right {learned}/{len(held)}, "
          f"against {always}/{len(held)} pausing at every comma")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
