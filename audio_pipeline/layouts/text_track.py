"""A request's text track, as a layout builds it: a text token per position beside the token ids,
and raw input vectors (Qwen3-TTS: its text, and a cloned voice's speaker embedding). The model
runner stages it (core/tracks.py)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class TextTrack:
    """A request's text track: one id per prompt position (-1: none), the ids its generated
    positions add in order (then ``pad``), and raw input vectors by prompt position."""

    prompt: list[int]
    generated: list[int]
    pad: int
    vectors: dict[int, torch.Tensor] = field(default_factory=dict)

    def ids(self, start: int, end: int) -> list[int]:
        """The text ids of positions [start, end) (prompt, then generated)."""
        split = len(self.prompt)
        out = self.prompt[start:min(end, split)]
        for position in range(max(start, split), end):
            index = position - split
            out.append(self.generated[index] if index < len(self.generated) else self.pad)
        return out

    def cache_key(self, position: int, key: Any) -> Any:
        """What the prefix cache compares for ``position`` whose own key is ``key``: the text id
        too, and a vector's digest in place of its absent id (two voices never share a position)."""
        vector = self.vectors.get(position)
        if vector is not None:
            key = ("vector", hashlib.sha1(vector.float().numpy().tobytes()).hexdigest())
        return (key, self.ids(position, position + 1)[0])
