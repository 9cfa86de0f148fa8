"""Speech-token generation: TextGenerationPipeline (the seed's GenerateMixin over the model runner)
and OverlapTextGenerationPipeline (the same, with steps launched ahead of their results).

A step takes scheduled items (a context, the tokens to compute from ``start``, and whether to
sample after them): prefill chunks and decode tokens run in one ragged batch on the paged KV
cache, then every item that reached the end of its known tokens samples its next speech token. The
pipeline's :class:`~audio_pipeline.core.model_runner.ModelRunner` launches a step and hands back
what it sampled, as plain data, when asked; it never writes a request. Results enter requests only
through the scheduler's update: the engine's loop and ``generate`` (for use without an engine) both
run schedule -> runner -> update.

With overlap (``OverlapTextGenerationPipeline``, ``enable_overlap_scheduler``) the engine launches
step n + 1 before it reads step n's result: the runner takes the tokens step n sampled from the
device. On CUDA the device runs ahead by itself; on the CPU the runner's worker thread does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from audio_pipeline.core.request import TTSContext

from audio_pipeline.core.stop import StopReason
from audio_pipeline.defaults import DEFAULT_MAX_BATCH_SIZE
from audio_pipeline.core.kv_cache.block_manager import KVCacheFull
from audio_pipeline.core.model_runner import ModelRunner
from audio_pipeline.core.step_timing import StepTimer
from audio_pipeline.core.scheduler import AudioGenerationScheduler, SchedulerConfig

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from audio_pipeline.config import PipelineConfig
    from audio_pipeline.models.llama_model import LlamaPipelineModel


@dataclass
class TextGenerationOutput:
    """What ``generate`` made of one context: every id it sampled, and why it ended."""

    request_id: str
    tokens: list[int] = field(default_factory=list)
    final_status: StopReason | None = None


class TextGenerationPipeline:
    """Steps of the speech-token LM: ``runner`` launches them, ``generate`` runs contexts to the end."""

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
        """Runs contexts to completion together (greedy or sampled per their settings), as the
        engine runs them: a scheduler of their own over the KV cache's blocks plans each step (with
        the configured knobs: prefix caching, chunked prefill, multi-step decode, preemption), the
        runner computes it, and the scheduler's update applies it and ends the requests."""
        contexts = [prompts] if isinstance(prompts, TTSContext) else list(prompts)
        if not contexts:
            return []
        manager = self.kv_manager.block_manager
        for context in contexts:
            if context.request_id in manager:
                raise ValueError(f"request {context.request_id!r} is already running")
        config = SchedulerConfig.from_config(self._pipeline_config, max_batch_size=len(contexts),
                                             max_queue_size=len(contexts))
        # Every prompt is here from the start: waiting for others to join a prefill would only stall.
        scheduler = AudioGenerationScheduler(dataclasses.replace(config, ce_delay_ms=0.0), manager)
        runner = self.runner(contexts[0].layout)
        results = {c.request_id: TextGenerationOutput(c.request_id) for c in contexts}
        try:
            for context in contexts:
                scheduler.add(context)
            while scheduler.num_waiting or scheduler.num_running:
                output = scheduler.schedule()
                finished = list(output.finished)
                if not output.items and not finished:  # nothing runs and nothing changes: it never will
                    raise KVCacheFull("the KV cache has no room for the next step of these requests")
                for index, items in enumerate(output.steps):
                    result = runner.launch(items).result()
                    for item, tokens in zip(result.items, result.tokens):
                        results[item.request.request_id].tokens.extend(tokens)
                    finished += scheduler.update(output, result, last=index == output.num_steps - 1)
                for done in finished:
                    results[done.request.request_id].final_status = done.reason
            return [results[c.request_id] for c in contexts]
        finally:
            for context in contexts:  # what an error left behind
                scheduler.remove(context.request_id)
                self.forget(context.request_id)

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
