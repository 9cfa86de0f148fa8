"""The engine around AudioGenerationScheduler, played by hand for the scheduler's tests (torch-free):
requests of the scheduler's documented duck type, a clock set by hand, a scheduler with a server's
knobs, and ``run_step``, which plays the model runner's part (one id sampled where the step samples)
and hands each result to the scheduler's update, which applies it.
"""

from dataclasses import dataclass, field

from audio_pipeline.config import PipelineConfig
from audio_pipeline.core.kv_cache.block_manager import BlockManager
from audio_pipeline.core.scheduler import AudioGenerationScheduler, SchedulerConfig, StepResult
from audio_pipeline.core.stop import StopReason


@dataclass(eq=False)
class Request:
    """A request of the scheduler's duck type: a prompt, a budget, what it generated."""

    request_id: str
    prompt: list[int]
    budget: int = 8
    arrival_time: float = 0.0
    generated: list[int] = field(default_factory=list)
    processed: int = 0
    stop_reason: StopReason | None = None
    #: A sampled id that ends the speech (not recorded).
    stop_id: int | None = None
    #: What the engine writes before each round under deadline scheduling (here: no deadline).
    continuation: bool = False
    deadline: float | None = None
    heard: bool = True
    passes_to_chunk: int = 0

    @property
    def cache_prompt(self):
        return self.prompt

    @property
    def cache_generated(self):
        return self.generated

    @property
    def cache_keys(self):
        return self.prompt + self.generated

    samples_alone = True

    def tokens_per_sample(self, position):
        return 1

    def append_sample(self, token):
        if token == self.stop_id:
            return StopReason.END_OF_SPEECH
        self.generated.append(token)
        return StopReason.MAX_TOKENS if len(self.generated) >= self.budget else None

    @property
    def all_tokens(self):
        return self.prompt + self.generated

    @property
    def total_length(self):
        return len(self.prompt) + len(self.generated)

    @property
    def max_length(self):
        return len(self.prompt) + self.budget

    @property
    def is_done(self):
        return self.stop_reason is not None


class Clock:
    """The scheduler's clock, set by hand (``clock.now``)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def make_scheduler(blocks=64, block_size=4, prefix=True, clock=None, **knobs):
    """A scheduler with ``knobs`` set as a server's configuration sets them (resolved for the CPU)."""
    manager = BlockManager(blocks, block_size, enable_prefix_caching=prefix)
    config = SchedulerConfig.from_config(PipelineConfig(**knobs).for_device("cpu"))
    return AudioGenerationScheduler(config, manager, clock=clock or Clock()), manager


def run_step(scheduler, output):
    """What the engine does with a step, for each of its forward passes in order (a multi-step
    decode has several): the runner computes the items of requests still going and samples
    1000 + (tokens generated) where an item samples; the scheduler's update applies the result.
    Returns what the updates let go."""
    finished = []
    for index, items in enumerate(output.steps):
        items = [item for item in items if not item.request.is_done]  # the runner skips ended requests
        for item in items:
            request = item.request
            assert item.start == request.processed, "a step must start where the KV cache ends"
            assert item.start + item.num_tokens <= request.total_length
            if item.sample:
                assert item.start + item.num_tokens == request.total_length, \
                    "samples only at the end of the known tokens"
        result = StepResult(items, [[1000 + len(i.request.generated)] if i.sample else [] for i in items])
        finished += scheduler.update(output, result, last=index == output.num_steps - 1)
    return finished


def drain(scheduler, limit=500):
    """Schedules and runs steps until every request has finished; the steps that held items."""
    kinds = []
    for _ in range(limit):
        output = scheduler.schedule()
        if not output.items:
            if not scheduler.num_running and not scheduler.num_waiting:
                return kinds
            continue
        kinds.append(output)
        run_step(scheduler, output)
    raise AssertionError("the scheduler did not finish its requests")


def prompt(n, base=0):
    """``n`` prompt ids from ``base`` on."""
    return list(range(base, base + n))
