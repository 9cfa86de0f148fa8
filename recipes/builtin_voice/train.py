"""Trains the built-in voice's speech-token LM (a small Llama) on the aligned dataset.

Token layout (ids):
    0 PAD, 1 BOS, 2 END_OF_SPEECH, 3 START_OF_SPEECH,
    4 + p            phoneme p of the inventory (prompt tokens and frame markers),
    ENV + c          envelope code c (1024), F0 + c (64: 0 = unvoiced), GAIN + c (32).
Sequence: BOS, the utterance's phonemes, START_OF_SPEECH, then per frame
``[marker of the phoneme sounding, envelope, f0, gain]``, then END_OF_SPEECH. The markers are given
(forced at inference from the front-end's phoneme durations), so the loss covers the three acoustic
tokens only: the model learns acoustics given the current phoneme and the history.

    python -m recipes.builtin_voice.train --data data/train.npz --out runs/voice --minutes 40
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import numpy as np
import torch

PAD, BOS, END_OF_SPEECH, START_OF_SPEECH = 0, 1, 2, 3
PHONEME = 4
MAX_PHONEMES = 128
ENV = PHONEME + MAX_PHONEMES
F0 = ENV + 1024
GAIN = F0 + 64
VOCAB = 1280
TOKENS_PER_FRAME = 4


def sequence(phonemes: np.ndarray, frame_phoneme: np.ndarray, codes: np.ndarray) -> tuple[list[int], list[int]]:
    """(token ids, labels) of one utterance; labels are -100 where no loss is taken."""
    tokens = [BOS, *(PHONEME + int(p) for p in phonemes), START_OF_SPEECH]
    labels = [-100] * len(tokens)
    for index, (env, f0, gain) in zip(frame_phoneme, codes):
        frame = [PHONEME + int(phonemes[index]), ENV + int(env), F0 + int(f0), GAIN + int(gain)]
        tokens += frame
        labels += [-100, *frame[1:]]
    tokens.append(END_OF_SPEECH)
    labels.append(-100)
    return tokens, labels


def model_config(**overrides) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
            "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 4, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "tie_word_embeddings": True, "bos_token_id": BOS, "eos_token_id": END_OF_SPEECH,
            "pad_token_id": PAD, "hidden_act": "silu", **overrides}


def main(argv: list[str] | None = None) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    from recipes.builtin_voice.dataset import load

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--minutes", type=float, default=40.0, help="training time budget")
    parser.add_argument("--batch-tokens", type=int, default=6000)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    data = load(args.data)
    if len(data["inventory"]) > MAX_PHONEMES:
        raise SystemExit(f"{len(data['inventory'])} phonemes, more than the layout's {MAX_PHONEMES}")
    examples = [sequence(p, fp, c) for p, fp, c in zip(data["phonemes"], data["frame_phoneme"], data["codes"])]
    examples.sort(key=lambda e: len(e[0]))
    batches, current, longest = [], [], 0
    for example in examples:
        longest = max(longest, len(example[0]))
        if current and longest * (len(current) + 1) > args.batch_tokens:
            batches.append(current)
            current, longest = [], len(example[0])
        current.append(example)
    batches.append(current)

    config = LlamaConfig(**model_config())
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    budget = args.minutes * 60
    started = time.time()
    step, warmup = 0, 100
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {len(examples)} utterances, "
          f"{len(batches)} batches per epoch", flush=True)
    model.train()
    losses: list[float] = []
    while time.time() - started < budget:
        random.shuffle(batches)
        for batch in batches:
            elapsed = time.time() - started
            if elapsed >= budget:
                break
            width = max(len(t) for t, _ in batch)
            ids = torch.full((len(batch), width), PAD)
            labels = torch.full((len(batch), width), -100)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, (t, l) in enumerate(batch):
                ids[row, :len(t)] = torch.tensor(t)
                labels[row, :len(l)] = torch.tensor(l)
                mask[row, :len(t)] = 1
            progress = min(1.0, elapsed / budget)
            lr = args.lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * progress))
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            losses.append(loss.item())
            step += 1
            if step % 25 == 0:
                print(f"step {step}  {elapsed / 60:.1f} min  loss {np.mean(losses[-25:]):.3f}  lr {lr:.2e}",
                      flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    np.save(args.out / "envelope_codebook.npy", data["centroids"])
    from audio_pipeline.decoders.lpc import save_lpc_decoder

    save_lpc_decoder(args.out / "lpc", data["centroids"])  # the codec, as the engine loads it
    (args.out / "phonemes.json").write_text(json.dumps(list(map(str, data["inventory"]))))
    print(f"saved {args.out} after {step} steps, final loss {np.mean(losses[-25:]):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
