"""Training pieces for the phoneme-lpc-frame layout (audio_pipeline/layouts/phoneme_lpc_frame.py):
one position per frame, the backbone predicting the envelope code and the depth head the prosody
code given the envelope (audio_pipeline/models/frame_head.py, the very modules the engine runs).

A sequence is the phoneme-lpc prompt, then one position per frame whose token is the frame's
envelope id and whose frame columns hold its prosody code and the next frame's phoneme and context
(the start of speech holds frame 0's). The output of position t predicts frame t + 1 - P (P: the
prompt's length): its envelope over the envelope ids, and with the true envelope, its prosody.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from audio_pipeline.layouts.phoneme_lpc import (CODEBOOK_SIZE, CONTEXT, ENVELOPE, PAD, PHONEME, PHONEME_BASE,
                                              PROSODY, alignment_tokens, prompt_ids, slot_token)
from audio_pipeline.layouts.phoneme_lpc_frame import COLUMNS, frame_head_config
from audio_pipeline.layouts.phoneme_lpc import fold_config
from audio_pipeline.models.frame_head import DepthHead, FrameHeadConfig, frame_embeddings, token_embeddings


@dataclass
class FrameExample:
    ids: np.ndarray       # [T] token ids: the prompt, then each frame's envelope id
    frames: np.ndarray    # [T, 4] frame columns (-1: none)
    envelope: np.ndarray  # [T] the envelope code the position's output predicts (-1: none)
    prosody: np.ndarray   # [T] likewise the prosody code
    prompt: int

    def __len__(self) -> int:
        return len(self.ids)


def example(phonemes: np.ndarray, durations: np.ndarray, codes: np.ndarray, folded: bool = False) -> FrameExample:
    """One utterance (codes: [frames, 2] envelope and prosody codes); ``folded``: the prompt has one
    position per phoneme (layout_options.prompt folded)."""
    pairs = [(PHONEME_BASE + int(p), int(d)) for p, d in zip(phonemes, durations)]
    prompt = prompt_ids(pairs, folded=folded)
    alignment = alignment_tokens(pairs)
    count, length = len(alignment), len(prompt)
    if len(codes) != count:
        raise ValueError(f"{len(codes)} frames of codes for a {count}-frame alignment")
    codes = np.asarray(codes, dtype=np.int64)
    ids = np.concatenate([np.array(prompt), slot_token(ENVELOPE, 0) + codes[:, 0]])
    frames = np.full((length + count, COLUMNS), -1, dtype=np.int64)
    aligned = np.array(alignment, dtype=np.int64) - np.array([slot_token(PHONEME, 0), slot_token(CONTEXT, 0)])
    frames[length - 1:length + count - 1, [PHONEME, CONTEXT]] = aligned  # each position: the next frame's
    frames[length:, ENVELOPE] = codes[:, 0]
    frames[length:, PROSODY] = codes[:, 1]
    envelope = np.full(length + count, -1, dtype=np.int64)
    prosody = envelope.copy()
    envelope[length - 1:length + count - 1] = codes[:, 0]
    prosody[length - 1:length + count - 1] = codes[:, 1]
    return FrameExample(ids, frames, envelope, prosody, length)


def examples(data: dict, folded: bool = False) -> list[FrameExample]:
    return [example(p, d, c, folded) for p, d, c in zip(data["phonemes"], data["durations"], data["codes"])]


def config_extra(hidden: int, folded: bool = False) -> dict:
    head = {**frame_head_config(), "num_layers": 2, "intermediate_size": 2 * hidden}
    if folded:
        head["fold"] = fold_config()
    return {"frame_head": head}


def extend(model, config) -> None:
    """Adds the depth head (``depth.*``) to a transformers LlamaForCausalLM."""
    model.add_module("depth", DepthHead(config.hidden_size, FrameHeadConfig.of(config), config.rms_norm_eps))


def batch(items: list[FrameExample], members: list[int], corrupt: float, generator: torch.Generator):
    """(ids, frames, mask, envelope, prosody) tensors; a ``corrupt`` fraction of the envelope and
    prosody inputs replaced by random codes (the targets keep the true ones)."""
    width = max(len(items[i]) for i in members)
    ids = torch.full((len(members), width), PAD)
    frames = torch.full((len(members), width, COLUMNS), -1)
    mask = torch.zeros((len(members), width), dtype=torch.long)
    envelope = torch.full((len(members), width), -1)
    prosody = envelope.clone()
    for row, i in enumerate(members):
        item, n = items[i], len(items[i])
        ids[row, :n] = torch.from_numpy(item.ids)
        frames[row, :n] = torch.from_numpy(item.frames)
        mask[row, :n] = 1
        envelope[row, :n] = torch.from_numpy(item.envelope)
        prosody[row, :n] = torch.from_numpy(item.prosody)
        if corrupt > 0:
            speech = torch.arange(width) >= item.prompt
            speech[n:] = False
            for column, is_token in ((ENVELOPE, True), (PROSODY, False)):
                hit = speech & (torch.rand(width, generator=generator) < corrupt)
                noise = torch.randint(0, CODEBOOK_SIZE, (width,), generator=generator)
                if is_token:
                    ids[row] = torch.where(hit, slot_token(ENVELOPE, 0) + noise, ids[row])
                else:
                    frames[row, :, column] = torch.where(hit, noise, frames[row, :, column])
    return ids, frames, mask, envelope, prosody


def loss(model, tensors) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean cross-entropy of the envelope (backbone, over the envelope ids) and prosody (depth head,
    given the true envelope) codes; accuracy of each."""
    ids, frames, mask, envelope, prosody = tensors
    embedding = model.model.embed_tokens
    head = model.depth.head
    inputs = token_embeddings(embedding, ids, head) + frame_embeddings(embedding, frames, head)
    hidden = model.model(inputs_embeds=inputs, attention_mask=mask).last_hidden_state
    keep = envelope >= 0
    states, env, pros = hidden[keep], envelope[keep], prosody[keep]
    start = head.code_offsets[head.token_column]
    env_logits = (states @ embedding.weight[start:start + head.codebook_size].T).float()
    pros_logits = model.depth(states, env, embedding).float()
    ce = torch.nn.functional.cross_entropy
    total = (ce(env_logits, env) + ce(pros_logits, pros)) / 2
    accuracy = {"envelope": float((env_logits.argmax(-1) == env).float().mean()),
                "prosody": float((pros_logits.argmax(-1) == pros).float().mean())}
    return total, accuracy
