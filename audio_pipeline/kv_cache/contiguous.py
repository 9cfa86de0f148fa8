"""A KV cache of one growing contiguous buffer per sequence, with a token budget across sequences.

Admission reserves a request's worst case (prompt + token budget) up front, so a running request
can never run out of cache; requests wait in the queue until their reservation fits.
"""

from __future__ import annotations

import torch

from audio_pipeline.interfaces import KVCacheParams


class SequenceKVCache:
    """Keys and values of one sequence for every layer; capacity doubles as it grows."""

    def __init__(self, params: KVCacheParams, device: torch.device, capacity: int):
        self.params = params
        self.device = device
        self.length = 0
        self._pending = 0
        self._capacity = 0
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        self._grow(max(capacity, 16))

    def _grow(self, capacity: int) -> None:
        shape = (capacity, self.params.n_kv_heads, self.params.head_dim)
        keys, values = [], []
        for layer in range(self.params.num_layers):
            k = torch.empty(shape, dtype=self.params.dtype, device=self.device)
            v = torch.empty(shape, dtype=self.params.dtype, device=self.device)
            if self._keys:
                k[: self.length] = self._keys[layer][: self.length]
                v[: self.length] = self._values[layer][: self.length]
            keys.append(k)
            values.append(v)
        self._keys, self._values, self._capacity = keys, values, capacity

    def append(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes ``layer``'s keys/values of the new tokens; returns the whole sequence's so far."""
        end = self.length + keys.shape[0]
        if end > self._capacity:
            self._grow(max(end, 2 * self._capacity))
        self._keys[layer][self.length:end] = keys
        self._values[layer][self.length:end] = values
        self._pending = keys.shape[0]
        return self._keys[layer][:end], self._values[layer][:end]

    def commit(self) -> None:
        """Makes the tokens written by the last forward pass part of the sequence."""
        self.length += self._pending
        self._pending = 0


class ContiguousKVCacheManager:
    """Hands out per-request caches within a total token budget."""

    def __init__(self, params: KVCacheParams, device: torch.device, total_tokens: int):
        if total_tokens < 1:
            raise ValueError(f"KV cache budget of {total_tokens} tokens is too small")
        self.params = params
        self.device = device
        self.total_tokens = total_tokens
        self._caches: dict[str, SequenceKVCache] = {}
        self._reserved: dict[str, int] = {}

    @property
    def reserved_tokens(self) -> int:
        return sum(self._reserved.values())

    @property
    def free_tokens(self) -> int:
        return self.total_tokens - self.reserved_tokens

    @property
    def active_requests(self) -> int:
        return len(self._caches)

    def can_claim(self, max_length: int) -> bool:
        return max_length <= self.free_tokens

    def claim(self, request_id: str, max_length: int, initial_length: int) -> SequenceKVCache:
        """Reserves ``max_length`` tokens for ``request_id``; ValueError if it does not fit."""
        if request_id in self._caches:
            raise ValueError(f"request {request_id!r} already holds a KV cache")
        if not self.can_claim(max_length):
            raise ValueError(f"request {request_id!r} needs {max_length} KV tokens, {self.free_tokens} free")
        self._reserved[request_id] = max_length
        cache = SequenceKVCache(self.params, self.device, initial_length)
        self._caches[request_id] = cache
        return cache

    def get(self, request_id: str) -> SequenceKVCache:
        return self._caches[request_id]

    def contains(self, request_id: str) -> bool:
        return request_id in self._caches

    def release(self, request_id: str) -> None:
        """Frees the request's cache and reservation (no error if it holds none)."""
        self._caches.pop(request_id, None)
        self._reserved.pop(request_id, None)
