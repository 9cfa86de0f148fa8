"""TextGenerationPipeline: runs generation steps for a batch of contexts and samples their tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from audio_pipeline.context import StopReason, TTSContext
from audio_pipeline.sampling import sample_next_tokens

if TYPE_CHECKING:
    from audio_pipeline.config import PipelineConfig
    from audio_pipeline.models.llama_model import LlamaPipelineModel


@dataclass
class TextGenerationInputs:
    """The contexts to advance, and how many tokens each may generate in this call."""

    batch: list[TTSContext]
    num_steps: int = 1


@dataclass
class TextGenerationOutput:
    request_id: str
    tokens: list[int] = field(default_factory=list)
    final_status: StopReason | None = None


class TextGenerationPipeline:
    """Prefill and decode in one ragged batch: new contexts bring their prompt, others one token."""

    def __init__(self, pipeline_config: "PipelineConfig", pipeline_model: "LlamaPipelineModel"):
        self._pipeline_config = pipeline_config
        self.pipeline_model = pipeline_model

    @property
    def pipeline_config(self) -> "PipelineConfig":
        return self._pipeline_config

    @property
    def kv_manager(self):
        return self.pipeline_model.kv_manager

    @property
    def kv_managers(self) -> list:
        return [self.kv_manager]

    def execute(self, inputs: TextGenerationInputs) -> dict[str, TextGenerationOutput]:
        """Advances every context in ``inputs.batch`` by up to ``num_steps`` tokens."""
        outputs = {c.request_id: TextGenerationOutput(c.request_id) for c in inputs.batch}
        active = [c for c in inputs.batch if not c.is_done]
        model_inputs = self.pipeline_model.prepare_initial_token_inputs(active) if active else None
        for step in range(inputs.num_steps):
            if not active:
                break
            result = self.pipeline_model.execute(model_inputs)
            for context in active:
                context.processed = context.total_length
            tokens = sample_next_tokens(result.next_token_logits, active)
            for context, token in zip(active, tokens):
                context.append_token(token)
                outputs[context.request_id].tokens.append(token)
            remaining = [c for c in active if not c.is_done]
            if remaining and step + 1 < inputs.num_steps:
                model_inputs = self.pipeline_model.prepare_initial_token_inputs(remaining)
            active = remaining
        for context in inputs.batch:
            outputs[context.request_id].final_status = context.stop_reason
        return outputs

    def release(self, request_id: str) -> None:
        """Frees what the request holds in the KV cache."""
        self.kv_manager.release(request_id)
