"""Speech-token generation steps: TextGenerationPipeline and OverlapTextGenerationPipeline.

A step takes scheduled items (a context, the tokens to compute from ``processed``, and whether to
sample after them): prefill chunks and decode tokens run in one ragged batch on the paged KV
cache, then every item that reached the end of its known tokens samples its next speech token.

A pipeline runs one forward pass per ``submit`` and hands back what it sampled, as plain data, from
``collect`` (a :class:`~audio_pipeline.scheduler.StepResult`); it never writes a request. The engine
applies results through ``scheduler.update``, the one place tokens enter requests.
``OverlapTextGenerationPipeline.submit`` starts the pass on a worker thread and returns at once, so
the caller's work between steps (scheduling, audio decoding, delivery) overlaps the forward pass.

``execute`` and ``generate`` (the seed's GenerateMixin, for use without an engine) submit, collect
and apply in one call, with the same rule (:func:`~audio_pipeline.scheduler.apply_step`).
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence


from audio_pipeline.context import StopReason, TTSContext
from audio_pipeline.defaults import DEFAULT_MAX_BATCH_SIZE
from audio_pipeline.pipelines.model_runner import ModelRunner
from audio_pipeline.pipelines.step_timing import StepTimer
from audio_pipeline.scheduler import StepResult, apply_step

if TYPE_CHECKING:
    from audio_pipeline.config import PipelineConfig
    from audio_pipeline.models.llama_model import LlamaPipelineModel


@dataclass(frozen=True)
class BatchItem:
    """Compute ``num_tokens`` tokens of ``context`` from position ``start``; sample after them if ``sample``."""

    request: TTSContext
    start: int
    num_tokens: int
    sample: bool


@dataclass
class TextGenerationInputs:
    """One forward pass's items (from the scheduler)."""

    items: list[Any] = field(default_factory=list)

    @classmethod
    def from_contexts(cls, contexts: Sequence[TTSContext]) -> "TextGenerationInputs":
        """Every context's unprocessed tokens, each followed by a sample."""
        return cls([BatchItem(c, c.processed, c.total_length - c.processed, True) for c in contexts])

    @property
    def batch(self) -> list[TTSContext]:
        return [item.request for item in self.items]


@dataclass
class TextGenerationOutput:
    request_id: str
    tokens: list[int] = field(default_factory=list)
    final_status: StopReason | None = None


class TextGenerationPipeline:
    """Runs steps synchronously: ``execute`` returns the outputs of the batch it was given."""

    def __init__(self, pipeline_config: "PipelineConfig", pipeline_model: "LlamaPipelineModel", tokenizer: Any = None):
        self._pipeline_config = pipeline_config
        self.pipeline_model = pipeline_model
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        self._done: StepResult | None = None
        #: Seconds per step phase; the engine flushes it into its metrics.
        self.timer = StepTimer()
        self._runner: ModelRunner | None = None

    def runner(self, layout: Any) -> ModelRunner:
        """The model runner (built on first use, for the requests' layout)."""
        if self._runner is None:
            model_config = self._pipeline_config.model
            device = self.pipeline_model.devices[0]
            buckets = model_config.decode_buckets
            if buckets is None:
                buckets = default_decode_buckets(device, self._pipeline_config.max_batch_size or DEFAULT_MAX_BATCH_SIZE,
                                                 cuda_graphs=model_config.cuda_graphs)
            self._runner = ModelRunner(self.pipeline_model, layout, decode_buckets=buckets,
                                       cuda_graphs=model_config.cuda_graphs, timer=self.timer)
        return self._runner

    # --- properties of the seed interface ---------------------------------------------------------

    @property
    def pipeline_config(self) -> "PipelineConfig":
        return self._pipeline_config

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def kv_manager(self):
        return self.pipeline_model.kv_manager

    @property
    def kv_managers(self) -> list:
        return [self.kv_manager]

    @property
    def overlap_active(self) -> bool:
        return False

    def has_pending_outputs(self) -> bool:
        return self._done is not None

    # --- execution --------------------------------------------------------------------------------

    def submit(self, inputs: TextGenerationInputs) -> None:
        """Runs one forward pass of ``inputs`` (here, synchronously); ``collect`` returns its result.
        The previous result must have been collected."""
        with self._lock:
            if self._done is not None:
                raise RuntimeError("the previous step's result was not collected")
            self._done = self._compute(inputs)

    def collect(self) -> StepResult | None:
        """The submitted pass's result (None if nothing was submitted)."""
        with self._lock:
            result, self._done = self._done, None
            return result

    def execute(self, inputs: TextGenerationInputs) -> dict[str, TextGenerationOutput]:
        """Runs ``inputs``, applies the result to its contexts and returns it by request id (the
        seed's GenerateMixin; the engine uses submit, collect and its scheduler's update instead)."""
        self.submit(inputs)
        return self._outputs(self.collect())

    @staticmethod
    def _outputs(result: StepResult | None) -> dict[str, TextGenerationOutput]:
        if result is None:
            return {}
        apply_step(result)
        return {item.request.request_id: TextGenerationOutput(item.request.request_id, list(tokens),
                                                              item.request.stop_reason)
                for item, tokens in zip(result.items, result.tokens)}

    def _compute(self, inputs: TextGenerationInputs) -> StepResult:
        """One forward pass and its sampling; reads its contexts, writes none of them (only the
        sampling generators advance)."""
        items = [item for item in inputs.items if not item.request.is_done and item.num_tokens > 0]
        for item in items:
            if item.start != item.request.processed:
                raise RuntimeError(f"request {item.request.request_id}: step starts at {item.start} but "
                                   f"{item.request.processed} tokens are computed")
        return StepResult(items, self._forward(items) if items else [])

    def _forward(self, items: Sequence[Any]) -> list[list[int]]:
        return self.runner(items[0].request.layout).launch(items).result().tokens

    def release(self, request_id: str) -> None:
        """Frees what the request holds: its KV cache (the scheduler normally does this) and the
        model runner's state of it."""
        self.kv_manager.release(request_id)
        self.forget(request_id)

    def forget(self, request_id: str) -> None:
        """Frees the model runner's state of a finished request (its repetition counts)."""
        if self._runner is not None:
            self._runner.release(request_id)

    # --- GenerateMixin ----------------------------------------------------------------------------

    def generate(self, prompts: TTSContext | list[TTSContext]) -> list[TextGenerationOutput]:
        """Runs contexts to completion in one batch (greedy or sampled per their settings)."""
        contexts = [prompts] if isinstance(prompts, TTSContext) else list(prompts)
        manager = self.kv_manager.block_manager
        ids = []
        try:
            for context in contexts:
                if context.request_id in manager:
                    raise ValueError(f"request {context.request_id!r} is already running")
                context.processed = manager.claim(context.request_id, context.all_tokens)
                ids.append(context.request_id)
            results = {c.request_id: TextGenerationOutput(c.request_id) for c in contexts}
            while active := [c for c in contexts if not c.is_done]:
                for context in active:
                    manager.alloc(context.request_id, context.total_length)
                outputs = self.execute(TextGenerationInputs.from_contexts(active))
                for context in active:
                    manager.step(context.request_id, context.all_tokens[:context.processed])
                for request_id, output in outputs.items():
                    results[request_id].tokens.extend(output.tokens)
                    results[request_id].final_status = output.final_status
            return [results[c.request_id] for c in contexts]
        finally:
            for request_id in ids:
                self.release(request_id)

    async def generate_async(self, prompts: TTSContext | list[TTSContext]) -> list[TextGenerationOutput]:
        """``generate`` on a worker thread, for use from an event loop."""
        return await asyncio.to_thread(self.generate, prompts)



def default_decode_buckets(device: Any, max_batch_size: int, *, cuda_graphs: bool) -> list[int]:
    """model.decode_buckets when unset: with CUDA graphs 1, 2, 4, 8, 16, 24, 32, then every 16 up to
    max_batch_size (each one graph); none otherwise, where exact shapes are cheaper than padding."""
    if device.type != "cuda" or not cuda_graphs:
        return []
    sizes = [1, 2, 4, 8, 16, 24, 32, *range(48, max_batch_size + 16, 16)]
    return sorted({min(size, max_batch_size) for size in sizes})


class OverlapTextGenerationPipeline(TextGenerationPipeline):
    """``submit`` starts the forward pass on a worker thread and returns at once; ``collect`` waits
    for it.

    The engine collects (and applies) the previous pass before it submits the next one, whose
    inputs are built from the applied tokens; everything else it does between steps overlaps the
    pass. With ``disable_overlap`` ``submit`` waits for its pass (then it behaves like
    TextGenerationPipeline).
    """

    def __init__(self, pipeline_config: "PipelineConfig", pipeline_model: "LlamaPipelineModel",
                 tokenizer: Any = None, disable_overlap: bool = False):
        super().__init__(pipeline_config, pipeline_model, tokenizer)
        self.disable_overlap = disable_overlap
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"overlap-{uuid.uuid4().hex[:6]}")
        self._pending: Future[StepResult] | None = None

    @property
    def overlap_active(self) -> bool:
        return not self.disable_overlap

    def has_pending_outputs(self) -> bool:
        return self._pending is not None

    def submit(self, inputs: TextGenerationInputs) -> None:
        with self._lock:
            if self._pending is not None:
                raise RuntimeError("the previous step's result was not collected")
            self._pending = self._executor.submit(self._compute, inputs)
            if self.disable_overlap:
                wait([self._pending])

    def collect(self) -> StepResult | None:
        """The pass in flight's result, once it is done (None if none is in flight); its error, if
        it failed."""
        with self._lock:
            if self._pending is None:
                return None
            pending, self._pending = self._pending, None
            return pending.result()

    def close(self) -> None:
        """Waits for the batch in flight and stops the worker thread."""
        with self._lock:
            if self._pending is not None:
                wait([self._pending])  # its result (or error) has no one left to take it
                self._pending = None
        self._executor.shutdown(wait=True)

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        try:
            self._executor.shutdown(wait=False)
        except Exception:  # noqa: BLE001
            pass
