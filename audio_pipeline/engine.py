"""TTSEngine: builds model, tokenizer, decoder and generation loop from the configuration, and turns
requests into validated contexts. The server and the in-process `synthesize` command both use it."""

from __future__ import annotations

import dataclasses
import gc
import logging
import queue
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from audio_pipeline.config import DEFAULT_MODEL, AudioGenerationConfig
from audio_pipeline.core.request import TTSContext
from audio_pipeline.core.stop import StopReason
from audio_pipeline.decoders import load_audio_decoder
from audio_pipeline.config.defaults import DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_QUEUE_SIZE
from audio_pipeline.errors import InvalidArgument, NotFound, RequestError, ResourceExhausted, echo
from audio_pipeline.core.metrics import EngineMetrics
from audio_pipeline.layouts.manifest import ModelManifest
from audio_pipeline.layouts.voice_info import VoiceInfo
from audio_pipeline.core.scheduler import AudioGenerationScheduler, SchedulerConfig
from audio_pipeline.text.normalize import NormalizedText, normalize
from audio_pipeline.text.timings import word_timings
from audio_pipeline.text.segment import segments
from audio_pipeline.voices import (RegisteredVoice, VoicePrompt, VoiceStore, check_reference_size, check_transcript,
                                   codes_file, read_reference_audio, read_voice_entry)
from audio_pipeline.core.engine_core import AudioEvent, EngineCore, Sink, StreamSettings, Usage
from audio_pipeline.core.model_runner import build_runner
from audio_pipeline.core.step_timing import StepTimer
from audio_pipeline.core.runtime import default_num_threads
from audio_pipeline.core.sampler import SamplingParams

logger = logging.getLogger(__name__)



def resolve_model_dir(model_path: str) -> Path:
    """A local model directory for ``model_path`` (``builtin:NAME`` or a path)."""
    if model_path.startswith("builtin:"):
        from audio_pipeline.builtin import resolve_builtin_model

        return resolve_builtin_model(model_path.removeprefix("builtin:"))
    path = Path(model_path).expanduser()
    if not path.is_dir():
        hint = (" It looks like a hub id: this engine loads local directories only; download the model "
                "first and pass its directory.") if model_path.count("/") == 1 and not path.exists() else ""
        raise FileNotFoundError(f"model.model_path: {model_path!r} is not a directory.{hint}")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model.model_path: {path} has no config.json (expected a Hugging Face model directory)")
    return path


def resolve_device(name: str) -> torch.device:
    """The device ``name`` (model.device) stands for; a CUDA device always with its index (the
    current one for plain ``cuda``), since torch.cuda.set_device and the graph pools need one."""
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"model.device: {name!r} asked for, but CUDA is not available")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        elif device.index >= torch.cuda.device_count():
            raise ValueError(f"model.device: {name!r} asked for, but there are {torch.cuda.device_count()} GPUs")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


#: Where the configuration leaves them unset, CUDA serves with these: a GPU step costs about the same
#: for one row as for hundreds (the weights are read once per step), so batches are large, prompts
#: ride along in decode steps instead of stalling them, and the next step is launched before the
#: last one is read. The CPU keeps the fields' own defaults.
CUDA_DEFAULTS = {"max_batch_size": 256, "enable_in_flight_batching": True, "enable_overlap_scheduler": True}


def device_defaults(config: AudioGenerationConfig, device: torch.device) -> AudioGenerationConfig:
    """``config`` with CUDA_DEFAULTS for the fields it does not set, on CUDA."""
    if device.type != "cuda":
        return config
    update = {name: value for name, value in CUDA_DEFAULTS.items() if name not in config.model_fields_set}
    if config.max_num_steps > 1:  # multi-step decoding asked for: it and overlap exclude each other
        update.pop("enable_overlap_scheduler", None)
    if not config.enable_chunked_prefill:
        update.pop("enable_in_flight_batching", None)
    return config.model_copy(update=update) if update else config


@dataclass
class SynthesisResult:
    """In-process synthesis output (native sample rate)."""

    samples: np.ndarray
    sample_rate: int
    usage: Usage
    stop_reason: StopReason


#: The range of a request's speed (OpenAI's).
MIN_SPEED, MAX_SPEED = 0.25, 4.0


@dataclass(frozen=True)
class RequestSettings:
    """A request's settings, checked once against the model, for each segment of its text."""

    #: The preset voice (None with a reference recording or a registered voice's prompt).
    voice: str | None
    reference: VoicePrompt | None
    normalize_text: bool
    #: The speed the model speaks at (1.0 where the stream is time-stretched instead).
    speed: float
    sampling: SamplingParams
    #: max_tokens was asked for (else a layout that knows the speech's length fits it to the text).
    explicit_max_tokens: bool


class TTSEngine:
    """Everything needed to serve one model: load once, then create and submit requests."""

    def __init__(self, config: AudioGenerationConfig):
        from transformers import AutoConfig, AutoTokenizer

        from audio_pipeline.models.llama_model import LlamaPipelineModel
        from audio_pipeline.models.registry import pipeline_model_class

        self.model_dir = resolve_model_dir(config.model.model_path)
        self.manifest = ModelManifest.read(self.model_dir)
        device = resolve_device(config.model.device)
        dtype = resolve_dtype(config.model.dtype, device)
        self.config = config = device_defaults(config, device)
        if device.type == "cuda":  # streams, events and graph pools below belong to the current device
            torch.cuda.set_device(device)
        #: Intra-op threads the engine thread runs with (model.num_threads, else a per-device default).
        self.num_threads = config.model.num_threads or default_num_threads(device)
        hf_config = AutoConfig.from_pretrained(self.model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.layout = self.manifest.make_layout(self.model_dir, self.tokenizer)
        if hf_config.vocab_size < self.layout.min_vocab_size:
            raise ValueError(f"model.model_path: vocabulary of {hf_config.vocab_size} ids cannot hold the "
                             f"speech tokens of the {self.manifest.family} layout (needs {self.layout.min_vocab_size})")
        #: The decoder in use: audio_decoder as configured, else the one the model's manifest names.
        self.decoder_name = config.resolved_audio_decoder
        # Checked before the language model loads: a missing decoder must not cost a multi-GB load first.
        decoder_weights = self._decoder_weights()
        model_class = pipeline_model_class(hf_config)
        if self.layout.codes_per_token > 1 and model_class is LlamaPipelineModel:
            raise ValueError(f"model.model_path: the {self.manifest.family} layout samples {self.layout.codes_per_token} "
                             f"codes per position, which a {hf_config.model_type} checkpoint cannot (no depth decoder)")
        self.model = model_class(config, hf_config, self.model_dir, devices=[device], dtype=dtype,
                                 kv_cache_config=config.model.kv_cache, random_weights=self.manifest.random_weights)
        if getattr(self.model, "codes_per_token", 1) != self.layout.codes_per_token:
            raise ValueError(f"model.model_path: the model samples {getattr(self.model, 'codes_per_token', 1)} codes "
                             f"per position, the {self.manifest.family} layout {self.layout.codes_per_token}")
        self.max_batch_size = config.max_batch_size or DEFAULT_MAX_BATCH_SIZE
        self.decoder = load_audio_decoder(self.decoder_name, decoder_weights,
                                          config.audio_decoder_config, device=device)
        self.decoder_device = device
        kv_manager = self.model.load_kv_manager(config.model.kv_cache.kv_cache_memory_bytes,
                                                reserve_bytes=self._activation_reserve())
        # What "auto" settings became (the configuration's own log line shows them as set).
        logger.info("KV cache: %d pages of %d tokens (%.0f MiB), %s, attention %s", kv_manager.total_num_blocks,
                    kv_manager.page_size, kv_manager.total_num_blocks * kv_manager.page_size
                    * self.model.kv_params.bytes_per_token / 2**20,
                    str(self.model.cache_dtype).removeprefix("torch."), kv_manager.backend.name)
        for name in ("block_causal", "prepend_prompt_speech_tokens_causal"):
            if getattr(config, name) and not self.decoder.supports_block_causal:
                raise ValueError(f"{name}: the loaded {self.decoder_name!r} checkpoint does not support "
                                 "block-causal decoding")
        if self.decoder.tokens_per_frame != self.layout.codes_per_frame:
            raise ValueError(f"audio_decoder: {self.decoder_name!r} takes {self.decoder.tokens_per_frame}-code "
                             f"frames; the {self.manifest.family} layout makes {self.layout.codes_per_frame}-code frames")
        check_decoder = getattr(self.layout, "check_decoder", None)
        if check_decoder is not None:
            check_decoder(self.decoder)
        self.sampling_defaults = SamplingParams.from_config(config.sampling)
        self.metrics = EngineMetrics(config.prometheus_metrics_mode.value)
        timer = StepTimer()

        def make_runner():
            return build_runner(self.model, self.layout, config, max_batch_size=self.max_batch_size, timer=timer,
                                overlap=config.enable_overlap_scheduler)

        # On CUDA the runner is built now, not at the first request: it captures the decode graphs
        # (seconds). On the CPU the engine's thread builds it at its first step: built here, the
        # model phase at 32 streams through the server measured 4.58 and 5.37 ms per pass against
        # 4.01-4.35 and 4.94-4.97 built there (two pairs of runs; likely its buffers' heap).
        runner = make_runner() if device.type == "cuda" else make_runner
        scheduler_config = SchedulerConfig.from_config(
            config, max_batch_size=self.max_batch_size, max_queue_size=config.max_queue_size or DEFAULT_MAX_QUEUE_SIZE)
        if config.enable_overlap_scheduler:  # overlap already runs ahead: one pass per scheduling round
            scheduler_config = dataclasses.replace(scheduler_config, max_num_steps=1)
        self.scheduler = AudioGenerationScheduler(scheduler_config, kv_manager.block_manager)
        self.voice_store = self._open_voice_store()
        #: Preset voices spoken as a clone of a reference the model directory ships.
        self.preset_prompts = self._preset_prompts()
        self.core = EngineCore(runner, self.decoder, StreamSettings.from_config(config), self.scheduler,
                               overlap=config.enable_overlap_scheduler, timer=timer, metrics=self.metrics,
                               num_threads=self.num_threads, decode_stream=self._decode_stream(device),
                               decode_thread=config.audio_decoder_thread)

    @staticmethod
    def _decode_stream(device: torch.device) -> torch.cuda.Stream | None:
        """CUDA: the decoder's stream, at the highest priority: a chunk's few decoder kernels go ahead
        of the model's queued ones, so its audio is not held up behind whole forward passes (a
        stream that waits for audio is about to stall; the model's steps have slack)."""
        return torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None

    def _activation_reserve(self) -> int:
        """Device memory the KV cache must leave for the largest step and decoder call, measured by
        running them (CUDA; twice the peak: the second for the CUDA graphs' pool, captured after the
        cache); 0 on the CPU or with an explicit kv_cache_memory_bytes."""
        config = self.config
        if self.decoder_device.type != "cuda" or config.model.kv_cache.kv_cache_memory_bytes is not None:
            return 0
        from audio_pipeline.core.memory_profile import largest_step_peak_bytes

        window = max(config.chunk_size) if config.chunk_size else config.sampling.max_tokens  # none: one chunk
        started = time.perf_counter()
        peak = largest_step_peak_bytes(self.model, self.decoder, max_step_tokens=config.max_batch_input_tokens,
                                       max_rows=self.max_batch_size, decode_window=window + config.buffer,
                                       candidates=self.layout.codebook_size + 8)
        # The first prefill step loads the attention kernels (or builds them with nvcc, minutes, where no
        # prebuilt ones are installed): the time says which happened.
        logger.info("largest step and decoder call peak at %.1f MiB, measured in %.1f s (the first prompt step "
                    "loads or builds the attention kernels); the KV cache leaves twice that free",
                    peak / 2**20, time.perf_counter() - started)
        return 2 * peak

    def _open_voice_store(self) -> VoiceStore | None:
        """The registered voices (None when the decoder cannot encode audio, so no cloning)."""
        if not getattr(self.decoder, "supports_encoding", hasattr(self.decoder, "encode")):
            return None
        from audio_pipeline.builtin import builtin_cache_dir

        directory = Path(self.config.voices_dir) if self.config.voices_dir else builtin_cache_dir() / "voices"
        store = VoiceStore(directory, self.decoder_name, self.decoder.sample_rate, self._encode)
        skipped = store.load()
        if skipped:
            logger.warning("skipped unreadable registered voices in %s: %s", directory, ", ".join(skipped))
        return store

    def _preset_prompts(self) -> dict[str, VoicePrompt]:
        """The voice prompts of the preset voices whose reference the model directory ships, in
        ``voices/NAME/`` as registered voices are kept (voice.json's transcript, the decoder's
        codes or reference.flac). A layout that speaks only as a reference needs one for each preset
        voice: ValueError naming the voice otherwise."""
        prompts = {}
        encode = self._encode if self.voice_store is not None else None  # the decoder can encode
        for voice in self.manifest.voices:
            entry = self.model_dir / "voices" / voice.name
            if (entry / "voice.json").is_file():
                meta, codes, _ = read_voice_entry(entry, self.decoder_name, self.decoder.sample_rate, encode)
                try:
                    self.decoder.check_code_values(codes, self.layout.codebook_size)
                except ValueError as exc:
                    raise ValueError(f"{entry}: the reference's codes: {exc}") from None
                prompts[voice.name] = VoicePrompt(meta["transcript"], codes)
            elif self.clones_only:
                raise ValueError(f"model.model_path: preset voice {voice.name!r} of the {self.manifest.family} "
                                 f"model needs its reference: {entry}/voice.json with the transcript, and "
                                 f"{codes_file(self.decoder_name)} or reference.flac")
        return prompts

    @property
    def clones_only(self) -> bool:
        """Whether every request speaks as a reference recording (the layout's requires_reference)."""
        return getattr(self.layout, "requires_reference", False)

    def _encode(self, samples: np.ndarray) -> torch.Tensor:
        with torch.inference_mode():
            return self.decoder.encode(torch.from_numpy(samples).to(self.decoder_device)).cpu().long()

    def _decoder_weights(self) -> str:
        """The decoder's weights: audio_decoder_weights, else what the model directory ships;
        ValueError naming the setting when there are none or they are missing."""
        if self.config.audio_decoder_weights:
            path = self.config.audio_decoder_weights
        elif self.manifest.audio_decoder_weights:
            if self.manifest.audio_decoder not in (None, self.decoder_name):
                raise ValueError(f"audio_decoder_weights: the model ships weights for {self.manifest.audio_decoder!r}, "
                                 f"not {self.decoder_name!r}; pass --audio-decoder-weights")
            path = str(self.model_dir / self.manifest.audio_decoder_weights)
        else:
            raise ValueError(f"audio_decoder_weights: required, the model directory {self.model_dir} ships no "
                             f"{self.decoder_name} decoder weights; pass --audio-decoder-weights PATH")
        if not Path(path).exists():
            raise ValueError(f"audio_decoder_weights: {path} does not exist")
        return path

    # --- facts -----------------------------------------------------------------------------------

    @property
    def sample_rate(self) -> int:
        return self.decoder.sample_rate

    @property
    def voices(self) -> list[VoiceInfo]:
        """Preset voices (default first), then registered ones."""
        default = self.manifest.default_voice
        presets = sorted(self.manifest.voices, key=lambda v: v.name != default)
        registered = [VoiceInfo(v.name, v.description, v.language) for v in self.registered_voices()]
        return presets + registered

    def registered_voices(self) -> list[RegisteredVoice]:
        return self.voice_store.voices() if self.voice_store is not None else []

    def register_voice(self, name: str, audio: bytes, transcript: str, description: str = "") -> RegisteredVoice:
        """Clones a voice from a recording and its transcript and keeps it under ``name``.

        The cheap checks (sizes, name, a full store: config.limits) come before the recording is decoded.
        """
        store = self._require_store()
        limits = self.config.limits
        reserved = {v.name for v in self.manifest.voices}
        check_reference_size(audio, limits.max_reference_audio_bytes)
        store.check_new(name, description, reserved, limits)
        samples = read_reference_audio(audio, self.decoder.sample_rate, max_seconds=self.config.max_reference_seconds)
        transcript = check_transcript(transcript, self.config.limits.max_transcript_chars)
        return store.register(name, samples, transcript, description, reserved=reserved, limits=limits)

    def delete_voice(self, name: str) -> None:
        if len(name) > self.config.limits.max_voice_name_chars:  # longer than any voice name: no lookup
            raise NotFound(f"no registered voice named {echo(name)}", field="name")
        if name in {v.name for v in self.manifest.voices}:
            raise InvalidArgument(f"{echo(name)} is a preset voice of the model and cannot be deleted", field="name")
        self._require_store().delete(name)

    def reference_prompt(self, audio: bytes, transcript: str) -> VoicePrompt:
        """A one-request voice prompt from a recording and its transcript."""
        self._require_store()
        check_reference_size(audio, self.config.limits.max_reference_audio_bytes)
        samples = read_reference_audio(audio, self.decoder.sample_rate, max_seconds=self.config.max_reference_seconds)
        transcript = check_transcript(transcript, self.config.limits.max_transcript_chars)
        return VoicePrompt(transcript, self._encode(samples))

    def _require_store(self) -> VoiceStore:
        if self.voice_store is None:
            raise InvalidArgument(f"the audio decoder {self.decoder_name!r} cannot encode audio, so this "
                                  "server cannot clone voices", field="reference")
        return self.voice_store

    @property
    def max_seq_len(self) -> int:
        return self.model.max_seq_len

    # --- requests --------------------------------------------------------------------------------

    def check_text(self, text: str) -> None:
        """InvalidArgument unless ``text`` is a request text this server takes (non-blank, within
        ``sampling.max_text_chars``)."""
        if not text or not text.strip():
            raise InvalidArgument("must not be empty", field="text")
        limit = self.config.sampling.max_text_chars
        if len(text) > limit:
            raise InvalidArgument(f"{len(text)} characters, over the limit of {limit}", field="text")

    def create_context(self, text: str, *, voice: str | None = None, request_id: str | None = None,
                       reference: VoicePrompt | None = None, normalize_text: bool | None = None,
                       speed: float | None = None, **sampling_overrides: Any) -> TTSContext:
        """A validated context of a whole text (in-process use: the speech service validates a
        request once and builds its segments with :meth:`segment_context`); InvalidArgument or
        NotFound naming the field otherwise."""
        self.check_text(text)
        limits = self.config.limits
        if request_id is not None and len(request_id) > limits.max_request_id_chars:
            raise InvalidArgument(f"longer than {limits.max_request_id_chars} characters", field="request_id")
        if speed is not None:
            self.check_speed(speed)
        settings = self.resolve_settings(voice=voice, reference=reference, normalize_text=normalize_text,
                                         speed=speed, **sampling_overrides)
        return self.segment_context(text, settings, request_id or uuid.uuid4().hex)

    def resolve_settings(self, *, voice: str | None = None, reference: VoicePrompt | None = None,
                         normalize_text: bool | None = None, speed: float | None = None,
                         instructions: str | None = None, **sampling_overrides: Any) -> RequestSettings:
        """A request's settings checked against this model (the voice exists, the sampling values
        and stop ids are valid, the layout speaks at ``speed``), for every segment of its text.
        The speed's range is the caller's to check (:meth:`check_speed`). ``instructions`` describe
        the voice to a model whose voices are descriptions (Maya1); other models ignore them."""
        limits = self.config.limits
        if self.describes_voices:
            voice = self._voice_description(voice, instructions)
        elif voice and len(voice) > limits.max_voice_name_chars:
            raise InvalidArgument(f"{len(voice)} characters, over the limit of {limits.max_voice_name_chars}",
                                  field="voice")
        stop_ids = sampling_overrides.get("stop_token_ids") or ()
        if len(stop_ids) > limits.max_stop_token_ids:
            raise InvalidArgument(f"{len(stop_ids)} ids, over the limit of {limits.max_stop_token_ids}",
                                  field="sampling.stop_token_ids")
        vocab = self.model.huggingface_config.vocab_size
        if any(not 0 <= t < vocab for t in stop_ids):
            bad = next(t for t in stop_ids if not 0 <= t < vocab)
            raise InvalidArgument(f"{bad} is not a token id of this model (0 to {vocab - 1})",
                                  field="sampling.stop_token_ids")
        if reference is not None and voice:
            raise InvalidArgument("give either a voice name or a reference recording, not both", field="voice")
        if reference is None and voice and self.voice_store is not None and self.voice_store.get(voice):
            reference = self.voice_store.get(voice).prompt
        elif reference is None and not self.describes_voices:
            voice = voice or self.manifest.default_voice
            names = [v.name for v in self.voices]
            if voice is not None and voice not in names:
                raise NotFound(f"unknown voice {echo(voice)}; available: {', '.join(names)}", field="voice")
            reference = self.preset_prompts.get(voice)
        if reference is None and self.clones_only:
            raise InvalidArgument(f"this model ({self.manifest.family} layout) speaks only in the voice of a reference "
                                  "recording and has no default voice: give a reference with its transcript, or a "
                                  "registered voice", field="reference")
        sampling = self.sampling_defaults.with_overrides(
            max_tokens_limit=self.config.sampling.max_tokens_limit,
            tokens_per_frame=self.layout.tokens_per_frame, **sampling_overrides)
        speed = 1.0 if speed is None else float(speed)
        if speed != 1.0 and not self.speaks_at_any_speed:
            raise InvalidArgument(f"this model ({self.manifest.family} layout) speaks at one speed: only 1.0 is "
                                  "supported", field="speed")
        return RequestSettings(
            voice=voice, reference=reference, speed=speed, sampling=sampling,
            normalize_text=self.config.normalize_text if normalize_text is None else normalize_text,
            explicit_max_tokens=sampling_overrides.get("max_tokens") is not None)

    @property
    def describes_voices(self) -> bool:
        """Whether a voice is any description in words (Maya1) rather than a name from a list."""
        return getattr(self.layout, "described_voices", False)

    def _voice_description(self, voice: str | None, instructions: str | None) -> str:
        """The description a described-voice model speaks with: the instructions where given, else
        the voice (a preset's name stands for its description; any other text is the description),
        else the default voice's."""
        limit = self.config.limits.max_description_chars
        for text, field in ((instructions, "instructions"), (voice, "voice")):
            if text and len(text) > limit:
                raise InvalidArgument(f"{len(text)} characters, over the limit of {limit} "
                                      "(limits.max_description_chars)", field=field)
        presets = {v.name: v.description for v in self.manifest.voices}
        if instructions and instructions.strip():
            return instructions
        chosen = voice or self.manifest.default_voice or ""
        return presets.get(chosen, chosen)

    @property
    def speaks_at_any_speed(self) -> bool:
        """Whether the model's layout speaks at a requested speed (else a stream is time-stretched)."""
        return getattr(self.layout, "supports_speed", False)

    def segment_context(self, text: str, settings: RequestSettings, request_id: str) -> TTSContext:
        """The context of one piece of a request's text (already checked) with its settings; what
        depends on the text (its prompt's length, the speech it needs) is checked here."""
        # Every layout gets words, never "$5" or "9:15"; the spans map them back for word timings.
        normalized = normalize(text) if settings.normalize_text else NormalizedText(text, text)
        extra = {"speed": settings.speed} if settings.speed != 1.0 else {}
        prompt = self.layout.build_prompt(self.tokenizer, normalized.spoken, settings.voice, settings.reference,
                                          **extra)
        aligned_words = getattr(self.layout, "word_frames", None)
        words = (word_timings(normalized, aligned_words(normalized.spoken, **extra), self.decoder.samples_per_frame)
                 if aligned_words is not None else None)
        plan = getattr(self.layout, "alignment", None)
        alignment = plan(prompt) if plan is not None else None
        sampling = self._fit_budget(alignment, settings.sampling, explicit=settings.explicit_max_tokens)
        if not self.config.enable_chunked_prefill and len(prompt) > self.config.max_batch_input_tokens:
            raise InvalidArgument(f"the prompt is {len(prompt)} tokens, over max_batch_input_tokens "
                                  f"({self.config.max_batch_input_tokens}) and enable_chunked_prefill is off", field="text")
        budget = sampling.max_tokens - sampling.max_tokens % self.layout.tokens_per_frame
        if len(prompt) + budget > self.max_seq_len:
            raise InvalidArgument(f"the prompt ({len(prompt)} tokens) plus max_tokens ({budget}) exceeds the "
                                  f"maximum sequence length {self.max_seq_len}", field="text")
        reference = settings.reference
        return TTSContext(request_id=request_id, prompt_ids=prompt, sampling=sampling,
                          layout=self.layout, voice=settings.voice, alignment=alignment, words=words,
                          prompt_speech_codes=reference.codes if reference is not None else None,
                          prompt_frames=self.layout.prompt_frames(prompt, reference))

    @staticmethod
    def check_speed(speed: float) -> None:
        """InvalidArgument naming ``speed`` outside MIN_SPEED..MAX_SPEED."""
        if not MIN_SPEED <= float(speed) <= MAX_SPEED:
            raise InvalidArgument(f"{float(speed):g} is out of range: {MIN_SPEED} to {MAX_SPEED}", field="speed")

    def _fit_budget(self, alignment, sampling: SamplingParams, *, explicit: bool) -> SamplingParams:
        """For a layout whose alignment fixes the length of the speech (phoneme-lpc), the request's
        default max_tokens becomes exactly what the text needs; an explicit max_tokens is kept."""
        if alignment is None or explicit:
            return sampling
        needed = alignment.tokens + self.layout.tokens_per_frame  # the speech, then end-of-speech's frame slot
        limit = self.config.sampling.max_tokens_limit
        if needed > limit:
            raise InvalidArgument(f"the text needs {needed} speech tokens, over the server limit "
                                  f"sampling.max_tokens_limit={limit}: split the text", field="text")
        return dataclasses.replace(sampling, max_tokens=needed)

    def check_room(self, pending: int = 0) -> None:
        """Raises the error a request submitted now would get (Unavailable while the engine does not
        accept work, ResourceExhausted when its queue is full), with ``pending`` others being
        prepared for submission; the service's one admission call."""
        core = self.core
        if not core.accepting:
            raise core.unavailable()
        if not core.has_room(pending):
            raise ResourceExhausted("the request queue is full; retry later")

    @property
    def healthy(self) -> bool:
        """False once the engine's loop has failed repeatedly and stopped (health: NOT_SERVING)."""
        return self.core.healthy

    def on_unhealthy(self, callback) -> None:
        """``callback()`` runs (on the engine's thread) when the loop stops for good."""
        self.core.on_unhealthy = callback

    def submit(self, context: TTSContext, sink: Sink) -> None:
        self.core.submit(context, sink)

    def cancel(self, request_id: str) -> None:
        self.core.cancel(request_id)

    def start(self) -> None:
        self.core.start()

    def stop(self, timeout: float | None = None) -> None:
        self.core.stop(timeout)

    def warmup(self) -> float:
        """Runs one short request end to end (and loads the sentence segmenter); returns its seconds.

        Then everything alive (modules, model, tokenizer: the server's lifetime) leaves the garbage
        collector's generations. Otherwise the first full collection scans it all, a pause that
        falls into the first requests' steps: the first single-stream round after start-up ran at
        RTF 0.25 against 0.21 for the rounds after it, and at 0.21 with this.
        """
        started = time.monotonic()
        segments("Warm up. Done.")
        # A model that speaks only as a reference and has no default voice: any codes will do.
        reference = (VoicePrompt("warm up", torch.zeros(2 * self.layout.codes_per_frame, dtype=torch.long))
                     if self.clones_only and self.manifest.default_voice is None else None)
        self.synthesize("warm up", temperature=0.0, max_tokens=2 * self.layout.tokens_per_frame,
                        request_id=f"warmup-{uuid.uuid4().hex[:8]}", reference=reference)
        gc.collect()
        gc.freeze()
        return time.monotonic() - started

    def synthesize(self, text: str, **kwargs: Any) -> SynthesisResult:
        """Blocking synthesis of one request (the engine must be started)."""
        context = self.create_context(text, **kwargs)
        events: queue.Queue[AudioEvent] = queue.Queue()
        self.submit(context, events.put)
        pieces = []
        while True:
            event = events.get()
            if event.kind == "audio":
                pieces.append(event.samples)
            elif event.kind == "error":
                raise RequestError(event.error or "generation failed")
            else:
                samples = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)
                return SynthesisResult(samples, self.sample_rate, event.usage, event.stop_reason)


__all__ = ["TTSEngine", "SynthesisResult", "DEFAULT_MODEL", "resolve_model_dir"]
