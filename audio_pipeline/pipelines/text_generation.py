"""Speech-token generation steps: TextGenerationPipeline and OverlapTextGenerationPipeline.

A step takes scheduled items (a context, the tokens to compute from ``processed``, and whether to
sample after them): prefill chunks and decode tokens run in one ragged batch on the paged KV
cache, then every item that reached the end of its known tokens samples its next speech token.

``OverlapTextGenerationPipeline.execute`` starts the batch on a worker thread and returns the
outputs of the *previous* batch, so the caller's work between steps (scheduling, audio decoding,
delivery) overlaps the model's forward pass.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch

from audio_pipeline.context import StopReason, TTSContext
from audio_pipeline.pipelines.step_timing import StepTimer
from audio_pipeline.sampling import CandidateBatch, sample_next_tokens
from audio_pipeline.scheduler import apply_sample

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
    """One step's items (from the scheduler), and how many decode steps to run (pure decode only)."""

    items: list[Any] = field(default_factory=list)
    num_steps: int = 1

    @classmethod
    def from_contexts(cls, contexts: Sequence[TTSContext], num_steps: int = 1) -> "TextGenerationInputs":
        """Every context's unprocessed tokens, each followed by a sample."""
        return cls([BatchItem(c, c.processed, c.total_length - c.processed, True) for c in contexts], num_steps)

    @property
    def batch(self) -> list[TTSContext]:
        return [item.request for item in self.items]


@dataclass
class TextGenerationOutput:
    request_id: str
    tokens: list[int] = field(default_factory=list)
    final_status: StopReason | None = None


@dataclass
class _StepResult:
    items: list[Any]
    tokens: list[list[int]]


class TextGenerationPipeline:
    """Runs steps synchronously: ``execute`` returns the outputs of the batch it was given."""

    def __init__(self, pipeline_config: "PipelineConfig", pipeline_model: "LlamaPipelineModel", tokenizer: Any = None):
        self._pipeline_config = pipeline_config
        self.pipeline_model = pipeline_model
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        #: Seconds per step phase; the engine flushes it into its metrics.
        self.timer = StepTimer()

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
        return False

    # --- execution --------------------------------------------------------------------------------

    def execute(self, inputs: TextGenerationInputs) -> dict[str, TextGenerationOutput]:
        """Runs ``inputs`` and returns its outputs by request id."""
        with self._lock:
            result = self._compute(inputs)
            return self._apply(result)

    def _compute(self, inputs: TextGenerationInputs) -> _StepResult:
        """Forward passes and sampling; touches no context state except the sampling generators.

        Multi-step batches (num_steps > 1) append each step's tokens as they go.
        """
        items = [item for item in inputs.items if not item.request.is_done and item.num_tokens > 0]
        tokens: list[list[int]] = [[] for _ in items]
        if not items:
            return _StepResult(items, tokens)
        for item in items:
            if item.start != item.request.processed:
                raise RuntimeError(f"request {item.request.request_id}: step starts at {item.start} but "
                                   f"{item.request.processed} tokens are computed")
        if inputs.num_steps == 1:
            tokens = self._forward(items)
            return _StepResult(items, tokens)
        # Multi-step decoding: every step feeds each request's sampled token back in.
        active = list(range(len(items)))
        for step in range(inputs.num_steps):
            step_items = [items[i] if step == 0 else BatchItem(items[i].request, items[i].request.processed,
                                                               items[i].request.total_length
                                                               - items[i].request.processed, True)
                          for i in active]
            step_tokens = self._forward(step_items)
            for i, new in zip(active, step_tokens):
                tokens[i].extend(new)
                first = items[i] if step == 0 else step_items[active.index(i)]
                apply_sample(first.request, first.start, first.num_tokens, new)
            active = [i for i in active if not items[i].request.is_done]
            if not active:
                break
        # num_tokens=0 tells _apply that these tokens are already in their contexts.
        return _StepResult([BatchItem(it.request, it.start, 0, False) for it in items], tokens)

    def _forward(self, items: Sequence[Any]) -> list[list[int]]:
        model = self.pipeline_model
        timer = self.timer
        with timer.phase("inputs"):
            contexts = [item.request for item in items]
            for item in items:
                item.request.active_length = item.num_tokens
            model_inputs = model.prepare_initial_token_inputs(contexts, sample_rows=[item.sample for item in items])
            sampling = [item.request for item in items if item.sample]
            candidates = None
            if sampling:  # only the ids each request may produce next get logits
                candidates = CandidateBatch.build(sampling)
                model_inputs.candidate_ranges = candidates.ranges
                model_inputs.candidate_extra_ids = candidates.extra_ids.to(model_inputs.tokens.device)
        with timer.phase("model"):
            outputs = model.execute(model_inputs)
        timer.forwards += 1
        with timer.phase("sample"):
            sampled = iter(sample_next_tokens(outputs.next_token_logits, sampling, candidate_logits=True,
                                              candidates=candidates))
        return [[next(sampled)] if item.sample else [] for item in items]

    def _apply(self, result: _StepResult) -> dict[str, TextGenerationOutput]:
        """Writes a step's results into its contexts (through the scheduler's apply_sample, the one
        place tokens enter a request) as soon as the step is collected: the overlap pipeline builds
        the next step's inputs from them right after. Returns them by request id."""
        outputs: dict[str, TextGenerationOutput] = {}
        with self.timer.phase("update"):
            for item, tokens in zip(result.items, result.tokens):
                context = item.request
                if item.num_tokens:  # multi-step results are already applied
                    apply_sample(context, item.start, item.num_tokens, tokens)
                outputs[context.request_id] = TextGenerationOutput(context.request_id, list(tokens),
                                                                   context.stop_reason)
        return outputs

    def release(self, request_id: str) -> None:
        """Frees what the request holds in the KV cache (the scheduler normally does this)."""
        self.kv_manager.release(request_id)

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
                self._drain()
                outputs = self.execute(TextGenerationInputs.from_contexts(active))
                outputs.update(self._drain())
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

    def _drain(self) -> dict[str, TextGenerationOutput]:
        return {}


class OverlapTextGenerationPipeline(TextGenerationPipeline):
    """``execute`` returns the previous batch's outputs while the given batch runs in the background.

    With ``disable_overlap`` it synchronizes right after each batch (then it behaves like
    TextGenerationPipeline). Multi-step batches run one step at a time here.
    """

    def __init__(self, pipeline_config: "PipelineConfig", pipeline_model: "LlamaPipelineModel",
                 tokenizer: Any = None, disable_overlap: bool = False):
        super().__init__(pipeline_config, pipeline_model, tokenizer)
        self.disable_overlap = disable_overlap
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"overlap-{uuid.uuid4().hex[:6]}")
        self._pending: Future[_StepResult] | None = None

    @property
    def overlap_active(self) -> bool:
        return not self.disable_overlap

    def has_pending_outputs(self) -> bool:
        return self._pending is not None

    def execute(self, inputs: TextGenerationInputs) -> dict[str, TextGenerationOutput]:
        """Starts ``inputs`` and returns the outputs of the batch before it ({} if there was none)."""
        with self._lock:
            previous = self._collect()
            if inputs.items:
                # Inputs are prepared here, after the previous batch's tokens are applied.
                single = TextGenerationInputs(inputs.items, 1)
                self._pending = self._executor.submit(self._compute, single)
                if self.disable_overlap:
                    previous.update(self._collect())
            return previous

    def _collect(self) -> dict[str, TextGenerationOutput]:
        if self._pending is None:
            return {}
        pending, self._pending = self._pending, None
        return self._apply(pending.result())

    def _drain(self) -> dict[str, TextGenerationOutput]:
        with self._lock:
            return self._collect()

    def close(self) -> None:
        """Waits for the batch in flight and stops the worker thread."""
        with self._lock:
            if self._pending is not None:
                self._pending.result()
                self._pending = None
        self._executor.shutdown(wait=True)

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        try:
            self._executor.shutdown(wait=False)
        except Exception:  # noqa: BLE001
            pass
