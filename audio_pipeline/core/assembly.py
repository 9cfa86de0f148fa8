"""The engine core's parts, built once from the configuration: the model, its tokenizer and layout,
the audio decoder, the paged KV cache, the scheduler and the EngineCore that runs them; plus the
calls that need the model or the decoder (a recording's codes and speaker embedding, a voice's codes
checked) and the facts a front end must know of them (:class:`CoreFacts`).

Built where the engine core runs: in the server's own process (``engine_process = in_process``,
and every ``TTSEngine`` of a user's program) or in the engine core's process (core/process/).
"""

from __future__ import annotations

import gc
import logging
import time
from pathlib import Path

import msgspec
import numpy as np
import torch

from audio_pipeline.checkpoints.loading import load_tokenizer, resolve_device, resolve_dtype, resolve_model_dir
from audio_pipeline.config import AudioGenerationConfig
from audio_pipeline.core.engine_core import EngineCore, StreamSettings
from audio_pipeline.core.kv_cache.build import build_kv_cache
from audio_pipeline.core.metrics import EngineMetrics
from audio_pipeline.core.model_runner import build_runner
from audio_pipeline.core.runtime import default_num_threads, release_free_memory
from audio_pipeline.core.scheduler import AudioGenerationScheduler, SchedulerConfig
from audio_pipeline.core.step_timing import StepTimer
from audio_pipeline.decoders import load_audio_decoder
from audio_pipeline.decoders.settings_check import check_decoder_settings
from audio_pipeline.layouts.manifest import ModelManifest

logger = logging.getLogger(__name__)


class CoreFacts(msgspec.Struct, frozen=True):
    """What a front end must know of the engine core to prepare requests for it and admit them
    (the engine core process's ready message carries it)."""

    #: The audio decoder: its name, output rate, samples and codes per frame, whether it encodes.
    decoder_name: str
    sample_rate: int
    samples_per_frame: int
    codes_per_frame: int
    supports_encoding: bool
    #: The language model: vocabulary, longest sequence, the rate of a speaker embedding's
    #: recording (None: it clones by codes alone), its hidden size.
    vocab_size: int
    max_seq_len: int
    speaker_sample_rate: int | None
    hidden_size: int
    #: Where it runs ("cpu", "cuda") and its intra-op threads.
    device_type: str
    num_threads: int
    #: Admission: requests queued at most, and admitted at once (the scheduler's admission limit).
    max_queue_size: int
    admission_limit: int


class CoreAssembly:
    """Everything the engine core runs, built from ``config`` (checked again for the device)."""

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
        self.tokenizer = load_tokenizer(self.model_dir, plain=plain, family=self.manifest.family_record)
        self.layout = self.manifest.make_layout(self.model_dir, self.tokenizer)
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
        for name in ("block_causal", "prepend_prompt_speech_tokens_causal"):
            if getattr(config, name) and not self.decoder.supports_block_causal:
                raise ValueError(f"{name}: the loaded {self.decoder_name!r} checkpoint does not support "
                                 "block-causal decoding")
        if self.decoder.tokens_per_frame != self.layout.codes_per_frame:
            raise ValueError(f"audio_decoder: {self.decoder_name!r} takes {self.decoder.tokens_per_frame}-code "
                             f"frames; the {self.manifest.family} layout makes {self.layout.codes_per_frame}-code frames")
        self.layout.check_decoder(self.decoder)
        self.layout.check_model(self.model)
        #: The paged KV cache: the engine's, sized for the model after its weights and the decoder are loaded.
        self.kv_cache = kv_manager = build_kv_cache(self.model, config.model.kv_cache.kv_cache_memory_bytes,
                                                    reserve_bytes=self._activation_reserve())
        self._log_settings(device)
        self.metrics = EngineMetrics(config.prometheus_metrics_mode.value)
        timer = StepTimer()

        def make_runner():
            return build_runner(self.model, kv_manager, self.layout, config, max_batch_size=self.max_batch_size,
                                timer=timer, overlap=config.enable_overlap_scheduler)

        # On CUDA the runner is built now, not at the first request: it captures the decode graphs
        # (seconds). On the CPU the engine's thread builds it at its first step: built here, the
        # model phase at 32 streams through the server measured 4.58 and 5.37 ms per pass against
        # 4.01-4.35 and 4.94-4.97 built there (two pairs of runs; likely its buffers' heap).
        runner = make_runner() if device.type == "cuda" else make_runner
        self.scheduler = AudioGenerationScheduler(SchedulerConfig.from_config(config), kv_manager.block_manager)
        # A decode pass adds a position to each row: a frame's audio over the positions a frame takes.
        self.scheduler.audio_per_pass = (self.decoder.samples_per_frame / self.decoder.sample_rate
                                         / self.layout.tokens_per_frame)
        self.core = EngineCore(runner, self.decoder, StreamSettings.from_config(config), self.scheduler,
                               overlap=config.enable_overlap_scheduler, timer=timer, metrics=self.metrics,
                               num_threads=self.num_threads, decode_stream=self._decode_stream(device),
                               decode_thread=config.audio_decoder_thread)
        kv_manager.before_grow = self.core.wait_for_steps  # no step may hold the old tensors
        self._prepare_decoder_graphs()

    def _log_settings(self, device: torch.device) -> None:
        """What "auto" settings became (the configuration's own log line shows them as set)."""
        config, kv_manager = self.config, self.kv_cache
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

    @property
    def facts(self) -> CoreFacts:
        decoder, model = self.decoder, self.model
        return CoreFacts(
            decoder_name=self.decoder_name, sample_rate=int(decoder.sample_rate),
            samples_per_frame=int(decoder.samples_per_frame), codes_per_frame=int(decoder.tokens_per_frame),
            supports_encoding=bool(decoder.supports_encoding),
            vocab_size=int(model.huggingface_config.vocab_size), max_seq_len=int(model.max_seq_len),
            speaker_sample_rate=model.speaker_sample_rate, hidden_size=int(model.huggingface_config.hidden_size),
            device_type=self.decoder_device.type, num_threads=int(self.num_threads),
            max_queue_size=int(self.scheduler.config.max_queue_size),
            admission_limit=int(self.scheduler.config.admission_limit))

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

    # --- calls that need the model or the decoder (a front end's, off the engine's loop) ---------

    def encode(self, samples: np.ndarray) -> torch.Tensor:
        """A recording's codes (the decoder's encoder), at the decoder's rate."""
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

    def check_codes(self, codes: torch.Tensor) -> None:
        """ValueError unless ``codes`` are whole frames of codes the model speaks."""
        self.decoder.check_code_values(codes, self.layout.codebook_size)

    def holdings(self) -> tuple[int, int, int, int]:
        """What the engine core holds (EngineCore.holdings)."""
        return self.core.holdings()

    def settle(self) -> None:
        """After the warm-up: everything alive (modules, model, tokenizer: the server's lifetime)
        leaves the garbage collector's generations. Otherwise the first full collection scans it
        all, a pause that falls into the first requests' steps: the first single-stream round after
        start-up ran at RTF 0.25 against 0.21 for the rounds after it, and at 0.21 with this."""
        gc.collect()
        gc.freeze()
        if self.decoder_device.type == "cpu":
            # What start-up and the warm-up freed: an idle CPU server does not hold it. Not on CUDA,
            # where the host heap is small beside the GPU's and the trim cost the serving loop for
            # good (an H200, Orpheus-3B, 160 streams of 28-token chunks, one call: 162.0x real time
            # and every stream holding it without the trim, 138.7x and none with it).
            release_free_memory()


__all__ = ["CoreAssembly", "CoreFacts"]
