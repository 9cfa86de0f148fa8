"""A dense, one-batch generation loop over the Kyutai TTS model (models/kyutai_tts.py) and its text
state machine (layouts/dsm_text.py), for checking those parts against the reference's fixtures
step by step: the engine's paged path is checked against the same fixtures elsewhere.

What a generation is (the reference's ``TTSModel.generate``, in our words): at step t every row's
input is the text id fed back and the codes generated at step t - 1, except that a stream whose
delay d is at least t reads its start id instead; the backbone samples a text id; the state machine
turns it into the id fed back; the depth transformer (from the audio delay on) samples the frame's
codes, and a codebook whose delay plus the audio delay is beyond t is zeroed. Guidance without a
distilled condition doubles the rows: the null half has no conditions and reads no text (its text
logits are not used; its depth logits guide the codes). Generation stops ``final_padding`` steps
after every row's end plus the audio delay.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from audio_pipeline.layouts.dsm_text import PAD, TextMachine, Word
from audio_pipeline.models.kyutai_tts import ZERO, DsmModel, cross_attend


@dataclass
class DenseResult:
    frames: torch.Tensor                 # [frames, B, 1 + codebooks], the acoustic delay undone
    text_tokens: list[list[tuple[int, int]]]
    end_steps: list[int | None]
    consumed_at: list[list[int]]
    transcripts: list[list[tuple[str, int]]]
    text_logits: list[torch.Tensor] = field(default_factory=list)   # per step [B, text_card]
    depth_logits: list[torch.Tensor] = field(default_factory=list)  # per depth step [codebooks, B, card]
    depth_steps: list[int] = field(default_factory=list)


class DenseCache:
    """Every row's keys and values, all rows at the same step (one token each)."""

    def __init__(self, layers: int, context: int | None):
        self.keys: list[torch.Tensor | None] = [None] * layers
        self.values: list[torch.Tensor | None] = [None] * layers
        self.context = context

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k, v = k[:, :, None], v[:, :, None]  # [rows, heads, 1, D]
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        if self.context is not None:  # the window: this position and the context - 1 before it
            k, v = k[:, :, -self.context:], v[:, :, -self.context:]
        self.keys[layer], self.values[layer] = k, v
        if k.shape[1] != q.shape[1]:
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        return F.scaled_dot_product_attention(q[:, :, None], k, v)[:, :, 0]


def generate_dense(model: DsmModel, words: list[list[Word]], speakers: list[list[torch.Tensor]], *, cfg_coef: float,
                   codebooks: int | None = None, padding_bonus: float = 0.0, max_padding: int = 8,
                   initial_padding: int = 2, final_padding: int = 4, max_steps: int = 2000,
                   keep_text_logits: int = 0, keep_depth_logits: int = 0) -> DenseResult:
    """Greedy generation of a batch: ``words[i]`` read in ``speakers[i]``'s voices (each [dim, frames];
    a dialogue's main speaker first)."""
    config = model.config
    count = codebooks or config.n_q
    batch = len(words)
    doubled = not config.distilled_guidance and cfg_coef != 1.0
    rows = 2 * batch if doubled else batch
    machine = TextMachine(config.text_card, config.second_stream_ahead, max_padding, initial_padding)
    states = [machine.new_state(item) for item in words]
    values = {"control": "ok"}
    if config.distilled_guidance:
        values["cfg"] = format(cfg_coef, ".1f")
    sums = [model.condition_sum(values)] * batch
    sources = [model.cross_source(voices) for voices in speakers]
    if doubled:
        sums += [model.condition_sum({})] * batch
        sources += [model.cross_source([], voices[0].shape[-1]) for voices in speakers]
    condition = torch.stack(sums)
    per_row = [model.cross_keys_values(source) for source in sources]

    def cross(layer: int, q: torch.Tensor) -> torch.Tensor:  # row r attends to its own source
        return torch.cat([cross_attend(q[r:r + 1], *per_row[r][layer]) for r in range(q.shape[0])])

    cache = DenseCache(config.num_layers, config.context)
    delays = config.delays
    delay_steps = config.audio_delay_steps
    text_fed = torch.full((batch,), PAD, dtype=torch.long)
    codes = torch.full((batch, config.n_q), ZERO, dtype=torch.long)
    history: list[tuple[torch.Tensor, torch.Tensor]] = []
    result = DenseResult(torch.empty(0), [[] for _ in range(batch)], [], [], [])
    for step in range(max_steps):
        ends = [state.end_step for state in states]
        if all(end is not None for end in ends) and step >= max(ends) + delay_steps + final_padding:
            break
        text_in = text_fed.clone() if step > delays[0] else torch.full((batch,), config.text_card)
        codes_in = codes.clone()
        for k in range(config.n_q):
            if step <= delays[k + 1]:
                codes_in[:, k] = config.card
        if doubled:  # the null half reads no text (beyond the start id)
            null_text = text_in.clone() if step <= delays[0] else torch.full((batch,), ZERO)
            text_in = torch.cat([text_in, null_text])
            codes_in = torch.cat([codes_in, codes_in])
        hidden = model(text_in, codes_in, condition, torch.full((rows,), step), cache.attend, cross)
        logits = model.text_logits(hidden)[:batch]
        if padding_bonus:
            logits[:, PAD] += padding_bonus
        if step < keep_text_logits:
            result.text_logits.append(logits.clone())
        sampled = logits.argmax(-1).tolist()
        fed = []
        for index, (state, token) in enumerate(zip(states, sampled)):
            fed.append(machine.step(step, state, token))
            result.text_tokens[index].append((token, fed[-1]))
        text_fed = torch.tensor(fed)
        if step < delay_steps:
            codes = torch.full((batch, config.n_q), ZERO, dtype=torch.long)
        else:
            kept: list[torch.Tensor] = []

            def choose(k: int, depth_logits: torch.Tensor) -> torch.Tensor:
                if doubled:
                    conditional, null = depth_logits[:batch], depth_logits[batch:]
                    depth_logits = null + (conditional - null) * cfg_coef
                kept.append(depth_logits)
                picked = depth_logits.argmax(-1)
                return torch.cat([picked, picked]) if doubled else picked

            fed_rows = torch.cat([text_fed, text_fed]) if doubled else text_fed
            frame = model.depth_frame(hidden, fed_rows, choose, count)[:batch]
            if len(result.depth_steps) < keep_depth_logits:
                result.depth_steps.append(step)
                result.depth_logits.append(torch.stack(kept))
            codes = torch.full((batch, config.n_q), ZERO, dtype=torch.long)
            codes[:, :count] = frame
            for k in range(count):
                if step < delays[k + 1] + delay_steps:
                    codes[:, k] = ZERO
        history.append((text_fed, codes))
    most = max(delays[:count + 1])
    frames = []
    for index in range(len(history) - most):
        row = [history[index][0]] + [history[index + delays[k + 1]][1][:, k] for k in range(count)]
        frames.append(torch.stack(row, dim=1))
    result.frames = torch.stack(frames)
    result.end_steps = [state.end_step for state in states]
    result.consumed_at = [state.consumed_at for state in states]
    result.transcripts = [state.transcript for state in states]
    return result
