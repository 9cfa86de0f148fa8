"""Trains the built-in voice's speech-token LM (a small Llama) on the aligned dataset.

The token layout is the engine's ``phoneme-lpc`` layout (``--layout phoneme-lpc-frame``: one
position per frame with a depth head, recipes/builtin_voice/frame_training.py) (audio_pipeline/layouts/phoneme_lpc.py):
prompt ``[phoneme, duration]`` per phoneme, then per frame ``[phoneme, context, envelope,
prosody]``. The engine forces each frame's phoneme and context tokens (and the end of speech) from
the prompt, so the loss covers the envelope and prosody tokens only: the model learns the acoustics
of a frame given its phoneme, the next phoneme, how many frames are left, and its own history.

    python -m recipes.builtin_voice.train --data data/train.npz --out runs/voice --steps 6000
    python -m recipes.builtin_voice.train ... --resume          # continue from runs/voice/checkpoint.pt

Runs on CPU (the recipe's target: 2 cores) or CUDA (``--device cuda``, bf16 autocast).
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

from audio_pipeline.layouts.phoneme_lpc import (BEGIN, CODEBOOK_SIZE, END_OF_SPEECH, ENVELOPE, PAD, PHONEME_BASE,
                                              PROSODY, SLOT_BASE, TOKENS_PER_FRAME, VOCAB_SIZE, frame_tokens,
                                              prompt_ids, slot_token)


def sequence(phonemes: np.ndarray, durations: np.ndarray, codes: np.ndarray) -> tuple[list[int], int]:
    """(token ids, length of the prompt) of one utterance; the loss covers what follows the prompt."""
    pairs = [(PHONEME_BASE + int(p), int(d)) for p, d in zip(phonemes, durations)]
    prompt = prompt_ids(pairs)
    return prompt + frame_tokens(pairs, codes.tolist()), len(prompt)


def model_config(**overrides) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB_SIZE,
            "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 4, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
            "rope_theta": 100000.0, "tie_word_embeddings": True, "bos_token_id": BEGIN,
            "eos_token_id": END_OF_SPEECH, "pad_token_id": PAD, "hidden_act": "silu", **overrides}


def recode(model, codec: Path, init_codec: Path) -> None:
    """Reorders the (tied) embedding's envelope and prosody rows so that each code of ``codec``
    starts as its nearest code of ``init_codec`` (mcep_codec.Quantizer.translation): input,
    output and depth readout at once, since all three are these rows."""
    from recipes.builtin_voice.mcep_codec import Quantizer

    maps = Quantizer.load(codec).translation(Quantizer.load(init_codec))
    weight = model.get_input_embeddings().weight
    with torch.no_grad():
        for slot, mapping in zip((ENVELOPE, PROSODY), maps):
            if len(mapping) > CODEBOOK_SIZE or mapping.max() >= CODEBOOK_SIZE:
                raise SystemExit(f"--codec {codec}: more than the layout's {CODEBOOK_SIZE} codes in a slot")
            rows = weight[slot_token(slot, 0):slot_token(slot, 0) + len(mapping)]
            rows.copy_(rows[torch.from_numpy(mapping)].clone())
    print(f"recoded from {init_codec} to {codec}: {len(set(maps[0].tolist()))} envelope and "
          f"{len(set(maps[1].tolist()))} prosody rows of the old codec start the new one's", flush=True)


def make_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches, current, longest = [], [], 0
    for i in order:
        length = lengths[i]
        if current and max(longest, length) * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, length)
    if current:
        batches.append(current)
    return batches


def corrupt(ids: torch.Tensor, prompt_lengths: list[int], probability: float, generator: torch.Generator) -> None:
    """Replaces a ``probability`` fraction of the envelope and prosody input tokens with random codes
    of their slot (the labels keep the true ones), in place. Like the dropout in Tacotron's pre-net:
    a model that cannot trust its own history leans on the phonemes, and does not drift when its
    own sampled frames differ from eSpeak's."""
    if probability <= 0:
        return
    positions = torch.arange(ids.shape[1])
    for row, prompt in enumerate(prompt_lengths):
        slot = (positions - prompt) % TOKENS_PER_FRAME
        acoustic = (positions >= prompt) & (slot >= 2) & (ids[row] != PAD)
        hit = acoustic & (torch.rand(ids.shape[1], generator=generator) < probability)
        random_codes = torch.randint(0, CODEBOOK_SIZE, (ids.shape[1],), generator=generator)
        ids[row] = torch.where(hit, SLOT_BASE + slot * CODEBOOK_SIZE + random_codes, ids[row])


def collate(examples: list[tuple[list[int], int]], members: list[int]) -> tuple[torch.Tensor, ...]:
    width = max(len(examples[i][0]) for i in members)
    ids = torch.full((len(members), width), PAD)
    labels = torch.full((len(members), width), -100)
    mask = torch.zeros((len(members), width), dtype=torch.long)
    for row, i in enumerate(members):
        tokens, prompt = examples[i]
        ids[row, :len(tokens)] = torch.tensor(tokens)
        labels[row, prompt:len(tokens)] = torch.tensor(tokens[prompt:])
        mask[row, :len(tokens)] = 1
    return ids, labels, mask


def slot_loss(model, ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor,
              prompt_lengths: list[int]) -> tuple[torch.Tensor, dict[str, float]]:
    """Cross-entropy of every envelope and prosody token over its own frame slot's ids, which is
    exactly the choice the engine's sampler makes (the phoneme and context tokens, and the end of
    speech, are forced by the engine, so they need no loss); and accuracy per slot. Cheaper than
    the full-vocabulary softmax, and no logits for prompt positions."""
    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, T, H]
    weight = model.get_output_embeddings().weight
    total = hidden.new_zeros(())
    count = 0
    accuracy = {}
    width = ids.shape[1]
    for slot, name in ((ENVELOPE, "envelope"), (PROSODY, "prosody")):
        rows, cols = [], []
        for row, prompt in enumerate(prompt_lengths):
            targets = torch.arange(prompt + slot, width, TOKENS_PER_FRAME)
            rows.append(torch.full_like(targets, row))
            cols.append(targets)
        rows, cols = torch.cat(rows).to(ids.device), torch.cat(cols).to(ids.device)
        target = labels[rows, cols]
        keep = target != -100
        rows, cols, target = rows[keep], cols[keep], target[keep]
        start = slot_token(slot, 0)
        logits = hidden[rows, cols - 1] @ weight[start:start + CODEBOOK_SIZE].T
        local = target - start
        total = total + torch.nn.functional.cross_entropy(logits.float(), local, reduction="sum")
        count += len(local)
        accuracy[name] = float((logits.argmax(-1) == local).float().mean()) if len(local) else 0.0
    return total / max(count, 1), accuracy


def main(argv: list[str] | None = None) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    from recipes.builtin_voice.dataset import load

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=6000, help="optimizer steps (the schedule's length)")
    parser.add_argument("--minutes", type=float, default=0,
                        help="time budget: the schedule ends at --steps or after this long, whichever is first")
    parser.add_argument("--batch-tokens", type=int, default=12000, help="padded tokens per batch")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--max-length", type=int, default=1200, help="leave out longer sequences (0: keep all)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=192)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's choice)")
    parser.add_argument("--save-every", type=int, default=250, help="checkpoint every N steps (for --resume)")
    parser.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    parser.add_argument("--init-from", type=Path, help="start from this run's checkpoint.pt weights, or an exported model directory's "
                             "model.safetensors (fresh optimizer; tensors it lacks keep their initialisation)")
    parser.add_argument("--init-codec", type=Path,
                        help="with --init-from and --codec: the codec (a decoder directory) the --init-from model "
                             "speaks; its envelope and prosody rows are reordered so that each code of --codec starts "
                             "from its nearest code's (a student of a new codec that keeps what the old one learned)")
    parser.add_argument("--codec", type=Path, help="the codec (a decoder directory) of --data's codes (for --init-codec)")
    parser.add_argument("--corrupt", type=float, default=0.3,
                        help="fraction of envelope/prosody input tokens replaced by random codes")
    parser.add_argument("--layout", default="phoneme-lpc", choices=["phoneme-lpc", "phoneme-lpc-frame"],
                        help="phoneme-lpc: four positions per frame; phoneme-lpc-frame: one, with a depth head "
                             "(recipes/builtin_voice/frame_training.py)")
    parser.add_argument("--save-dtype", default="float16", choices=["float16", "float32"],
                        help="dtype of the saved model.safetensors")
    parser.add_argument("--fold-prompt", action="store_true",
                        help="with --layout phoneme-lpc-frame: one prompt position per phoneme (its id stands for the "
                             "phoneme and its duration; layout_options.prompt folded), half the prompt")
    parser.add_argument("--validation", type=Path,
                        help="a validation dataset (teacher_dataset.py --split validation): its loss (no corrupted "
                             "inputs) is logged every --validate-every steps and the best step's weights kept in "
                             "OUT/best.pt (export.py --checkpoint best.pt)")
    parser.add_argument("--validate-every", type=int, default=100)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    device = torch.device(args.device)
    data = load(args.data)
    frame_task = None
    if args.layout == "phoneme-lpc-frame":
        from recipes.builtin_voice import frame_training as frame_task

        examples = frame_task.examples(data, folded=args.fold_prompt)
        lengths = [len(e) for e in examples]
    else:
        examples = [sequence(p, d, c) for p, d, c in zip(data["phonemes"], data["durations"], data["codes"])]
        lengths = [len(t) for t, _ in examples]
    if args.max_length:
        kept = [i for i, n in enumerate(lengths) if n <= args.max_length]
        examples, lengths = [examples[i] for i in kept], [lengths[i] for i in kept]
    batches = make_batches(lengths, args.batch_tokens)
    tokens = sum(lengths)
    validation = None
    if args.validation:
        held = load(args.validation)
        if frame_task:
            v_examples = frame_task.examples(held, folded=args.fold_prompt)
            v_lengths = [len(e) for e in v_examples]
        else:
            v_examples = [sequence(p, d, c) for p, d, c in zip(held["phonemes"], held["durations"], held["codes"])]
            v_lengths = [len(t) for t, _ in v_examples]
        validation = (v_examples, make_batches(v_lengths, args.batch_tokens))

    config = LlamaConfig(**model_config(num_hidden_layers=args.layers, hidden_size=args.hidden,
                                        intermediate_size=3 * args.hidden, num_attention_heads=args.heads,
                                        num_key_value_heads=args.heads,
                                        **(frame_task.config_extra(args.hidden, folded=args.fold_prompt)
                                           if frame_task else {})))
    model = LlamaForCausalLM(config)
    if frame_task:
        frame_task.extend(model, config)
    model.to(device)
    embedding = model.get_input_embeddings().weight
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and p is not embedding]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or p is embedding]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.98))
    step = 0
    checkpoint_path = args.out / "checkpoint.pt"
    if args.init_from and (args.init_from / "checkpoint.pt").is_file():
        model.load_state_dict(torch.load(args.init_from / "checkpoint.pt", map_location=device,
                                         weights_only=False)["model"])
        print(f"initialised from {args.init_from}", flush=True)
    elif args.init_from:  # an exported model directory (e.g. the shipped voice for a frame-layout run)
        from safetensors.torch import load_file

        state = {k: v.float() for k, v in load_file(args.init_from / "model.safetensors").items()}
        missing, unexpected = model.load_state_dict(state, strict=False)
        model.tie_weights()
        if unexpected:
            raise SystemExit(f"--init-from {args.init_from}: tensors this model lacks: {unexpected}")
        print(f"initialised from {args.init_from}; new: {sorted({k.split('.')[0] for k in missing} - {'lm_head'})}",
              flush=True)
    if args.init_codec:
        if not (args.init_from and args.codec):
            raise SystemExit("--init-codec needs --init-from (the model that speaks it) and --codec (the data's codec)")
        recode(model, args.codec, args.init_codec)
    noise = torch.Generator().manual_seed(args.seed + 1)
    trained_seconds = 0.0
    if args.resume and checkpoint_path.is_file():
        state = torch.load(checkpoint_path, map_location=device, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, rng = state["step"], state["rng"]
        torch.set_rng_state(state["torch_rng"])
        trained_seconds = state.get("seconds", 0.0)
        print(f"resumed at step {step} ({trained_seconds / 60:.1f} minutes trained)", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "train_args.json").write_text(json.dumps({k: str(v) for k, v in vars(args).items()}, indent=2))
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, {len(examples)} utterances, "
          f"{tokens / 1e6:.1f}M tokens, {len(batches)} batches per epoch, device {device}", flush=True)

    def save(final: bool) -> None:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "rng": rng,
                    "torch_rng": torch.get_rng_state(), "seconds": time.time() - started}, checkpoint_path)
        if final:
            dtype = getattr(torch, args.save_dtype)  # the head is tied to the embedding: stored once
            model.save_pretrained(args.out, safe_serialization=True, state_dict={
                k: v.to(dtype).cpu() for k, v in model.state_dict().items() if k != "lm_head.weight"})
            np.save(args.out / "envelope_codebook.npy", data["centroids"])
            (args.out / "phonemes.json").write_text(json.dumps(data["inventory"]))

    best_path = args.out / "best.pt"
    best = torch.load(best_path, map_location="cpu", weights_only=False)["validation_loss"] \
        if args.resume and best_path.is_file() else math.inf

    def validate() -> float:
        """Token-weighted mean loss over the validation set, teacher-forced with clean inputs."""
        v_examples, v_batches = validation
        model.eval()
        total = weight = 0.0
        with torch.no_grad():
            for members in v_batches:
                if frame_task:
                    tensors = [t.to(device) for t in frame_task.batch(v_examples, members, 0.0, None)]
                    loss, _ = frame_task.loss(model, tensors)
                    n = float((tensors[3] >= 0).sum())
                else:
                    ids, labels, mask = collate(v_examples, members)
                    loss, _ = slot_loss(model, ids.to(device), labels.to(device), mask.to(device),
                                        [v_examples[i][1] for i in members])
                    n = float(mask.sum())
                total, weight = total + float(loss) * n, weight + n
        model.train()
        return total / max(weight, 1.0)

    # A resumed run's time budget counts the minutes trained before (the checkpoint's), so its
    # learning-rate schedule goes on where it stopped.
    started = time.time() - trained_seconds
    model.train()
    losses: list[float] = []
    queue: list[list[int]] = []
    while True:
        # With a time budget the schedule runs on whichever ends first, steps or minutes, so the
        # learning rate has always decayed by the end.
        progress = step / args.steps
        if args.minutes:
            progress = max(progress, (time.time() - started) / (args.minutes * 60))
        if progress >= 1:
            break
        if not queue:
            queue = batches[:]
            rng.shuffle(queue)
        members = queue.pop()
        if frame_task:
            tensors = [t.to(device) for t in frame_task.batch(examples, members, args.corrupt, noise)]
        else:
            ids, labels, mask = collate(examples, members)
            corrupt(ids, [examples[i][1] for i in members], args.corrupt, noise)
            ids, labels, mask = ids.to(device), labels.to(device), mask.to(device)
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in optimizer.param_groups:
            group["lr"] = lr
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            if frame_task:
                loss, accuracy = frame_task.loss(model, tensors)
            else:
                loss, accuracy = slot_loss(model, ids, labels, mask, [examples[i][1] for i in members])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        step += 1
        if step % 25 == 0:
            print(f"step {step}  {(time.time() - started) / 60:.1f} min  loss {np.mean(losses[-25:]):.3f}  "
                  f"lr {lr:.2e}  acc " + " ".join(f"{k} {v:.3f}" for k, v in accuracy.items()), flush=True)
        if args.save_every and step % args.save_every == 0:
            save(final=False)
        if validation and step % args.validate_every == 0:
            value = validate()
            print(f"step {step}  validation loss {value:.4f}" + ("  (best)" if value < best else ""), flush=True)
            if value < best:
                best = value
                torch.save({"model": model.state_dict(), "step": step, "validation_loss": value}, best_path)
    save(final=True)
    print(f"saved {args.out} at step {step}, loss {np.mean(losses[-50:]) if losses else float('nan'):.3f}, "
          f"{(time.time() - started) / 60:.1f} min", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
