"""TTSEngine: builds the model, tokenizer, layout, decoder, KV cache, scheduler and engine core from
the configuration, once; then admits and runs requests (a request is prepared and checked by
service/prepare.py first), and keeps the registered voices. The server and the in-process
`synthesize` command both use it."""

from __future__ import annotations

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
from audio_pipeline.decoders.settings_check import check_decoder_settings
from audio_pipeline.errors import InvalidArgument, NotFound, RequestError, ResourceExhausted, echo
from audio_pipeline.core.metrics import EngineMetrics
from audio_pipeline.layouts.manifest import ModelManifest
from audio_pipeline.layouts.voice_info import VoiceInfo
from audio_pipeline.core.scheduler import AudioGenerationScheduler, SchedulerConfig
from audio_pipeline.text.segment import segments
from audio_pipeline.service.voices import (RegisteredVoice, VoicePrompt, VoiceStore, check_reference_size,
                                           check_transcript, codes_file, read_reference_audio, read_voice_entry)
from audio_pipeline.core.kv_cache.build import build_kv_cache
from audio_pipeline.core.engine_core import AudioEvent, EngineCore, Sink, StreamSettings, Usage
from audio_pipeline.core.model_runner import build_runner
from audio_pipeline.core.step_timing import StepTimer
from audio_pipeline.core.runtime import default_num_threads, release_free_memory
from audio_pipeline.core.sampling_params import SamplingParams
from audio_pipeline.service.prepare import RequestPreparer

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


@dataclass
class SynthesisResult:
    """In-process synthesis output (native sample rate)."""

    samples: np.ndarray
    sample_rate: int
    usage: Usage
    stop_reason: StopReason


def load_tokenizer(model_dir: Path, *, plain: bool = False) -> Any:
    """The model's tokenizer: transformers' AutoTokenizer, or for a plain checkpoint (a family's
    ``plain_checkpoint``) its vocabulary through ``tokenizers`` alone (checkpoints/plain_config.py)."""
    if plain:
        from audio_pipeline.checkpoints.plain_config import VocabularyTokenizer

        return VocabularyTokenizer(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


class TTSEngine:
    """Everything needed to serve one model: load once, then create and submit requests."""

    def __init__(self, config: AudioGenerationConfig):
        from audio_pipeline.models.registry import pipeline_model_class, read_model_config

        check_decoder_settings(config)  # before anything loads
        self.model_dir = resolve_model_dir(config.model.model_path)
        self.manifest = ModelManifest.read(self.model_dir)
        device = resolve_device(config.model.device)
        dtype = resolve_dtype(config.model.dtype, device)
        self.config = config = config.for_device(device.type)
        if device.type == "cuda":  # streams, events and graph pools below belong to the current device
            torch.cuda.set_device(device)
        #: Intra-op threads the engine thread runs with (model.num_threads, else a per-device default).
        self.num_threads = config.model.num_threads or default_num_threads(device)
        plain = self.manifest.family_record.plain_checkpoint
        hf_config = read_model_config(self.model_dir, plain=plain)
        self.tokenizer = load_tokenizer(self.model_dir, plain=plain)
        self.layout = self.manifest.make_layout(self.model_dir, self.tokenizer)
        #: The languages a request may name (text/languages.py): the manifest's, the checkpoint's, or the family's.
        self.languages = self.manifest.spoken_languages(self.layout)
        if hf_config.vocab_size < self.layout.min_vocab_size:
            raise ValueError(f"model.model_path: vocabulary of {hf_config.vocab_size} ids cannot hold the "
                             f"speech tokens of the {self.manifest.family} layout (needs {self.layout.min_vocab_size})")
        #: The decoder in use: audio_decoder as configured, else the one the model's manifest names.
        self.decoder_name = config.resolved_audio_decoder
        # Checked before the language model loads: a missing decoder must not cost a multi-GB load first.
        decoder_weights = self._decoder_weights()
        model_class = pipeline_model_class(hf_config)
        if self.layout.codes_per_token > 1 and not model_class.has_depth_decoder:
            raise ValueError(f"model.model_path: the {self.manifest.family} layout samples {self.layout.codes_per_token} "
                             f"codes per position, which a {hf_config.model_type} checkpoint cannot (no depth decoder)")
        self.model = model_class(config, hf_config, self.model_dir, devices=[device], dtype=dtype,
                                 kv_cache_config=config.model.kv_cache, random_weights=self.manifest.random_weights)
        if self.model.codes_per_token != self.layout.codes_per_token:
            raise ValueError(f"model.model_path: the model samples {self.model.codes_per_token} codes "
                             f"per position, the {self.manifest.family} layout {self.layout.codes_per_token}")
        self.max_batch_size = config.max_batch_size
        self.decoder = load_audio_decoder(self.decoder_name, decoder_weights,
                                          config.audio_decoder_config, device=device)
        self.decoder_device = device
        #: The paged KV cache: the engine's, sized for the model after its weights and the decoder are loaded.
        self.kv_cache = kv_manager = build_kv_cache(self.model, config.model.kv_cache.kv_cache_memory_bytes,
                                                    reserve_bytes=self._activation_reserve())
        # What "auto" settings became (the configuration's own log line shows them as set).
        blocks = kv_manager.block_manager
        grows = (f", growing on demand to at most {blocks.max_num_blocks} pages"
                 if blocks.max_num_blocks > blocks.total_num_blocks else "")
        logger.info("KV cache: %d pages of %d tokens (%.0f MiB%s), %s, attention %s", kv_manager.total_num_blocks,
                    kv_manager.page_size, kv_manager.total_num_blocks * kv_manager.page_size
                    * self.model.kv_params.bytes_per_token / 2**20, grows,
                    str(self.model.cache_dtype).removeprefix("torch."), kv_manager.backend.name)
        logger.info("Batching on %s: max_batch_size=%d, max_queue_size=%d, in-flight batching %s, overlap %s, "
                    "max_num_steps %d, audio decoding on %s", device.type, config.max_batch_size,
                    config.max_queue_size, config.enable_in_flight_batching, config.enable_overlap_scheduler,
                    config.max_num_steps, "its own thread" if config.audio_decoder_thread else "the loop")
        for name in ("block_causal", "prepend_prompt_speech_tokens_causal"):
            if getattr(config, name) and not self.decoder.supports_block_causal:
                raise ValueError(f"{name}: the loaded {self.decoder_name!r} checkpoint does not support "
                                 "block-causal decoding")
        if self.decoder.tokens_per_frame != self.layout.codes_per_frame:
            raise ValueError(f"audio_decoder: {self.decoder_name!r} takes {self.decoder.tokens_per_frame}-code "
                             f"frames; the {self.manifest.family} layout makes {self.layout.codes_per_frame}-code frames")
        self.layout.check_decoder(self.decoder)
        self.layout.check_model(self.model)
        self.sampling_defaults = SamplingParams.from_config(config.sampling)
        self.metrics = EngineMetrics(config.prometheus_metrics_mode.value)
        timer = StepTimer()

        def make_runner():
            return build_runner(self.model, kv_manager, self.layout, config, max_batch_size=self.max_batch_size, timer=timer,
                                overlap=config.enable_overlap_scheduler)

        # On CUDA the runner is built now, not at the first request: it captures the decode graphs
        # (seconds). On the CPU the engine's thread builds it at its first step: built here, the
        # model phase at 32 streams through the server measured 4.58 and 5.37 ms per pass against
        # 4.01-4.35 and 4.94-4.97 built there (two pairs of runs; likely its buffers' heap).
        runner = make_runner() if device.type == "cuda" else make_runner
        self.scheduler = AudioGenerationScheduler(SchedulerConfig.from_config(config), kv_manager.block_manager)
        self.voice_store = self._open_voice_store()
        #: Pronunciation lexicons by voice name ("*": every voice), from the configuration's file.
        self.voice_lexicons = self._voice_lexicons()
        #: Preset voices spoken as a clone of a reference the model directory ships.
        self.preset_prompts = self._preset_prompts()
        #: Request preparation for in-process use (the speech service keeps its own over this engine).
        self.requests = RequestPreparer(self)
        self.core = EngineCore(runner, self.decoder, StreamSettings.from_config(config), self.scheduler,
                               overlap=config.enable_overlap_scheduler, timer=timer, metrics=self.metrics,
                               num_threads=self.num_threads, decode_stream=self._decode_stream(device),
                               decode_thread=config.audio_decoder_thread)
        kv_manager.before_grow = self.core.wait_for_steps  # no step may hold the old tensors
        self._prepare_decoder_graphs()

    @staticmethod
    def _decode_stream(device: torch.device) -> torch.cuda.Stream | None:
        """CUDA: the decoder's stream, at the highest priority: a chunk's few decoder kernels go ahead
        of the model's queued ones, so its audio is not held up behind whole forward passes (a
        stream that waits for audio is about to stall; the model's steps have slack)."""
        return torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None

    def _prepare_decoder_graphs(self) -> None:
        """Captures the decoder's CUDA graphs (where it has them) for the windows the chunk schedule
        makes, now rather than while the first requests wait (decoders/snac_graphs.py)."""
        graphs = self.decoder.graphs
        settings = self.core.streaming
        if graphs is None or settings.block_causal or self.decoder.causal_state or settings.chunk_size is None:
            return  # block-causal chunks decode on states (decode_blocks), not as windows
        from audio_pipeline.decoders.chunker import ChunkSchedule

        schedule = ChunkSchedule(settings.chunk_size, settings.buffer)
        frame = self.decoder.tokens_per_frame
        steady = [length // frame for length in schedule.steady_window_lengths()]
        # A final chunk's window is shorter (what is left); streams that started together end together.
        graphs.prepare(steady + [n for n in range(1, max(steady)) if n not in steady])
        graphs.sealed = True

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

    def _voice_lexicons(self) -> dict:
        from audio_pipeline.errors import InvalidArgument
        from audio_pipeline.text.pronunciations import load_voice_lexicons

        if not self.config.pronunciations:
            return {}
        try:
            lexicons = load_voice_lexicons(self.config.pronunciations)
        except OSError as error:
            raise ValueError(f"pronunciations: {error}") from None
        except InvalidArgument as error:  # it names the file and the entry already
            raise ValueError(str(error)) from None
        logger.info("pronunciations from %s: %s", self.config.pronunciations,
                    ", ".join(f"{voice} ({len(lexicon.entries)} words)" for voice, lexicon in lexicons.items()))
        return lexicons

    def _open_voice_store(self) -> VoiceStore | None:
        """The registered voices (None when the decoder cannot encode audio, so no cloning)."""
        if not self.decoder.supports_encoding:
            return None
        from audio_pipeline.builtin import builtin_cache_dir

        directory = Path(self.config.voices_dir) if self.config.voices_dir else builtin_cache_dir() / "voices"
        speaker = self.speaker_embedding if self.model.speaker_sample_rate is not None else None
        store = VoiceStore(directory, self.decoder_name, self.decoder.sample_rate, self.encode, speaker)
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
        encode = self.encode if self.voice_store is not None else None  # the decoder can encode
        for voice in self.manifest.voices:
            entry = self.model_dir / "voices" / voice.name
            if (entry / "voice.json").is_file():
                meta, codes, _ = read_voice_entry(entry, self.decoder_name, self.decoder.sample_rate, encode)
                try:
                    self.decoder.check_code_values(codes, self.layout.codebook_size)
                except ValueError as exc:
                    raise ValueError(f"{entry}: the reference's codes: {exc}") from None
                speaker = self.voice_store.speaker_of(entry) if self.voice_store is not None else None
                prompts[voice.name] = VoicePrompt(meta["transcript"], codes, speaker)
            elif self.clones_only:
                raise ValueError(f"model.model_path: preset voice {voice.name!r} of the {self.manifest.family} "
                                 f"model needs its reference: {entry}/voice.json with the transcript, and "
                                 f"{codes_file(self.decoder_name)} or reference.flac")
        return prompts

    @property
    def clones_only(self) -> bool:
        """Whether every request speaks as a reference recording (the layout's requires_reference)."""
        return self.layout.requires_reference

    def encode(self, samples: np.ndarray) -> torch.Tensor:
        """A recording's codes (the decoder's encoder)."""
        with torch.inference_mode():
            return self.decoder.encode(torch.from_numpy(samples).to(self.decoder_device)).cpu().long()

    def speaker_embedding(self, samples: np.ndarray) -> torch.Tensor | None:
        """A recording's speaker embedding (``samples`` at the decoder's rate), for a model that
        clones by one (its speaker_sample_rate); None for the others."""
        rate = self.model.speaker_sample_rate
        if rate is None:
            return None
        if rate != self.decoder.sample_rate:
            import soxr

            samples = soxr.resample(samples, self.decoder.sample_rate, rate).astype(np.float32)
        with torch.inference_mode():
            return self.model.speaker_embedding(samples).float().cpu()

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
        store = self.cloning_store()
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
        self.cloning_store().delete(name)

    @property
    def can_clone(self) -> bool:
        """Whether a reference recording can give a voice here: the decoder encodes audio and the
        layout speaks as a reference (the built-in voices do not)."""
        return self.voice_store is not None and self.layout.clonable

    def cloning_store(self) -> VoiceStore:
        """The voice store; InvalidArgument naming ``reference`` when the decoder cannot encode audio."""
        if self.voice_store is None:
            raise InvalidArgument("this server cannot clone voices: its model's audio codec cannot encode a "
                                  "recording", field="reference")
        return self.voice_store

    @property
    def max_seq_len(self) -> int:
        return self.model.max_seq_len

    # --- requests --------------------------------------------------------------------------------

    def create_context(self, text: str, **kwargs: Any) -> TTSContext:
        """A checked context of a whole text, for in-process use (tests, ``synthesize``, the warm-up):
        :meth:`RequestPreparer.create_context <audio_pipeline.service.prepare.RequestPreparer.create_context>`."""
        return self.requests.create_context(text, **kwargs)

    @property
    def takes_instructions(self) -> bool:
        """Whether a request's ``instructions`` act: a described voice's description, or a style
        beside a preset voice (the layout's takes_instructions)."""
        return self.layout.described_voices or self.layout.takes_instructions

    @property
    def describes_voices(self) -> bool:
        """Whether a voice is any description in words (Maya1) rather than a name from a list."""
        return self.layout.described_voices

    @property
    def speaks_at_any_speed(self) -> bool:
        """Whether the model's layout speaks at a requested speed (else a stream is time-stretched)."""
        return self.layout.supports_speed

    def check_room(self, pending: int = 0) -> None:
        """Raises the error a request submitted now would get (Unavailable while the engine does not
        accept work, ResourceExhausted when its queue is full or the server is past its capacity:
        max_queue_wait_ms), with ``pending`` others being prepared for submission; the service's one
        admission call."""
        core = self.core
        if not core.accepting:
            raise core.unavailable()
        if not core.has_room(pending):
            raise ResourceExhausted("the request queue is full; retry later")
        waited = core.at_capacity()
        if waited is not None:
            raise ResourceExhausted(f"the server is at capacity: the oldest waiting request has waited {waited:.1f} s "
                                    f"for a place (max_queue_wait_ms); retry later")

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
        # A model that speaks only as a reference and has no default voice: any codes (and speaker
        # embedding, where it clones by one) will do.
        reference = None
        if self.clones_only and self.manifest.default_voice is None:
            speaker = (torch.zeros(int(self.model.huggingface_config.hidden_size))
                       if self.model.speaker_sample_rate is not None else None)
            reference = VoicePrompt("warm up", torch.zeros(2 * self.layout.codes_per_frame, dtype=torch.long), speaker)
        self.synthesize("warm up", temperature=0.0, max_tokens=2 * self.layout.tokens_per_frame,
                        request_id=f"warmup-{uuid.uuid4().hex[:8]}", reference=reference)
        gc.collect()
        gc.freeze()
        if self.model.devices[0].type == "cpu":
            # What start-up and the warm-up freed: an idle CPU server does not hold it. Not on CUDA,
            # where the host heap is small beside the GPU's and the trim cost the serving loop for
            # good (an H200, Orpheus-3B, 160 streams of 28-token chunks, one call: 162.0x real time
            # and every stream holding it without the trim, 138.7x and none with it).
            release_free_memory()
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
