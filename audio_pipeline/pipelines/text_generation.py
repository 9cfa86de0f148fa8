"""Speech-token generation: TextGenerationPipeline (the seed's GenerateMixin over the model runner)
and OverlapTextGenerationPipeline (the same, with steps launched ahead of their results).

A step takes scheduled items (a context, the tokens to compute from ``start``, and whether to
sample after them): prefill chunks and decode tokens run in one ragged batch on the paged KV
cache, then every item that reached the end of its known tokens samples its next speech token. The
pipeline's :class:`~audio_pipeline.pipelines.model_runner.ModelRunner` launches a step and hands back
what it sampled, as plain data, when asked; it never writes a request. The engine applies results
through ``scheduler.update``, the one place tokens enter requests; ``execute`` and ``generate``
(for use without an engine) apply them with the same rule (:func:`~audio_pipeline.scheduler.apply_step`).

With overlap (``OverlapTextGenerationPipeline``, ``enable_overlap_scheduler``) the engine launches
step n + 1 before it reads step n's result: the runner takes the tokens step n sampled from the
device. On CUDA the device runs ahead by itself; on the CPU the runner's worker thread does.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from audio_pipeline.context import StopReason, TTSContext
from audio_pipeline.defaults import DEFAULT_MAX_BATCH_SIZE
from audio_pipeline.pipelines.model_runner import ModelRunner
from audio_pipeline.pipelines.step_timing import StepTimer
from audio_pipeline.scheduler import ScheduledItem, apply_step

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from audio_pipeline.config import PipelineConfig
    from audio_pipeline.models.llama_model import LlamaPipelineModel


@dataclass
class TextGenerationInputs:
    """One forward pass's items (from the scheduler)."""

    items: list[ScheduledItem] = field(default_factory=list)

    @classmethod
    def from_contexts(cls, contexts: Sequence[TTSContext]) -> "TextGenerationInputs":
        """Every context's unprocessed tokens, each followed by a sample."""
        return cls([ScheduledItem(c, c.processed, c.total_length - c.processed, True) for c in contexts])

    @property
    def batch(self) -> list[TTSContext]:
        return [item.request for item in self.items]


@dataclass
class TextGenerationOutput:
    request_id: str
    tokens: list[int] = field(default_factory=list)
    final_status: StopReason | None = None


class TextGenerationPipeline:
    """Steps of the speech-token LM: ``execute`` runs and applies one, ``runner`` launches them."""

    #: Whether the engine launches the next step before reading this one's result.
    overlap_active = False

    def __init__(self, pipeline_config: "PipelineConfig", pipeline_model: "LlamaPipelineModel", tokenizer: Any = None):
        self._pipeline_config = pipeline_config
        self.pipeline_model = pipeline_model
        self._tokenizer = tokenizer
        #: Seconds per step phase; the engine flushes it into its metrics.
        self.timer = StepTimer()
        self._runner: ModelRunner | None = None

    def runner(self, layout: Any) -> ModelRunner:
        """The model runner (built on first use, for the requests' layout)."""
        if self._runner is None:
            model_config = self._pipeline_config.model
            device = self.pipeline_model.devices[0]
            # Graphs replay FlashInfer's decode kernel; the torch form's shapes change every step.
            graphs = model_config.cuda_graphs and self.kv_manager.backend.name == "flashinfer"
            if model_config.cuda_graphs and device.type == "cuda" and not graphs:
                logger.warning("model.cuda_graphs: off, the %s attention kernel cannot be captured (flashinfer "
                               "can)", self.kv_manager.backend.name)
            buckets = model_config.decode_buckets
            if buckets is None:
                buckets = default_decode_buckets(device, self._pipeline_config.max_batch_size or DEFAULT_MAX_BATCH_SIZE,
                                                 cuda_graphs=graphs)
            self._runner = ModelRunner(self.pipeline_model, layout, decode_buckets=buckets,
                                       cuda_graphs=graphs, timer=self.timer,
                                       worker=self.overlap_active and device.type == "cpu")
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

    # --- execution --------------------------------------------------------------------------------

    def execute(self, inputs: TextGenerationInputs) -> dict[str, TextGenerationOutput]:
        """Runs ``inputs``, applies the result to its contexts and returns it by request id (the
        seed's GenerateMixin; the engine launches through ``runner`` and applies through its
        scheduler's update instead)."""
        items = [item for item in inputs.items if not item.request.is_done and item.num_tokens > 0]
        if not items:
            return {}
        result = self.runner(items[0].request.layout).launch(items).result()
        apply_step(result)
        return {item.request.request_id: TextGenerationOutput(item.request.request_id, list(tokens),
                                                              item.request.stop_reason)
                for item, tokens in zip(result.items, result.tokens)}

    def release(self, request_id: str) -> None:
        """Frees what the request holds: its KV cache (the scheduler normally does this) and the
        model runner's state of it."""
        self.kv_manager.release(request_id)
        self.forget(request_id)

    def forget(self, request_id: str) -> None:
        """Frees the model runner's state of a finished request (its repetition counts)."""
        if self._runner is not None:
            self._runner.release(request_id)

    def close(self) -> None:
        """Waits for the steps in flight and stops the runner's worker, if any."""
        if self._runner is not None:
            self._runner.close()

    # --- GenerateMixin ----------------------------------------------------------------------------

    def generate(self, prompts: TTSContext | list[TTSContext]) -> list[TextGenerationOutput]:
        """Runs contexts to completion in one batch (greedy or sampled per their settings).

        Blocks come from the KV manager's block manager as the engine's scheduler would take them
        (claim with prefix caching, allocate before each step, commit after it, release at the end).
        """
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


class OverlapTextGenerationPipeline(TextGenerationPipeline):
    """The engine launches step n + 1 before it reads step n's result (see the module docstring)."""

    overlap_active = True


def default_decode_buckets(device: Any, max_batch_size: int, *, cuda_graphs: bool) -> list[int]:
    """model.decode_buckets when unset: with CUDA graphs 1, 2, 4, 8, 16, 24, 32, then every 16 up to
    max_batch_size (each one graph); none otherwise, where exact shapes are cheaper than padding."""
    if device.type != "cuda" or not cuda_graphs:
        return []
    sizes = [1, 2, 4, 8, 16, 24, 32, *range(48, max_batch_size + 16, 16)]
    return sorted({min(size, max_batch_size) for size in sizes})
