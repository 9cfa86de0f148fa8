"""Engine configuration (after MAX's `config` module): PipelineConfig, AudioGenerationConfig, their parts.

Values come from, later winning: field defaults < the model's streaming and sampling defaults < ``config_file``
< ``AUDIO_PIPELINE_*`` environment variables < keyword arguments < ``NAME=VALUE`` audio flags.
``AudioGenerationConfig.load`` reads all of them (the sources are in ``sources.py``);
``resolve()`` checks the rules that span fields, once construction is done. Every field acts:
one that nothing would read is not a field, so setting it is refused as an unknown key.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from enum import Enum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, InitSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict
from typing_extensions import Self

import audio_pipeline.config.sources as sources
from audio_pipeline.config.defaults import DEFAULT_PAGE_SIZE, device_defaults

#: The model served when none is named: the built-in voice shipped in the package (audio_pipeline/builtin/).
DEFAULT_MODEL = "builtin:slt-en-v5"

_logger = logging.getLogger(__name__)
#: Every part refuses unknown keys, checks assignments, and takes no infinite or NaN number.
_SETTINGS = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def problems_message(problems: list[str]) -> str:
    """What a ValueError about the configuration says: its one problem, or every one listed."""
    return problems[0] if len(problems) == 1 else "invalid configuration:\n" + "\n".join(f"  - {p}" for p in problems)


def _describe(exc: ValidationError) -> str:
    """pydantic's errors as this module words its own: one line per field, named by its dotted path."""
    lines = []
    for error in exc.errors():
        key = ".".join(map(str, error["loc"]))
        if error["type"] == "extra_forbidden":
            lines.append(f"unknown configuration key {key!r}{sources.unknown_key_hint(key)}")
        else:
            message = error["msg"].removeprefix("Value error, ")
            lines.append(f"invalid value {error['input']!r} for {key}: {message}")
    return problems_message(lines)


class _ValueEnum(str, Enum):
    def __str__(self) -> str:
        return self.value


class PrependPromptSpeechTokens(_ValueEnum):
    """Whether the voice prompt's speech tokens go to the audio decoder as context."""

    NEVER = "never"
    """Never prepend the prompt speech tokens sent to the audio decoder."""
    ONCE = "once"
    """Prepend the prompt speech tokens to the first block of the audio decoder."""
    ROLLING = "rolling"
    """Prepend them to the first block, and to later blocks to reach the requested buffer size."""


class EngineProcess(_ValueEnum):
    """Where a server's engine core runs."""

    AUTO = "auto"
    """The measured best of the device: today a process of its own on the CPU and on CUDA
    (docs/performance.md)."""
    SUBPROCESS = "subprocess"
    """A process of its own: the doors, encoders and request preparation never share its interpreter."""
    IN_PROCESS = "in_process"
    """Threads of the server's own process."""


class PrometheusMetricsMode(_ValueEnum):
    """How Prometheus metrics are exposed."""

    INSTRUMENT_ONLY = "instrument_only"
    """Record metrics; the application serves them."""
    LAUNCH_SERVER = "launch_server"
    """Start a Prometheus HTTP server for the metrics."""
    LAUNCH_MULTIPROC_SERVER = "launch_multiproc_server"
    """Start a Prometheus server in multiprocess mode."""


class KVCacheConfig(BaseModel):
    """The paged KV cache."""

    model_config = _SETTINGS
    kv_cache_page_size: int | None = Field(
        None, ge=1, description="Tokens per KV cache page; None takes the device's default: 128 on CPU (16, 64 and "
        "128 measured alike there), 16 on CUDA (FlashInfer's usual page).")
    enable_prefix_caching: bool = Field(True, description="Reuse cached pages of prompts that share a prefix.")
    device_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Fraction of free memory the KV cache may take: on CUDA of the GPU's free "
        "memory once the weights and the decoder are loaded, less the steps' activations; on the CPU of the "
        "machine's available memory.")
    kv_cache_memory_bytes: int | None = Field(
        None, ge=1, description="KV cache size in bytes (fixed); None = at most room for max_batch_size sequences of "
        "max_length and the free memory device_memory_utilization allows: on CUDA that much up front, on the CPU "
        "room for each row's first 256 tokens, grown on demand (doubling) up to it.")
    cache_dtype: Literal["auto", "float32", "bfloat16", "float16", "fp8_e4m3"] = Field(
        "auto", description="KV cache dtype: auto is float16 for a float32 model on CPU where the native attention "
        "kernel serves (it widens the cache as it reads it: half the bytes a decode step's attention reads; faster "
        "through the server, logits within 0.02 of a float32 cache on the built-in voice), else the model's dtype; "
        "float16 and bfloat16 run in the native kernel on CPU; fp8_e4m3 halves the cache of a 16-bit model and needs "
        "the flashinfer attention kernel (CUDA).")
    attention_kernel: Literal["auto", "native", "flashinfer", "torch"] = Field(
        "auto", description="Paged attention: native (a C++ CPU kernel that reads the cache in place, built on "
        "first use; needs a C++ compiler, a float32 model and a float32, float16 or bfloat16 cache), flashinfer "
        "(FlashInfer's kernels on CUDA; the gpu extra), torch (one gather and one scaled_dot_product_attention per "
        "layer; any device and dtype), or auto (flashinfer on CUDA where installed, native on CPU with a float32 "
        "model where it builds, else torch).")
    prefill_backend: Literal["auto", "fa2", "fa3"] = Field(
        "auto", description="FlashInfer's kernel for steps with prompt tokens (CUDA, flashinfer attention): auto "
        "(FlashInfer's choice: FA3 on Hopper GPUs where it has the kernel for the dtypes, else FA2), fa2, or fa3 "
        "(Hopper only). Each is built on first use unless its prebuilt kernel is installed.")

    def page_size_for(self, device_type: str) -> int:
        """The page size in force on a device of ``device_type`` ('cpu', 'cuda')."""
        return self.kv_cache_page_size or DEFAULT_PAGE_SIZE.get(device_type, DEFAULT_PAGE_SIZE["cpu"])


class ModelConfig(BaseModel):
    """Which model to load and how."""

    model_config = ConfigDict(**_SETTINGS, protected_namespaces=())
    model_path: str = Field(DEFAULT_MODEL, description="A local Hugging Face model directory or a builtin:NAME model.")
    served_model_name: str | None = Field(None, description="The model name clients see (HTTP /v1/models); None: model_path.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weight and activation dtype; auto picks bfloat16 on GPU and float32 on CPU. An explicit "
        "dtype holds for prompt positions' products too (model.prompt_dtype=auto follows it).")
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N; auto uses the GPU when there is one.")
    packed_linears: bool | None = Field(
        None, description="On CPU, run every product of a decode step (the decoder layers', with q/k/v and gate/up "
        "fused into one product each; the candidate logits' range of the output projection; a frame model's depth "
        "head) on copies of the weights packed for a row-stable kernel instead of torch's BLAS: the native one "
        "(built on first use, like the attention kernel), or oneDNN's where that cannot be built. A row's result is "
        "then the same bits at any number of rows (the BLAS rounds 1, 2-3 and 4+ rows three ways), so a seeded "
        "stream's speech never depends on its batch; with the native kernel a Llama layer's other operations run "
        "natively too (two calls a layer). None = on for a float32 model where either kernel runs and the layers' "
        "weights come to at most 1 GiB (the copy doubles them); not with model.compile. false: the BLAS and torch "
        "operations. The figures: docs/performance-history.md, The built-in voice on the CPU.")
    prompt_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="Dtype of the decoder layers' matrix products at prompt positions (prefill), whatever "
        "step they run in; every other position runs in model.dtype. auto: where model.dtype is auto too, bfloat16 "
        "for a float32 model on a CPU that multiplies bfloat16 in hardware (AVX512-BF16 or AMX), else model.dtype; "
        "an explicit model.dtype (--dtype float32) is followed, so the model's dtype holds throughout and greedy "
        "speech does not depend on the CPU. The start-up log says what auto chose and why. On 2 Zen 4 cores, 64 "
        "streams of the built-in voice started at once: TTFA p99 245 and 257 ms -> 209 and 210 ms through the "
        "server, its validation WER 30.7 -> 31.0 %, MCD 4.01 dB either way. Keeps a bfloat16 copy of those "
        "weights. Chosen by position, so a request's speech does not depend on its batch, given the float32 "
        "products beside it are row-stable too (model.packed_linears, on by default).")
    num_threads: int | None = Field(
        None, ge=1, description="Intra-op threads of the engine (torch.set_num_threads); None = 1 on CPU, which "
        "measured fastest for this engine's small steps, and torch's default on GPU.")
    prefill_threads: int | None = Field(
        None, ge=1, description="On CPU, intra-op threads of a step that computes 256 tokens or more (prompts "
        "arriving together), which splits well over cores; the engine's num_threads again after it. None = the "
        "machine's cores, at most 4.")
    compile: bool = Field(
        False, description="torch.compile the model's forward pass (dynamic shapes). Needs a C++ compiler on CPU "
        "and adds about a minute to start-up. Off by default: on 2 CPU cores a lone batch-1 forward got 2.8x "
        "faster, but through the server (ragged steps of changing shapes) the model phase went 4.6 -> 4.3 ms "
        "per forward at 1 stream and 17 -> 29 ms at 16 streams. With decode_buckets set it compiles with static "
        "shapes instead (dynamic=False): each bucket's decode step is one static graph, and every other step "
        "(prompts, steps above the largest bucket) runs the eager module, so no length recompiles. Measured through "
        "the server (buckets 1,2,4,8,16,24,32, 3 rounds): model phase 6.0 and 7.5 ms per pass at 32 streams against "
        "5.5 eager (24-29x real time against 31.5x): the attention call breaks each layer's graph, so no gain.")
    quantization: Literal["none", "int8"] = Field(
        "none", description="int8: dynamic int8 quantization (torch.ao.quantization.quantize_dynamic: int8 "
        "weights, activations quantized per step) of the decoder layers' linear layers (q/k/v/o, gate/up/down; "
        "never the embedding or lm_head). CPU and a float32 model only; refused otherwise. Measured through the "
        "server on the built-in voice (2 cores): model phase 5.6 -> 3.8-4.1 ms per pass and 31.6-32.0x -> "
        "37.6-39.9x real time at 32 streams, 3.0 -> 2.3-2.6 ms at 16, but 0.77 -> 0.92 ms at 1 stream; logits "
        "move by up to 3.4 and greedy output departs from float32 after a few to tens of tokens, so it is "
        "off by default (a throughput setting for many streams).")
    kv_cache: KVCacheConfig = Field(default_factory=KVCacheConfig, description="The paged KV cache.")
    decode_buckets: sources.CommaList[list[Annotated[int, Field(ge=1)]] | None] = Field(
        None, description="Batch sizes decode steps are padded to (static shapes: on CUDA each is captured once as "
        "a CUDA graph); a step larger than the largest runs unpadded. None: with CUDA graphs 1, 2, 4, 8, 16, 24, 32 "
        "and then every 16 up to max_batch_size; otherwise none (exact shapes run faster without graphs).")
    cuda_graphs: bool = Field(
        True, description="On CUDA with the flashinfer attention kernel, replay each decode bucket's forward pass "
        "from a captured CUDA graph instead of launching its kernels from Python; for a frame model (Qwen3-TTS, "
        "CSM) also its depth decoder's whole frame, one graph per bucket and sampling rule (captured at start-up).")
    sample_graphs: bool = Field(
        True, description="With model.cuda_graphs, also replay a decode step's token sampling (candidate logits, "
        "penalties, the sampling rule, the draw) from a CUDA graph per bucket and rule, for layouts whose frame "
        "slots' codebooks are one range of the vocabulary (Orpheus, Maya1); the same ids as the eager sampling. "
        "False samples eagerly (for comparison).")
    fuse_layers: bool = Field(
        True, description="On CUDA, run each Llama block with fewer, larger kernels: the query/key/value "
        "projections as one matrix product and the MLP's gate/up projections as another (their weights "
        "concatenated at load), the queries and keys rotated together, and RMSNorm as torch's rms_norm with its "
        "weight (one kernel each). The same results up to float rounding; false "
        "runs the checkpoint's layers one by one (for comparison). On the CPU it applies with model.packed_linears "
        "(where the fused products are the separate ones' bits, save calls, and the native layer calls need them); "
        "with the BLAS the CPU runs them one by one.")

    @field_validator("quantization", mode="before")
    @classmethod
    def _none_is_a_value(cls, value):
        return "none" if value is None else value  # the flag source reads "none" as None

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        if not _DEVICE.fullmatch(value):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {value!r}")
        return value


#: MAX's name for ModelConfig.
MAXModelConfig = ModelConfig


class SamplingConfig(BaseModel):
    """Server-wide sampling defaults; a request may override each of them. A model family may
    default some otherwise (its Family record's sampling, layouts/registry.py), below every source."""

    model_config = _SETTINGS
    temperature: float = Field(0.6, ge=0, description="Softmax temperature; 0 is greedy.")
    top_p: float = Field(0.95, gt=0, le=1, description="Nucleus sampling probability mass.")
    top_k: int = Field(-1, description="Sample from the k most likely tokens; -1 = all.")
    min_p: float = Field(0.0, ge=0, le=1, description="Drop tokens below min_p times the top probability.")
    repetition_penalty: float = Field(1.1, ge=0.01, le=100, description="Divides logits of tokens already generated (>1 penalizes); 0.01 to 100.")
    frequency_penalty: float = Field(0.0, ge=-2, le=2, description="Subtracted per earlier occurrence of a token.")
    presence_penalty: float = Field(0.0, ge=-2, le=2, description="Subtracted once from every token already generated.")
    max_tokens: int = Field(1200, ge=1, description="Speech tokens generated per request unless it asks otherwise.")
    max_tokens_limit: int = Field(4096, ge=1, description="The largest max_tokens a request may ask for.")
    min_tokens: int = Field(0, ge=0, description="Speech tokens generated before end of speech is allowed.")
    seed: int | None = Field(None, description="Seed of the default random generator; None = nondeterministic.")
    stop_token_ids: sources.CommaList[list[int]] = Field(
        default_factory=list, description="Extra token ids that end the speech (end-of-speech always does).")
    max_text_chars: int = Field(
        100_000, ge=1, description="Longest request text, in characters; a text is spoken sentence by sentence, "
                                   "as one audio stream.")

    @field_validator("top_k")
    @classmethod
    def _check_top_k(cls, value: int) -> int:
        if value != -1 and value < 1:
            raise ValueError(f"top_k must be -1 (off) or at least 1, got {value}")
        return value


class PipelineConfig(BaseSettings):
    """Configuration of a pipeline: model, batching, scheduling, sampling defaults.

    Construction reads the keyword arguments over ``config_file`` (and the model's streaming and
    sampling defaults), not the environment: a configuration built in code stays what the code says.
    ``load`` adds the environment and flags. Construction then runs ``resolve()``. Assignment
    checks the field alone: call ``resolve()`` after changing fields. ``model_validate`` neither
    reads ``config_file`` nor resolves: construct instead.
    """

    model_config = SettingsConfigDict(
        **_SETTINGS, env_prefix=sources.ENV_PREFIX, env_nested_delimiter="__", env_parse_none_str="none")
    config_file: str | None = Field(None, description="YAML or TOML file of values, above defaults and below env.")
    section_name: str | None = Field(None, description="Top-level section of config_file to read; None = all of it.")
    max_length: int | None = Field(None, ge=1, description="Longest sequence (prompt + output); None = the model's.")
    max_batch_size: int | None = Field(None, ge=1, description="Most requests per decode step; None = 32 on the CPU, 256 on CUDA (at "
                                          "most max_queue_size_tg and max_batch_input_tokens).")
    max_queue_size_tg: int | None = Field(
        None, ge=1, description="Most requests admitted to decode (holding KV blocks) at once; None = max_batch_size.")
    max_queue_size: int | None = Field(
        None, ge=1, description="Most requests waiting for admission; more get RESOURCE_EXHAUSTED. None = 256 on the "
        "CPU and on CUDA.")
    min_batch_size_tg: int | None = Field(
        None, ge=1, description="Soft floor of the decode batch: below it, prefill is preferred; None = no floor.")
    ce_delay_ms: float = Field(0.0, ge=0, description="Wait this long for more prompts before a prefill step.")
    enable_prioritize_first_decode: bool = Field(False, description="Decode right after prefill: faster first audio.")
    enable_chunked_prefill: bool = Field(True, description="Split prompts that do not fit a step's token budget across steps.")
    enable_in_flight_batching: bool | None = Field(
        None, description="Mix prefill tokens into decode steps; None = off on the CPU, on on CUDA (where "
        "enable_chunked_prefill allows it).")
    max_num_steps: int = Field(
        -1, description="Decode steps per scheduling round; -1 = the scheduler chooses (1 while prompts wait that "
        "may be admitted, else 4), on the CPU and on CUDA; with enable_overlap_scheduler always 1.")
    max_batch_input_tokens: int = Field(8192, ge=1, description="Most prompt tokens prefilled in one step.")
    kvcache_ce_watermark: float = Field(
        0.95, gt=0, le=1, description="Admit prompts only while this fraction of the KV cache would not be exceeded.")
    enable_overlap_scheduler: bool | None = Field(
        None, description="Launch the next step before this one's tokens are read back; None = off on the CPU, on "
        "on CUDA (unless max_num_steps is above 1).")
    deadline_scheduling: bool | None = Field(
        None, description="None = on on the CPU, off on CUDA (not measured on a GPU yet). Order and size each step by the streams' playback deadlines (when each listener would "
        "run out of audio): the rows closest to running dry first where the batch cannot hold all, multi-step "
        "rounds cut where a new stream's first chunk is due, and prefill steps no longer than the least slack of "
        "the streams already heard allows (a new request waits rather than a running stream stalls).")
    max_queue_wait_ms: float | None = Field(
        2000.0, gt=0, description="A new request is refused (RESOURCE_EXHAUSTED, HTTP 429) while the oldest request "
        "waiting for admission has waited longer than this: the server is past its capacity, and one more would "
        "only wait longer (with deadline_scheduling, prompts wait rather than running streams stall). None: "
        "only a full queue (max_queue_size) refuses.")
    first_audio_target_ms: float = Field(
        100.0, ge=0, description="With deadline_scheduling, the deadline of a request not heard yet: its arrival "
        "plus this; and how long prompts in line may wait for one prefill step that takes them all, where the "
        "running streams' slack holds only some of them.")
    deadline_margin_ms: float = Field(
        20.0, ge=0, description="With deadline_scheduling, audio a stream keeps in reserve: the time between a chunk "
        "leaving the engine and its listener playing it (encoding, resampling, the network).")
    text_wait_lead_ms: float | None = Field(
        500.0, ge=0, description="A model that reads text as it comes (Kyutai TTS) pads while live text has no next "
        "word yet; it does so only while its listener has less than this much audio left, so a pause in the text "
        "is heard about as long as it was (plus the model's text-to-audio delay). None: it pads as fast as it runs "
        "(a one-second pause in the text became 15 s of silence on 2 cores).")
    rate_admission: bool | None = Field(
        None, description="None = on on the CPU, off on CUDA (not measured on a GPU yet). A request that starts a "
        "stream is admitted only while every running stream, with it, would still gain audio admission_headroom "
        "faster than real time: the decode passes a second the engine made over its last second of work "
        "(prefill, the audio decoder, the host's other work and the machine's other processes included) times "
        "the audio a pass adds to a stream. Past that it waits in the queue (and max_queue_wait_ms refuses new "
        "requests) rather than every stream stalling. A later piece of a running stream's text is never held back. "
        "Off: admit whatever the KV cache and max_queue_size_tg allow.")
    admission_headroom: float = Field(
        0.8, ge=0, description="With rate_admission, how much faster than real time the running streams must go on "
        "gaining audio with one more (0.8: 1.8x). Measured on 2 cores with the built-in voice, open loop at 6 and "
        "8 requests a second: 0.8 left 4-10 % and 10-38 % of the served requests with a stall (0.5: 35-43 %, "
        "18-51 %; off: 67-88 %, 99-100 %).")

    model: ModelConfig = Field(default_factory=ModelConfig, description="The model served.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="Sampling defaults.")

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ValueError(_describe(exc)) from None
        # Here rather than in model_post_init, where pydantic would bury the message in a ValidationError.
        self.resolve()

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   **_: PydanticBaseSettingsSource) -> tuple[PydanticBaseSettingsSource, ...]:
        """Plain construction: keyword arguments over ``config_file`` over the model's defaults."""
        return init_settings, sources.ConfigFileSource(settings_cls), sources.ModelDefaultsSource(settings_cls)

    @field_validator("max_num_steps")
    @classmethod
    def _check_max_num_steps(cls, value: int) -> int:
        if value != -1 and value < 1:
            raise ValueError(f"max_num_steps must be -1 (engine's choice) or at least 1, got {value}")
        return value

    @classmethod
    def load(cls, *, config_file: str | None = None, section_name: str | None = None,
             env: Mapping[str, str] | None = None, audio_flags: Iterable[str] | Mapping[str, Any] = (),
             **overrides: Any) -> Self:
        """Builds the configuration from every source; later sources win.

        defaults < the model's streaming and sampling defaults < config file < ``AUDIO_PIPELINE_*`` variables of
        ``env`` (default ``os.environ``) < ``config_file``/``section_name``/``overrides`` (nested
        dicts) < ``audio_flags`` (NAME=VALUE strings). The file is the one named by the highest
        source that names one. An unknown key in any source is refused, naming the key and source.
        """
        explicit = {"config_file": config_file, "section_name": section_name}
        kwargs = {**{key: value for key, value in explicit.items() if value is not None}, **overrides}
        sources.check_keys(cls, kwargs, "keyword argument")
        order = (sources.FlagSource(cls, audio_flags), InitSettingsSource(cls, kwargs),
                 sources.EnvironSource(cls, env), sources.ConfigFileSource(cls), sources.ModelDefaultsSource(cls))
        return cls(_build_sources=(order, kwargs))

    @classmethod
    def from_flags(cls, audio_flags: Iterable[str] | Mapping[str, Any], **config_flags: Any) -> Self:
        """Builds the configuration from ``--task-arg`` NAME=VALUE strings (or MAX's dictionary of
        NAME -> VALUE) over plain keyword fields.

        ``audio_flags`` win over ``config_flags`` (they are the more specific). Names take ``-`` or
        ``_`` and dots for nested fields (``sampling.temperature=0.5``); ``audio_decoder_config.KEY``
        sets one decoder setting. Environment variables are not read (``load`` reads them).
        """
        return cls.load(env={}, audio_flags=audio_flags, **config_flags)

    @classmethod
    def _model_defaults(cls, chosen: Mapping[str, Any]) -> dict[str, Any]:
        """Defaults that depend on the model ``chosen`` (the merged sources) names (see subclasses)."""
        return {}

    def for_device(self, device_type: str) -> Self:
        """This configuration with its open values (None) made the ones the engine uses on a device
        of ``device_type`` ('cpu', 'cuda'; see config/defaults.py), checked again. The engine calls
        it once as it starts; nothing below it reads a None for these."""
        defaults = device_defaults(device_type)
        update = {name: value for name, value in defaults.items()
                  if name in type(self).model_fields and getattr(self, name) is None}
        if "max_batch_size" in update:  # a default never breaks a limit that was set
            update["max_batch_size"] = min(update["max_batch_size"], self.max_batch_input_tokens,
                                           self.max_queue_size_tg or update["max_batch_size"])
        if self.max_num_steps > 1:  # asked for: it and overlap exclude each other
            update["enable_overlap_scheduler"] = bool(self.enable_overlap_scheduler)
        if not self.enable_chunked_prefill:  # in-flight batching splits prompts
            update["enable_in_flight_batching"] = bool(self.enable_in_flight_batching)
        if update.get("enable_overlap_scheduler", self.enable_overlap_scheduler):
            update["max_num_steps"] = 1  # overlap runs ahead already: one pass per scheduling round
        kv = self.model.kv_cache
        if kv.kv_cache_page_size is None:
            page = kv.model_copy(update={"kv_cache_page_size": kv.page_size_for(device_type)})
            update["model"] = self.model.model_copy(update={"kv_cache": page})
        return self.model_copy(update=update).resolve()

    def resolve(self) -> Self:
        """Checks the rules that span fields; returns self.

        Raises ValueError listing every broken rule, each naming its field(s).
        """
        problems = self._rule_problems()
        if problems:
            raise ValueError(problems_message(problems))
        return self

    def _rule_problems(self) -> list[str]:
        problems = []
        if self.section_name is not None and self.config_file is None:
            problems.append(f"section_name {self.section_name!r} is set but config_file is not")
        if self.max_batch_size is not None:
            if self.max_batch_size > self.max_batch_input_tokens:
                problems.append(f"max_batch_size ({self.max_batch_size}) exceeds max_batch_input_tokens "
                                f"({self.max_batch_input_tokens}): every prefilled request needs a token")
            if self.min_batch_size_tg is not None and self.min_batch_size_tg > self.max_batch_size:
                problems.append(f"min_batch_size_tg ({self.min_batch_size_tg}) exceeds max_batch_size "
                                f"({self.max_batch_size})")
            if self.max_queue_size_tg is not None and self.max_queue_size_tg < self.max_batch_size:
                problems.append(f"max_queue_size_tg ({self.max_queue_size_tg}) is below max_batch_size "
                                f"({self.max_batch_size}): decode batches could never fill")
        if self.enable_overlap_scheduler and self.max_num_steps > 1:
            problems.append(f"max_num_steps ({self.max_num_steps}) must be -1 or 1 with enable_overlap_scheduler "
                            "(the overlap pipeline runs one decode step per batch)")
        if self.enable_in_flight_batching and not self.enable_chunked_prefill:
            problems.append("enable_in_flight_batching needs enable_chunked_prefill (prompts must split to fit "
                            "beside decode tokens)")
        sampling = self.sampling
        if sampling.max_tokens > sampling.max_tokens_limit:
            problems.append(f"sampling.max_tokens ({sampling.max_tokens}) exceeds sampling.max_tokens_limit "
                            f"({sampling.max_tokens_limit})")
        if sampling.min_tokens > sampling.max_tokens:
            problems.append(f"sampling.min_tokens ({sampling.min_tokens}) exceeds sampling.max_tokens "
                            f"({sampling.max_tokens})")
        if self.max_length is not None and sampling.max_tokens >= self.max_length:
            problems.append(f"sampling.max_tokens ({sampling.max_tokens}) leaves no room for a prompt within "
                            f"max_length ({self.max_length})")
        return problems

    def to_display_dict(self) -> dict[str, Any]:
        """Every field, JSON-compatible (enums as values, paths as strings)."""
        return self.model_dump(mode="json")

    def log_basic_config(self, logger: logging.Logger | None = None) -> None:
        """Logs the resolved essentials at INFO, one topic per line."""
        log = logger or _logger
        for line in self._basic_config_lines():
            log.info("%s", line)

    def _basic_config_lines(self) -> list[str]:
        model, kv, sampling = self.model, self.model.kv_cache, self.sampling
        memory = (f"{kv.kv_cache_memory_bytes} bytes" if kv.kv_cache_memory_bytes is not None
                  else f"measured, device_memory_utilization={kv.device_memory_utilization}")
        return [
            f"model: {model.model_path} (served as {model.served_model_name or 'its path'}, "
            f"dtype={model.dtype}, prompt_dtype={model.prompt_dtype}, device={model.device}, "
            f"max_length={self.max_length or 'model limit'})",
            f"batching: max_batch_size={self.max_batch_size or 'auto'}, "
            f"max_queue_size_tg={self.max_queue_size_tg or 'max_batch_size'}, "
            f"max_batch_input_tokens={self.max_batch_input_tokens}, "
            f"kvcache_ce_watermark={self.kvcache_ce_watermark}",
            f"kv cache: page_size={kv.kv_cache_page_size or 'device default'}, "
            f"prefix_caching={kv.enable_prefix_caching}, memory={memory}, dtype={kv.cache_dtype}, "
            f"attention={kv.attention_kernel}",
            f"sampling defaults: temperature={sampling.temperature}, top_p={sampling.top_p}, "
            f"top_k={sampling.top_k}, repetition_penalty={sampling.repetition_penalty}, "
            f"max_tokens={sampling.max_tokens} (limit {sampling.max_tokens_limit}), seed={sampling.seed}",
        ]


class LimitsConfig(BaseModel):
    """Bounds on what a request carries and what a client may hold, so that no request can take the
    server's memory or time from the others. Every one is checked before any work is done."""

    model_config = _SETTINGS
    max_message_bytes: int = Field(
        16 * 1024 * 1024, ge=1024, description="Largest gRPC message received (a reference recording rides in one).")
    max_reference_audio_bytes: int = Field(
        10 * 1024 * 1024, ge=1, description="Largest reference recording (encoded bytes) for cloning or a request.")
    max_stop_token_ids: int = Field(64, ge=0, description="Most stop_token_ids one request may list.")
    max_voice_name_chars: int = Field(64, ge=1, description="Longest voice name.")
    max_request_id_chars: int = Field(128, ge=1, description="Longest client request id (a label for logs).")
    max_description_chars: int = Field(1000, ge=0, description="Longest registered voice description.")
    max_transcript_chars: int = Field(
        2000, ge=1, description="Longest transcript of a reference recording (what is said in it).")
    max_concurrent_streams: int = Field(
        100, ge=1, description="Most RPCs one client connection may have open at once (HTTP/2 streams).")
    max_registered_voices: int = Field(100, ge=0, description="Most registered (cloned) voices kept.")
    max_registered_voice_bytes: int = Field(
        256 * 1024 * 1024, ge=0, description="Most bytes all registered voices may take on disk together.")


class AudioGenerationConfig(PipelineConfig):
    """A text-to-speech pipeline: the speech-token model plus the streaming audio decoder."""

    audio_decoder: str = Field(
        "snac", description="Registered audio decoder name; when not set, the decoder the model's manifest "
                            "(audio_pipeline.json) names, else snac.")
    audio_decoder_weights: str = Field(
        "", description="Decoder weights (file or directory); empty = the decoder that comes with the model.")
    chunk_size: sources.CommaList[list[Annotated[int, Field(ge=1)]] | None] = Field(
        None, min_length=1, description="Speech tokens per streamed chunk, last entry repeating; none = no "
        "streaming (one chunk at the end). When not set: the model's streaming default (its manifest's, or "
        "28,56,112 for Orpheus-layout models).")
    buffer: int = Field(0, ge=0, description="Already-decoded tokens given as left context to each decode; "
                                             "when not set, the model's streaming default, else 0.")
    block_causal: bool = Field(False, description="Context tokens may not see the current block; when not "
                                                  "set, the model's streaming default, else false.")
    prepend_prompt_speech_tokens: PrependPromptSpeechTokens = Field(
        PrependPromptSpeechTokens.NEVER, description="Whether voice-prompt speech tokens are decoder context; "
                                                     "when not set, the model's streaming default, else never.")
    prepend_prompt_speech_tokens_causal: bool = Field(
        False, description="Prepended prompt tokens may not see the current block.")
    prometheus_metrics_mode: PrometheusMetricsMode = Field(
        PrometheusMetricsMode.INSTRUMENT_ONLY, description="How Prometheus metrics are exposed.")
    audio_decoder_config: dict[str, Any] = Field(
        default_factory=dict, description="Decoder-specific settings; given as text (environment, flags), each "
                                          "value is read as JSON where it parses, else kept as a string.")
    audio_decoder_thread: bool | None = Field(
        None, description="Decode audio on a thread of its own, beside the generation loop; None = on CUDA (there "
                          "the loop would otherwise wait for every chunk's decoding on the GPU), off on the CPU "
                          "(there the decoder shares the loop's cores).")
    engine_process: EngineProcess = Field(
        EngineProcess.AUTO, description="Where the server's engine core (scheduler, KV cache, model, sampler, audio "
        "decoder) runs: subprocess = a process of its own, fed over local sockets (the doors, request preparation "
        "and audio encoding never share its interpreter; if it dies, its requests end UNAVAILABLE and a new one "
        "starts); in_process = threads of the server's process; auto = the measured best of the device: "
        "subprocess on the CPU and on CUDA (an H200 made 90 passes a second at 256 Orpheus-3B streams in its own "
        "process, 74 in process). "
        "A TTSEngine in a program of your own runs it in process unless told otherwise.")
    grace_period_s: float = Field(10.0, ge=0, description="On shutdown, time given to running requests to finish.")
    voices_dir: str | None = Field(
        None, description="Where registered (cloned) voices are kept; None = <cache>/voices, the cache being "
                          "$AUDIO_PIPELINE_CACHE or ~/.cache/audio-pipeline.")
    max_segment_chars: int = Field(
        300, ge=20, description="Longest piece of a text spoken by one generation: sentences longer than this "
                                "are cut at clause boundaries (then spaces).")
    normalize_text: bool = Field(
        True, description="Read written forms as words before speaking (numbers, money, dates, times, units, "
                          "abbreviations, URLs, symbols); a request's normalize_text overrides it.")
    pronunciations: str | None = Field(
        None, description="A pronunciation lexicon for the voices (read at start-up): a W3C PLS file (every "
                          "voice), or JSON: a list of {word, phonemes (IPA) | respelling} (every voice) or an object "
                          "of voice name (\"*\": every voice) -> such a list. A request's own pronunciations win for "
                          "the words they share. See docs/features.md, Pronunciations.")
    max_reference_seconds: float = Field(
        30.0, gt=0, le=600, description="Longest reference recording accepted for voice cloning, in seconds.")
    openai_voices: dict[str, str] = Field(
        default_factory=dict, description="HTTP front door: OpenAI voice names (alloy, nova, ...) mapped to this "
                                          "server's voices; unmapped OpenAI names speak with the default voice.")
    limits: "LimitsConfig" = Field(default_factory=lambda: LimitsConfig(),
                                   description="Bounds on what one request or client may ask of the server.")

    @property
    def resolved_audio_decoder(self) -> str:
        """The decoder to load: audio_decoder where it was set, else the one the model's manifest
        names (the built-in voice names lpc), else the default snac."""
        if "audio_decoder" in self.model_fields_set:
            return self.audio_decoder
        from audio_pipeline.layouts.manifest import declared_audio_decoder

        return declared_audio_decoder(self.model.model_path) or self.audio_decoder

    _decoder_settings = field_validator("audio_decoder_config", mode="before")(sources.json_values)

    @classmethod
    def _model_defaults(cls, chosen: Mapping[str, Any]) -> dict[str, Any]:
        """The model's streaming defaults (chunk_size, buffer, block_causal, prepend from its
        manifest, or its family's) and its family's sampling defaults, below every source: a
        setting any source makes, even to none, is kept. The streaming ones are made for the
        model's own decoder: with another audio_decoder there are none."""
        from audio_pipeline.layouts.manifest import declared_defaults

        model = chosen.get("model")
        path = getattr(model, "model_path", None) if not isinstance(model, Mapping) else model.get("model_path")
        decoder, streaming, sampling = declared_defaults(path or DEFAULT_MODEL)
        defaults = {"sampling": sampling} if sampling else {}
        chosen_decoder = chosen.get("audio_decoder")
        if chosen_decoder and chosen_decoder != (decoder or cls.model_fields["audio_decoder"].default):
            return defaults
        return {**defaults, **streaming}

    def to_display_dict(self) -> dict[str, Any]:
        """Every field, with audio_decoder as resolved (the decoder the model names, if not set)."""
        shown = super().to_display_dict()
        shown["audio_decoder"] = self.resolved_audio_decoder
        return shown

    def _rule_problems(self) -> list[str]:
        # What the audio decoder can honour (whole frames, block-causal decoding) is the decoder's
        # to check: decoders/settings_check.py, run by the engine and the command line.
        problems = super()._rule_problems()
        prepend = self.prepend_prompt_speech_tokens
        if self.prepend_prompt_speech_tokens_causal and prepend is PrependPromptSpeechTokens.NEVER:
            problems.append("prepend_prompt_speech_tokens_causal=true has no effect while "
                            "prepend_prompt_speech_tokens is never")
        if prepend is PrependPromptSpeechTokens.ROLLING and self.buffer == 0:
            problems.append("prepend_prompt_speech_tokens=rolling needs buffer > 0: rolling fills the "
                            "buffer context of later chunks with prompt tokens, and buffer=0 leaves none "
                            "(use once)")
        return problems

    def _basic_config_lines(self) -> list[str]:
        weights = self.audio_decoder_weights or "from the model"
        settings = f", settings={self.audio_decoder_config}" if self.audio_decoder_config else ""
        if self.audio_decoder_thread is not None:
            settings += f", on its own thread: {str(self.audio_decoder_thread).lower()}"
        return super()._basic_config_lines() + [
            f"audio decoder: {self.resolved_audio_decoder} (weights {weights}{settings})",
            f"streaming: chunk_size={self.chunk_size or 'off (one chunk)'}, buffer={self.buffer}, "
            f"block_causal={self.block_causal}, prepend_prompt_speech_tokens={self.prepend_prompt_speech_tokens} "
            f"(causal={self.prepend_prompt_speech_tokens_causal})",
            f"metrics: {self.prometheus_metrics_mode}; grace_period_s={self.grace_period_s}",
        ]
