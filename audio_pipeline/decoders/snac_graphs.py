"""SNAC's batched decode captured as CUDA graphs, one per window length and batch bucket.

On a GPU the decoder's call is short on the device and long on the host: the quantizer's lookups
and the four upsampling stages are about 150 small kernels launched from Python, one batched call
per window length a pass. At 256 Orpheus streams on an H100 that thread held the interpreter for
7.7 ms of every 18.7 ms pass, time the engine loop (which shares the interpreter) then waited for.
Replayed from a graph the call is one launch. Measured through the server on an H200 (docs/performance-history.md,
"SNAC's decode as CUDA graphs"), that thread's time at 256 streams fell by a third but the loop's launches
grew by as much and the passes a second did not rise: ``cuda_graphs`` is off by default.

What a graph cannot hold is host data that shapes the kernels, so a graph is captured per (window
frames, batch bucket): a call of n windows of F frames copies its codes and first-frame offsets
into the first n rows of the smallest bucket of that length that holds them (more rows than the
largest bucket: several replays), replays it and reads the first n rows' audio. The padding rows
keep what an earlier call left there (valid codes and offsets; the rows never mix: every layer
works row by row) and their audio is dropped. The positional noise reads the offsets from the
bucket's buffer on the device, so the noise, like the codes, is an input and not a constant.

The engine captures at start-up (``prepare``) the windows its chunk schedule makes and the shorter
windows a stream's final chunk may make, in every bucket, and then seals the set: while it serves,
any other shape decodes eagerly. Used alone (no engine), a decoder captures a shape on first use.
All go into one memory pool of their own
(replays never overlap: each call reads its audio back before the next starts, so every graph's
output is valid until the next replay of any). Limits keep memory bounded: windows of at most
``max_frames`` frames (longer ones, e.g. a whole utterance decoded at once, run eagerly) and at
most ``max_graphs`` graphs (further shapes run eagerly, with one log line).

The capture itself is cuda/graphs.py's; on a CPU there is nothing to capture, and ``capture=False``
runs the same function on the same buffers (the tests check the plumbing there).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol, Sequence

import torch

from audio_pipeline.cuda.graphs import Buckets, CapturedCall, GraphPool

logger = logging.getLogger(__name__)

#: Rows a captured call holds: a pass decodes the windows of every stream whose chunk is ready,
#: typically a few to a few dozen; more than the largest bucket take several replays.
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
#: Longest window captured, in frames (2.7 s at 24 kHz): streaming windows are a few frames; a
#: whole utterance decoded at once would need a graph per length.
DEFAULT_MAX_FRAMES = 32
#: Graphs kept at most (window lengths x buckets in use; Orpheus's default chunks prepare 69).
DEFAULT_MAX_GRAPHS = 128


class GraphedDecoder(Protocol):
    """What the graphs read of the decoder they capture (decoders/snac.py's SNACDecoder): its
    batched decode of whole rows, and what shapes and seeds its positional noise."""

    device: torch.device
    tokens_per_frame: int
    has_noise: bool
    noise_scale: float
    noise_seed: int | None

    def decode_rows(self, codes: torch.Tensor, firsts: torch.Tensor) -> torch.Tensor: ...

    def noise_tables(self) -> list[torch.Tensor]: ...


class SNACGraphs:
    """Captured batched decodes of ``decoder`` (positional noise or none), built on first use."""

    def __init__(self, decoder: GraphedDecoder, *, buckets: Sequence[int] = DEFAULT_BUCKETS,
                 max_frames: int = DEFAULT_MAX_FRAMES, max_graphs: int = DEFAULT_MAX_GRAPHS, capture: bool = True):
        if decoder.has_noise and decoder.noise_scale != 0 and decoder.noise_seed is None:
            raise ValueError("SNAC CUDA graphs need positional noise (noise_seed an integer) or none")
        self.decoder = decoder
        self.buckets = Buckets(buckets)
        self.sizes = self.buckets.sizes
        self.max_frames, self.max_graphs, self.capture = max_frames, max_graphs, capture
        if decoder.has_noise and decoder.noise_scale != 0:
            decoder.noise_tables()  # built (and moved to the device) now, never inside a capture
        #: (window frames, bucket) -> the call and its fixed codes and first-frame offsets.
        self._entries: dict[tuple[int, int], tuple[CapturedCall[torch.Tensor], torch.Tensor, torch.Tensor]] = {}
        self.pool = GraphPool(decoder.device, capture=capture)
        self._lock = threading.Lock()
        self._full_logged = self._preparing = False
        #: Set by the engine after ``prepare``: no capture while it serves (a capture waits for the
        #: device and empties the allocator's cache under the running loop; on an H200 a capture on
        #: the decoder thread beside the loop stalled the server); other shapes decode eagerly.
        self.sealed = False

    @property
    def replays(self) -> int:
        """Replays (or, without capture, buffered calls) so far: the tests check the graphs are used."""
        return self.pool.replays

    @property
    def capture_seconds(self) -> float:
        """Seconds spent capturing, in all."""
        return self.pool.seconds

    def forward(self, codes: torch.Tensor, firsts: torch.Tensor) -> torch.Tensor:
        """What a graph holds: the decoder's ``decode_rows`` (the eager arithmetic, its noise offsets
        read from a tensor)."""
        return self.decoder.decode_rows(codes, firsts)

    def decode(self, stacked: torch.Tensor, offsets: Sequence[int]) -> torch.Tensor | None:
        """The audio of ``stacked`` ((n, 7F) checked codes, any device) whose first frames are
        ``offsets``, as an (n, F * samples) float32 CPU tensor; None where no graph serves the call
        (window too long, the graph limit reached): the caller decodes it eagerly."""
        count, frames = stacked.shape[0], stacked.shape[1] // self.decoder.tokens_per_frame
        if frames > self.max_frames or count == 0:
            return None
        largest = self.sizes[-1]
        with self._lock:
            pieces = []
            for start in range(0, count, largest):
                rows = min(largest, count - start)
                entry = self._entry(frames, self.buckets.fit(rows))
                if entry is None:
                    return None
                call, codes, firsts = entry
                codes[:rows].copy_(stacked[start:start + rows])
                firsts[:rows, 0].copy_(torch.as_tensor(list(offsets[start:start + rows]), dtype=torch.long))
                # Read back before the next replay: the graphs share one pool (see the module docstring).
                pieces.append(call()[:rows].cpu())
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def prepare(self, frames: Sequence[int], rows: int | None = None) -> None:
        """Captures the buckets (those of at most ``rows`` rows; all by default) for windows of each
        of ``frames`` (within the limits) now: a capture waits for the device and empties the
        allocator's cache, which the engine does at start-up rather than while streams wait."""
        started, before = time.perf_counter(), len(self._entries)
        sizes = [size for size in self.sizes if rows is None or size <= rows]
        with self._lock:
            self._preparing = True
            try:
                for count in frames:
                    if 0 < count <= self.max_frames:
                        for bucket in sizes:
                            self._entry(count, bucket)
            finally:
                self._preparing = False
        logger.info("SNAC CUDA graphs: windows of %s frames at %s rows: %d captured in %.1f s (%d held)",
                    ",".join(map(str, frames)) or "no", ",".join(map(str, sizes)), len(self._entries) - before,
                    time.perf_counter() - started, len(self._entries))

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """(window frames, bucket) of every graph held, in the order they were captured."""
        return list(self._entries)

    def _entry(self, frames: int, bucket: int):
        key = (frames, bucket)
        entry = self._entries.get(key)
        if entry is not None:
            return entry
        if self.sealed and not self._preparing:
            return None
        if len(self._entries) >= self.max_graphs:
            if not self._full_logged:
                logger.info("SNAC CUDA graphs: %d held (the limit); windows of other shapes decode eagerly",
                            self.max_graphs)
                self._full_logged = True
            return None
        device = self.decoder.device
        codes = torch.zeros(bucket, frames * self.decoder.tokens_per_frame, dtype=torch.long, device=device)
        firsts = torch.zeros(bucket, 1, dtype=torch.long, device=device)
        before = self.pool.seconds
        # The warm-up on a side stream (cuda/graphs.py) also means no lazy initialisation inside a capture.
        call = self.pool.call(lambda: self.forward(codes, firsts))
        if self.capture:
            # At start-up (prepare) one summary line; later captures are each one (a stall of the decoder).
            logger.log(logging.DEBUG if self._preparing else logging.INFO,
                       "SNAC CUDA graph captured: windows of %d frames, %d rows, in %.0f ms (%d held)",
                       frames, bucket, 1000 * (self.pool.seconds - before), len(self._entries) + 1)
        entry = self._entries[key] = (call, codes, firsts)
        return entry
