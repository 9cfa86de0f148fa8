"""ModelRunner: one step of the speech-token LM on its device, launched without reading anything back.

A step's items (request, first token, token count, sample or not) become host arrays in one staging
arena (token ids, positions, cache slots, logit rows, each sampling row's settings and random draw)
and reach the device in one copy. The forward pass, the candidate logits, the sampling and the
update of each request's repetition counts all run on the device from there; the sampled ids come
back in one asynchronous copy, read only when the caller asks for the step's result
(:meth:`PendingStep.result`). So on CUDA the host can prepare step n + 1 while step n runs.

Decode steps (one new token per row) can be padded to a fixed batch size (``decode_buckets``):
the padding rows compute a dummy token in the cache's scratch page and sample nothing, so the
requests' tokens are the same as unpadded; on CUDA each bucket's forward pass is captured once as a
CUDA graph (decode_graphs.py) and replayed.

The runner owns, per request, a slot of its row table (core/row_table.py: what the request's rows
need every step, on the host) and of the device's columns beside it (its repetition counts and its
latest sample); :meth:`release` frees them when the request ends.

A decode step whose every row computes the one token it sampled last (the steady state of every
family without a text track) is staged from the tables alone: its inputs are the slots' latest
samples on the device, its attention metadata gathers the KV cache's page table, and its sampling
rows and the frame codes alignments fix are gathered from the row table, with no Python per row but
the reading of its items.
"""

from __future__ import annotations

import bisect
import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from audio_pipeline.core.kv_cache.paged import PagedBatch, PagedKVCacheManager
from audio_pipeline.models.llama_model import candidate_groups
from audio_pipeline.models.prompt_precision import prompt_ranges
from audio_pipeline.core.row_table import RowTable
from audio_pipeline.core.steady_batch import SteadyItems
from audio_pipeline.core.step_arena import StepArena
from audio_pipeline.core.step_timing import StepTimer
from audio_pipeline.core.depth import position_sampling
from audio_pipeline.core.text_stream import text_stream_sampling
from audio_pipeline.core.tracks import NoTracks, track_inputs
from audio_pipeline.core.sampler import FLOAT_FIELDS, DeviceSamplingRows, SamplingRows, sample_rows
from audio_pipeline.core.scheduler import OneEach, StepResult
from audio_pipeline_kernels import StepMetadata

if TYPE_CHECKING:
    from audio_pipeline.config import PipelineConfig
    from audio_pipeline.core.sample_graphs import SampleGraphs
    from audio_pipeline.models.llama_model import LlamaPipelineModel

logger = logging.getLogger(__name__)

#: A CPU step computing at least this many tokens (a batch of prompts) runs on ``prefill_threads``
#: intra-op threads; smaller steps keep the engine's (runtime.py: one beats two for them).
PREFILL_THREADS_MIN_TOKENS = 256


class DeviceRows:
    """What the device keeps per row-table slot (core/row_table.py): each request's repetition
    counts (how often each code was generated in each frame slot: [slots * tokens_per_frame,
    codebook] rows) and its latest sample (``latest``: [slots] ids, or [slots, 1 + codes] with a
    frame each), which a later step takes as its decode input without the host knowing it. Both
    grow with the table; a slot's counts start afresh when a request is written into it (in the
    device's order, by the step that first stages it)."""

    def __init__(self, rows: RowTable, tokens_per_frame: int, codebook_size: int, sample_shape: tuple[int, ...],
                 device: torch.device, before_grow=None):
        self.rows, self.frame, self.codebook, self.device = rows, tokens_per_frame, codebook_size, device
        self.sample_shape = sample_shape
        #: Called before the tensors are replaced by larger ones (steps still running must finish first).
        self.before_grow = before_grow
        self.capacity = 0
        self.table = torch.zeros(0, codebook_size, device=device)
        self.latest = torch.zeros(0, *sample_shape, dtype=torch.long, device=device)
        self.fit()

    def fit(self) -> None:
        """Grows the tensors to the table's capacity (after the steps in flight)."""
        capacity = self.rows.capacity
        if capacity <= self.capacity:
            return
        if self.capacity and self.before_grow is not None:
            self.before_grow()
        table = torch.zeros(capacity * self.frame, self.codebook, device=self.device)
        table[:self.table.shape[0]] = self.table
        latest = torch.zeros(capacity, *self.sample_shape, dtype=torch.long, device=self.device)
        latest[:self.latest.shape[0]] = self.latest
        self.table, self.latest, self.capacity = table, latest, capacity

    def counts_of(self, request_id: str) -> torch.Tensor:
        """[tokens_per_frame, codebook] counts of a live request (a view)."""
        slot = self.rows.slot_of(request_id)
        return self.table[slot * self.frame:(slot + 1) * self.frame]


@dataclass
class PendingStep:
    """A launched step; ``result`` waits for its sampled ids (the one point where the host reads
    what the device computed) and returns them as plain data."""

    items: list[Any]
    #: Per item, its row among the sampled ids (-1: it did not sample).
    sample_rows: list[int]
    #: Where the sampled ids arrive: on the CPU the ids themselves, on CUDA a pinned host copy.
    ids: torch.Tensor | None = None
    #: What to wait for before reading ``ids``: a CUDA event, or the CPU worker's future.
    done: Any = None
    #: A step staged from the tables, one token a position: the row table and its rows' slots and
    #: generated positions, to check every sample at once (RowTable.plain_samples).
    checked_by: tuple[Any, np.ndarray, np.ndarray, Any] | None = None

    def result(self) -> StepResult:
        if isinstance(self.done, Future):
            self.done.result()
        elif self.done is not None:
            self.done.synchronize()
        if self.checked_by is not None and self.ids is not None:
            table, slots, positions, columns = self.checked_by
            values = self.ids.numpy()
            ids = values.tolist()
            return StepResult(self.items, OneEach(ids), plain=table.plain_samples(slots, positions, values, columns).tolist(),
                              ids=ids)
        ids = self.ids.tolist() if self.ids is not None else []
        if self.ids is not None and self.ids.dim() == 2:  # [B, 1 + codes]: each row's id, then its frame
            return StepResult(self.items, [[ids[row][0]] if row >= 0 else [] for row in self.sample_rows],
                              frames=[[ids[row][1:]] if row >= 0 else [] for row in self.sample_rows])
        return StepResult(self.items, [[ids[row]] if row >= 0 else [] for row in self.sample_rows])


def tokens_of(request: Any, start: int, end: int) -> list[int]:
    """Tokens [start, end) of prompt + generated, without joining the two lists."""
    prompt, generated = request.prompt_ids, request.generated
    split = len(prompt)
    if start >= split:
        return generated[start - split:end - split]
    return prompt[start:min(end, split)] + generated[:max(end - split, 0)]


class ModelRunner:
    """Runs steps of ``model`` (whose KV manager must be loaded); see the module docstring.

    A step may be launched before the host knows what the step before it sampled: an item that
    starts at the end of its request's known tokens takes its first token from the device, where
    the request's latest launched sample is (the ids of a later step are copied into the inputs of
    the next one on the device), and the forced tokens after it from the layout. So the engine can
    launch step n + 1 (or the passes of a multi-step decode) before reading step n's result.

    With ``worker`` (the CPU's overlap: its device work is synchronous) the forward pass and the
    sampling of each step run on one worker thread, in launch order, while the caller goes on.
    """

    def __init__(self, model: "LlamaPipelineModel", kv: PagedKVCacheManager, layout: Any, *, decode_buckets: Sequence[int] = (),
                 cuda_graphs: bool = False, sync_free: bool | None = None, timer: StepTimer | None = None,
                 worker: bool = False, sample_graphs: bool = True, prefill_threads: int = 1, rows: int = 16):
        if worker and model.devices[0].type != "cpu":
            # Its launches would copy step n + 1's inputs into the one device staging buffer before
            # the worker has queued step n's forward pass that reads it; the device needs no worker.
            raise ValueError("ModelRunner(worker=True) is the CPU's overlap; on CUDA the device runs ahead itself")
        self.model = model
        #: The dtype of prompt positions' products where it is not the model's (model.prompt_dtype).
        self.prompt_dtype = model.prompt_dtype
        #: Intra-op threads of a large prompt step on the CPU (PREFILL_THREADS_MIN_TOKENS).
        self.prefill_threads = prefill_threads
        #: Seconds of the inputs, model and sample phases (the engine's step metrics).
        self.timer = timer or StepTimer()
        #: The paged KV cache the steps read and write (the engine builds it: core/kv_cache/build.py).
        self.kv = kv
        self.device = model.devices[0]
        self.layout = layout
        self.arena = StepArena(self.device)
        #: Sampling decides its rule from host data only (always on CUDA, where reading back stalls).
        self.sync_free = self.device.type == "cuda" if sync_free is None else sync_free
        if not self.sync_free and self.device.type == "cpu":  # built (or loaded) now, not in the first step
            from audio_pipeline_kernels.native_sampler import native_sampler

            logger.info("sampling rule on the CPU: %s", "one C++ call a draw (native sampler)" if native_sampler()
                        else "torch operations")
        self.decode_buckets = sorted(set(decode_buckets))
        #: A token or a whole frame per position (core/depth.py), chosen once for the model.
        self.frame_sampling = (text_stream_sampling(model, layout, sync_free=self.sync_free) if layout.text_stream
                               else position_sampling(model, layout, sync_free=self.sync_free))
        #: A text track beside the tokens (core/tracks.py), chosen once for the layout.
        self.tracks = track_inputs(model, layout)
        #: Per request, what its sampling rows need every step (core/row_table.py).
        # Slots for ``rows`` requests from the start (the engine's batch): a table that grows waits
        # for the steps in flight first, and a burst of new requests should not.
        self.rows = RowTable(layout, capacity=max(1, rows))
        #: Per slot of ``rows``, its repetition counts and latest sample on the device.
        self.device_rows = DeviceRows(self.rows, layout.tokens_per_frame, layout.codebook_size,
                                      self.frame_sampling.ids_shape(1)[1:], self.device, before_grow=self.wait)
        # The candidate logits' products (model.packed_linears; a no-op where they are not packed).
        model.pack_candidate_ranges({(layout.token_range(slot)[0], layout.codebook_size)
                                     for slot in range(layout.tokens_per_frame)})
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="model-runner") if worker else None
        self._last_launch: Future | None = None
        self.graphs = None
        if cuda_graphs and self.device.type == "cuda" and self.decode_buckets:
            from audio_pipeline.core.decode_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(model, kv, self.decode_buckets,
                                       {**self.frame_sampling.graph_inputs(), **self.tracks.graph_inputs()})
            self.frame_sampling.capture(self.decode_buckets, hidden_size=int(model.model.config.hidden_size),
                                        dtype=model.dtype, device=self.device, codebook=layout.codebook_size)
        #: The decode steps' token sampling as CUDA graphs (core/sample_graphs.py), where it can be captured.
        self.sample_graphs = None
        if self.graphs is not None and sample_graphs:
            self.sample_graphs = sample_graphs_for(model, layout, self.frame_sampling, self.decode_buckets)

    # --- requests --------------------------------------------------------------------------------

    def release(self, request_id: str) -> None:
        """Forgets a finished request's state (its slot of the row table and the device's columns)."""
        self.rows.release(request_id)

    def wait(self) -> None:
        """Waits until every launched step has run (the CPU worker's; on CUDA the caller syncs)."""
        if self._last_launch is not None:
            wait([self._last_launch])

    def close(self) -> None:
        """Waits for the launched steps and stops the worker thread."""
        if self._worker is not None:
            self.wait()
            self._worker.shutdown(wait=True)

    # --- steps -----------------------------------------------------------------------------------

    def bucket_for(self, batch: int) -> int:
        """The padded batch size of a decode step of ``batch`` rows (itself above the largest bucket)."""
        index = bisect.bisect_left(self.decode_buckets, batch)
        return self.decode_buckets[index] if index < len(self.decode_buckets) else batch

    def launch(self, items: Sequence[Any], *, from_tables: bool = True) -> PendingStep:
        """Starts one step over ``items`` (each ``request``, ``start``, ``num_tokens``, ``sample``).
        A request's tokens before ``start`` must be in the cache or computed by a step launched
        before this one. Reads no device value. ``from_tables``: a steady decode step is staged
        from the tables (the module docstring); False stages it row by row, as any other step (the
        tests compare the two)."""
        if type(items) is not SteadyItems or not items.batch.live or not from_tables:
            # (a pass of the persistent batch has no row that ended: an end dissolves it)
            items = [item for item in items if item.request.stop_reason is None and item.num_tokens > 0]
        if not items:
            return PendingStep([], [])
        timer = self.timer
        with timer.phase("inputs"):
            staged = (self._stage_decode(items) if from_tables else None) or self._stage(items)
            metadata, padded = staged.metadata, staged.padded
            device = self.arena.send(staged).device
            batch = len(staged.sample_slots)
            ids = (torch.empty(self.frame_sampling.ids_shape(batch), dtype=torch.long, device=self.device)
                   if batch else None)
            if batch:  # where each sampling row's request will find its sample (its next decode input)
                self.rows.latest[staged.sample_slots] = staged.sample_ends
        run = (self._device_step, device, metadata, padded, staged, ids)
        # A token step from the tables: its samples are checked for all rows at once when read.
        checked = (self.rows, staged.sample_slots, staged.positions, staged.columns) \
            if staged.tabled and self.frame_sampling.codes == 1 else None
        if self._worker is not None:
            done = self._last_launch = self._worker.submit(*run)
            return PendingStep(items, staged.sample_rows, ids, done, checked)
        run[0](*run[1:])
        if ids is None or self.device.type == "cpu":
            return PendingStep(items, staged.sample_rows, ids, None, checked)
        host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
        host.copy_(ids, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return PendingStep(items, staged.sample_rows, host, event, checked)

    def _device_step(self, device: dict[str, torch.Tensor], metadata: StepMetadata, padded: int, staged,
                     ids: torch.Tensor | None) -> None:
        """The device's part of a step: earlier samples into the inputs, the forward pass, and the
        sampling (into ``ids``, and each sampling row's slot's latest sample)."""
        timer = self.timer
        columns = self.device_rows
        with timer.phase("model"):
            if "fresh_slots" in device:  # requests new to their slots: their counts start at zero
                fresh = device["fresh_slots"]
                columns.table.view(-1, self.layout.tokens_per_frame, columns.codebook).index_fill_(0, fresh, 0)
            if "chain_rows" in device:  # decode inputs still on the device: the slots' latest samples
                rows = device["chain_rows"]
                picked = columns.latest.index_select(0, device["chain_slots"])
                device["tokens"].index_copy_(0, rows, self.frame_sampling.chain(device, rows, picked))
            wide = self.device.type == "cpu" and self.prefill_threads > 1 and \
                metadata.num_tokens >= PREFILL_THREADS_MIN_TOKENS
            if wide:  # a large prompt step: its products split well over more cores (runtime.py)
                threads = torch.get_num_threads()
                torch.set_num_threads(self.prefill_threads)
            try:
                hidden = self._forward(device, metadata, padded, staged.prompt_rows)
            finally:
                if wide:
                    torch.set_num_threads(threads)
        timer.forwards += 1
        if ids is not None:
            with timer.phase("sample"):
                ids.copy_(self._sample(hidden, device, staged.rows, staged.groups, staged.depth_rows, staged.in_order))
                columns.latest.index_copy_(0, device["sample_slots"], ids)

    def _padded(self, items: Sequence[Any], decode: bool) -> int:
        """The padded batch size of a decode step (scratch rows: one token at position 0 of the
        cache's scratch page); 0: unpadded."""
        return self.bucket_for(len(items)) if self.decode_buckets and decode else 0

    def _step_tokens(self, items: Sequence[Any], ends: list[int]) -> tuple[list[int], list[tuple[int, int]]]:
        """Every item's tokens in row order, and where a token is on the device, not yet known on the
        host (the request's latest launched sample, not applied yet): a placeholder in the list, and
        a link (its row, the request's slot, whose latest sample the device holds). After such a
        sample come the forced tokens that follow it. One pass over the rows, without a call per
        row: at hundreds of rows a step the calls cost more than the rows' work."""
        flat: list[int] = []
        links: list[tuple[int, int]] = []
        slot_of, latest = self.rows.slot_of, self.rows.latest
        for index, item in enumerate(items):
            request, start, count = item.request, item.start, item.num_tokens
            if start < request.processed:
                raise RuntimeError(f"request {request.request_id}: step starts at {start}, but {request.processed} "
                                   "tokens are in the cache already")
            prompt, generated = request.prompt_ids, request.generated
            split = len(prompt)
            known = split + len(generated)
            if start + count <= known:
                if count == 1:
                    flat.append(prompt[start] if start < split else generated[start - split])
                else:
                    flat.extend(tokens_of(request, start, start + count))
                continue
            slot = slot_of(request.request_id)
            if slot is None or start != latest[slot]:
                raise RuntimeError(f"request {request.request_id}: tokens [{start}, {start + count}) are neither "
                                   f"known ({known}) nor the sample of a launched step")
            flat.append(0)
            if count > 1:
                flat.extend(request.forced_run(start - split + 1)[0][:count - 1])
            links.append((ends[index], slot))
        return flat, links

    def _arrays(self, total: int, batch: int, width: int, links: int, fresh: int) -> dict[str, tuple]:
        """The host arrays of a step of ``total`` tokens and ``batch`` sampling rows (name -> (shape, dtype))."""
        codebook = self.layout.codebook_size if batch else 0
        arrays = {
            "tokens": ((total,), np.int64), "positions": ((total,), np.int64), "slots": ((total,), np.int64),
            "logit_rows": ((batch,), np.int64), "order": ((batch,), np.int64), "count_rows": ((batch,), np.int64),
            "starts": ((batch,), np.int64), "extra_ids": ((batch, width), np.int64),
            "blocked": ((batch, codebook + width if batch else 0), np.bool_),
            "floats": ((len(FLOAT_FIELDS), batch), np.float32), "top_k": ((batch,), np.int64),
            "sample_slots": ((batch,), np.int64),
        }
        arrays.update(self.frame_sampling.arrays(total, batch, codebook))
        if links:  # tokens to take from the slots' latest samples on the device
            arrays.update(chain_rows=((links,), np.int64), chain_slots=((links,), np.int64))
        if fresh:
            arrays["fresh_slots"] = ((fresh,), np.int64)
        return arrays

    def _stage_decode(self, items: Sequence[Any]):
        """A steady decode step staged from the tables, or None where the step is not one: every
        item computes one token and samples, the token its request sampled last (still on the
        device, or known), its request's alignment (if any) is listed in the row table, and no text
        track travels beside the tokens."""
        if type(self.tracks) is not NoTracks:
            return None
        table = self.rows
        if type(items) is SteadyItems:  # the persistent batch: its rows' slots and pages are kept
            steady = items.batch
            requests, request_ids, start, page_rows = steady.requests, steady.request_ids, items.starts, steady.page_rows
            if steady.slots is None:
                steady.slots = table.slots(requests)
                steady.columns = table.columns(steady.slots)
            slots, columns = steady.slots, steady.columns
        else:
            requests, starts, counts, samples = zip(*items)
            if max(counts) != 1 or not all(samples):
                return None
            slots = table.slots(requests)
            columns = table.columns(slots)
            start = np.array(starts, dtype=np.int64)
            request_ids, page_rows = [request.request_id for request in requests], None
        self.device_rows.fit()
        if columns.aligned_rows.size or not np.array_equal(table.latest[slots], start):
            return None
        batch = len(items)
        padded = self._padded(items, True)
        metadata = self.kv.decode_metadata(request_ids, start, padding=max(0, padded - batch), page_rows=page_rows)
        total = metadata.num_tokens
        fresh = table.take_written()
        staged = self.arena.stage(self._arrays(total, batch, columns.width, batch, len(fresh)))
        host = staged.host
        host["tokens"][:] = 0  # every row's from its slot's latest sample, on the device; 0: padding
        self.frame_sampling.fill_inputs(host, (), ())
        host["positions"][:] = metadata.positions
        host["slots"][:] = metadata.slot_mapping
        rows_ = np.arange(batch, dtype=np.int64)
        host["chain_rows"][:] = rows_
        host["chain_slots"][:] = slots
        if fresh:
            host["fresh_slots"][:] = fresh
        host["logit_rows"][:] = rows_
        positions = start + 1 - columns.prompt_len
        self._stage_sampling(staged, requests, positions, slots, columns)
        staged.prompt_rows = ()  # a decode row's position is past its prompt
        staged.in_order = True
        staged.metadata, staged.padded = metadata, padded
        staged.sample_rows = list(range(batch))
        staged.sample_ends = start + 1
        staged.tabled, staged.positions, staged.columns = True, positions, columns
        return staged

    def _stage(self, items: Sequence[Any]):
        """Host arrays of the step, row by row where the tables do not serve (prompts, forced runs,
        text tracks), in the arena (one copy to the device)."""
        lengths = [item.num_tokens for item in items]
        padded = self._padded(items, all(n == 1 for n in lengths))
        metadata = self.kv.metadata([item.request.request_id for item in items], [item.start for item in items],
                                    lengths, padding=max(0, padded - len(items)))
        total = metadata.num_tokens
        sampling = [item for item in items if item.sample]
        batch = len(sampling)
        contexts = [item.request for item in sampling]
        slots = self.rows.slots(contexts) if sampling else np.zeros(0, dtype=np.int64)
        self.device_rows.fit()
        positions = np.array([item.start + item.num_tokens - len(item.request.prompt_ids) for item in sampling],
                             dtype=np.int64)
        width = self.rows.stop_width(slots) if sampling else 0
        # Python ints, read once: indexing the numpy array row by row costs more than the rows' work.
        ends = metadata.qo_indptr.tolist()
        tokens, links = self._step_tokens(items, ends)
        fresh = self.rows.take_written()
        arrays = self._arrays(total, batch, width, len(links), len(fresh))
        # Only rows of an aligned layout have forced tokens after their sample.
        follow = self._forced_follow_ups(contexts, positions, slots) if sampling and self.rows.aligned[slots].any() \
            else []
        arrays.update(self.tracks.arrays(items, total))
        if follow:  # forced tokens that follow samples, for the repetition counts
            arrays.update(follow_rows=((len(follow),), np.int64), follow_codes=((len(follow),), np.int64),
                          follow_owner=((len(follow),), np.int64))
        staged = self.arena.stage(arrays)
        # Which rows are prompt positions, where model.prompt_dtype applies (by position, whatever the batch).
        staged.prompt_rows = tuple(prompt_ranges(
            [item.start for item in items], lengths,
            [len(item.request.prompt_ids) for item in items])) if self.prompt_dtype is not None else ()
        host = staged.host
        flat = host["tokens"]
        # Every item's tokens fill its rows in order: one write of them all (a numpy write per row
        # was most of a 256-row decode step's staging).
        flat[:ends[len(items)]] = tokens
        flat[ends[len(items)]:] = 0  # padding rows
        self.frame_sampling.fill_inputs(host, items, ends)
        self.tracks.fill(host, items, ends)
        host["positions"][:] = metadata.positions
        host["slots"][:] = metadata.slot_mapping
        if links:
            host["chain_rows"][:], host["chain_slots"][:] = zip(*links)
        if fresh:
            host["fresh_slots"][:] = fresh
        # Every item is one token that samples: the sampling rows are the first rows of the step.
        staged.in_order = batch == len(items) and ends[len(items)] == batch
        staged.metadata, staged.padded = metadata, padded
        staged.tabled = False
        sample_rows, row = [], 0
        for item in items:
            sample_rows.append(row if item.sample else -1)
            row += item.sample
        staged.sample_rows = sample_rows
        staged.sample_ends = np.array([item.start + item.num_tokens for item in sampling], dtype=np.int64)
        if not sampling:
            staged.rows, staged.groups, staged.depth_rows, staged.sample_slots = None, [], None, slots
            return staged
        host["logit_rows"][:] = [ends[i + 1] - 1 for i, item in enumerate(items) if item.sample]
        if follow:
            host["follow_rows"][:], host["follow_codes"][:], host["follow_owner"][:] = zip(*follow)
        self._stage_sampling(staged, contexts, positions, slots)
        return staged

    def _stage_sampling(self, staged, contexts: Sequence[Any], positions: np.ndarray, slots: np.ndarray,
                        columns=None) -> None:
        """The sampling rows of the step's sampling requests (``contexts``, at generated
        ``positions``, in ``slots`` of the row table, whose unchanging ``columns`` the caller may
        keep), written straight into the step's arrays (the sampler reads them there), with each
        sampling row's draws from its request's generator."""
        host, table = staged.host, self.rows
        if columns is None:
            columns = table.columns(slots)
        draws = table.draw(columns.sampled_slots, table.draws_per_row) if columns.sampling.size else None
        rows = table.sampling_rows(contexts, positions, slots=slots, out=host, draws=draws, draw=False,
                                   columns=columns)
        host["sample_slots"][:] = slots
        host["count_rows"][:] = slots * self.layout.tokens_per_frame + rows.frame_slots
        order, staged.groups = candidate_groups(rows.starts)
        host["order"][:] = order
        staged.rows = rows
        staged.depth_rows = self.frame_sampling.stage(host, contexts, positions, rows, table, slots, draws)
        staged.sample_slots = slots

    def _forced_follow_ups(self, sampling: list[Any], positions: np.ndarray,
                           slots: np.ndarray) -> list[tuple[int, int, int]]:
        """(count row, code, sampling row) of each forced token a layout appends right after a
        sample (phoneme-lpc's alignment): counted with the sample, unless the sample ends the speech."""
        follow = []
        frame = self.layout.tokens_per_frame
        for row in np.flatnonzero(self.rows.aligned[slots]).tolist():
            request, position = sampling[row], int(positions[row])
            run, _ = request.forced_run(position + 1)
            if not run:
                continue
            slot = int(slots[row])
            for offset, token in enumerate(run, start=position + 1):
                follow.append((slot * frame + offset % frame, self.layout.token_to_code(token, offset), row))
        return follow

    def _forward(self, device: dict[str, torch.Tensor], metadata: StepMetadata, padded: int,
                 prompt_rows: tuple[tuple[int, int], ...] = ()) -> torch.Tensor:
        inputs = {**self.frame_sampling.forward_inputs(device), **self.tracks.forward_inputs(device)}
        # Raw vectors sit at prompt positions: a step with one is never a captured decode step.
        if self.graphs is not None and padded in self.graphs and "vectors" not in inputs:
            return self.graphs.run(padded, device, metadata, inputs)
        batch = PagedBatch(self.kv.cache, metadata, device["slots"], self.kv.backend.plan(metadata), prompt_rows)
        with torch.inference_mode():
            return self.model.forward(device["tokens"], device["positions"], batch, **inputs)

    @torch.inference_mode()
    def _sample(self, hidden: torch.Tensor, device: dict[str, torch.Tensor], rows: SamplingRows,
                groups: list[tuple[int, int, int]], depth_rows: SamplingRows | None = None,
                in_order: bool = False) -> torch.Tensor:
        """Candidate logits of each sampling row, the draw, and the counts update: the step's samples
        on the device ([B] ids, or with a frame each: core/depth.py); ``depth_rows`` are what
        follows the backbone's sample; ``in_order``: the sampling rows are the step's first rows."""
        codebook = rows.codebook_size
        table = self.device_rows.table
        captured = self.sample_graphs
        if captured is not None and in_order and "follow_rows" not in device and captured.fits(rows):
            states = hidden[:rows.starts.shape[0]]
            ids = captured.run(states, device, table, rows)
        else:
            states = hidden.index_select(0, device["logit_rows"])
            if captured is not None:  # the captured form's logits (see core/sample_graphs.py)
                logits = self.model.compute_slot_logits(states, device["starts"], device["extra_ids"], codebook,
                                                        *captured.span)
            else:
                logits = self.model.compute_candidate_logits(states, groups, device["order"], device["extra_ids"],
                                                             codebook)
            counts = table.index_select(0, device["count_rows"])
            device_rows = DeviceSamplingRows(*(device[name] for name in DeviceSamplingRows.FIELDS))
            ids = sample_rows(logits, rows, device_rows, counts, sync_free=self.sync_free)
        codes = ids - device["starts"]
        counted = ((codes >= 0) & (codes < codebook)).float()
        # index_add_ on the flat table: atomic adds (index_put_ with accumulate sorts its indices first,
        # the costliest host call of a CUDA step's sampling); the counts are small whole numbers, exact
        # in any order.
        flat, width = table.view(-1), table.shape[1]
        flat.index_add_(0, device["count_rows"] * width + codes.clamp(0, codebook - 1), counted)
        ids = self.frame_sampling.complete(ids, states, codes, device, depth_rows)
        if "follow_rows" in device:
            flat.index_add_(0, device["follow_rows"] * width + device["follow_codes"],
                            counted.index_select(0, device["follow_owner"]))
        return ids


def build_runner(model: "LlamaPipelineModel", kv: PagedKVCacheManager, layout: Any, config: "PipelineConfig", *, max_batch_size: int,
                 timer: StepTimer | None = None, overlap: bool = False) -> ModelRunner:
    """The engine's model runner, as the configuration asks: CUDA graphs where the attention kernel
    can be captured (FlashInfer's), decode buckets (model.decode_buckets, else the device's default),
    and on the CPU with overlap a worker thread (on CUDA the device runs ahead by itself)."""
    model_config = config.model
    device = model.devices[0]
    # Graphs replay FlashInfer's decode kernel; the torch form's shapes change every step.
    graphs = model_config.cuda_graphs and kv.backend.name == "flashinfer"
    if model_config.cuda_graphs and device.type == "cuda" and not graphs:
        logger.warning("model.cuda_graphs: off, the %s attention kernel cannot be captured (flashinfer can)",
                       kv.backend.name)
    buckets = model_config.decode_buckets
    if buckets is None:
        buckets = default_decode_buckets(device, max_batch_size, cuda_graphs=graphs)
    # The cores this process may run on (a container's share, not the host's count).
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    prefill_threads = model_config.prefill_threads or min(4, cores)
    return ModelRunner(model, kv, layout, decode_buckets=buckets, cuda_graphs=graphs, timer=timer,
                       worker=overlap and device.type == "cpu", sample_graphs=model_config.sample_graphs,
                       prefill_threads=prefill_threads, rows=max_batch_size)


def sample_graphs_for(model: "LlamaPipelineModel", layout: Any, frame_sampling: Any, buckets: Sequence[int], *,
                      capture: bool = True) -> "SampleGraphs | None":
    """Captured token sampling for ``model``'s decode ``buckets``, or None where it does not apply:
    frame models (their depth graphs sample the frame), layouts whose slot codebooks are not one
    stretch of the vocabulary."""
    from audio_pipeline.core.sample_graphs import SampleGraphs, slot_span

    span = slot_span(layout)
    if frame_sampling.codes != 1 or span is None or not buckets:
        logger.info("CUDA graphs: the token sampling runs eagerly (%s)",
                    "a frame model" if frame_sampling.codes != 1 else "the slot codebooks are not one range")
        return None
    try:
        return SampleGraphs(model, buckets, codebook=layout.codebook_size, extra_width=1, span=span,
                            end_of_speech=layout.end_of_speech, capture=capture)
    except Exception as exc:  # noqa: BLE001 - the eager sampling serves the same ids
        logger.warning("CUDA graphs: the token sampling could not be captured (%s: %s); it runs eagerly",
                       type(exc).__name__, exc)
        return None


def default_decode_buckets(device: Any, max_batch_size: int, *, cuda_graphs: bool) -> list[int]:
    """model.decode_buckets when unset: with CUDA graphs 1, 2, 4, 8, 16, 24, 32, then every 16 up to
    max_batch_size (each one graph); none otherwise, where exact shapes are cheaper than padding."""
    if device.type != "cuda" or not cuda_graphs:
        return []
    sizes = [1, 2, 4, 8, 16, 24, 32, *range(48, max_batch_size + 16, 16)]
    return sorted({min(size, max_batch_size) for size in sizes})
