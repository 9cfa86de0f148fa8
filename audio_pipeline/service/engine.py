"""TTSEngine: one model served. It starts the engine core (core/assembly.py builds it: in this
process, or in a process of its own, core/process/: ``engine_process``) and holds what the front
end needs beside it: the engine core's facts, the tokenizer and layout requests are prepared with
(service/prepare.py), the languages, and the voice catalogue (service/voice_catalogue.py). The
server, the in-process ``synthesize`` command and a program of your own
(``TTSEngine(config).synthesize(text)``) use it."""

from __future__ import annotations

import gc
import logging
import queue
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from audio_pipeline.checkpoints.loading import load_tokenizer, resolve_model_dir
from audio_pipeline.config import DEFAULT_MODEL, AudioGenerationConfig, EngineProcess
from audio_pipeline.core.assembly import CoreAssembly, CoreFacts
from audio_pipeline.core.local import LocalCore
from audio_pipeline.core.request import TTSContext
from audio_pipeline.core.stop import StopReason
from audio_pipeline.decoders.settings_check import check_decoder_settings
from audio_pipeline.errors import RequestError
from audio_pipeline.layouts.manifest import ModelManifest
from audio_pipeline.text.segment import segments
from audio_pipeline.service.voice_catalogue import VoiceCatalogue
from audio_pipeline.service.voices import VoicePrompt
from audio_pipeline.core.engine_core import AudioEvent, Sink, Usage
from audio_pipeline.core.sampling_params import SamplingParams
from audio_pipeline.service.prepare import RequestPreparer

logger = logging.getLogger(__name__)

def resolve_engine_process(setting: str) -> str:
    """Where a server's engine core runs: ``engine_process`` as set, or for ``auto`` the measured
    best of the device: its own process on the CPU and on CUDA (docs/performance.md: on 2 cores, the
    built-in voice's open loop at 8 requests a second stalled 0 % of requests against 29-49 % in
    process, and a GPU server's emulated host held 256 streams against none)."""
    names = [choice.value for choice in EngineProcess]
    if setting not in names:
        raise ValueError(f"engine_process: {setting!r} is not one of {', '.join(names)}")
    return EngineProcess.SUBPROCESS.value if setting == EngineProcess.AUTO.value else setting


@dataclass
class SynthesisResult:
    """In-process synthesis output (native sample rate)."""

    samples: np.ndarray
    sample_rate: int
    usage: Usage
    stop_reason: StopReason


class TTSEngine:
    """Everything needed to serve one model: load once, then create and submit requests.

    ``engine_process``: ``in_process`` (the default: a user's program, tests) builds the engine core
    here, on threads of this process; ``subprocess`` runs it in a process of its own
    (core/process/), which this object starts, restarts if it dies, and stops."""

    def __init__(self, config: AudioGenerationConfig, *, engine_process: str = "in_process"):
        check_decoder_settings(config)  # before anything loads
        self.engine_process = resolve_engine_process(engine_process)
        if self.engine_process == "subprocess":
            from audio_pipeline.core.process.client import CoreProcess
            from audio_pipeline.core.process.metrics import front_end_metrics

            if config.prometheus_metrics_mode.value == "launch_multiproc_server":
                from audio_pipeline.core.metrics import enable_multiprocess

                enable_multiprocess()  # before the core's process starts: it inherits the directory
            # The core's process loads the model while this one loads the tokenizer and the layout.
            self.backend = backend = CoreProcess(config)
            try:
                self.model_dir = resolve_model_dir(config.model.model_path)
                self.manifest = ModelManifest.read(self.model_dir)
                self.tokenizer = load_tokenizer(self.model_dir, plain=self.manifest.family_record.plain_checkpoint,
                                                family=self.manifest.family_record)
                self.layout = self.manifest.make_layout(self.model_dir, self.tokenizer)
                self.facts: CoreFacts = backend.wait_ready()
            except BaseException:
                backend.abort()  # a core still loading: a stop would wait for its load to end
                raise
            self.config = config.for_device(self.facts.device_type)
            self.metrics = front_end_metrics(self.config.prometheus_metrics_mode.value, backend.metrics_text)
        else:
            assembly = CoreAssembly(config)
            self.backend = LocalCore(assembly)
            self.facts = assembly.facts
            self.config = assembly.config
            self.model_dir, self.manifest = assembly.model_dir, assembly.manifest
            self.tokenizer, self.layout = assembly.tokenizer, assembly.layout
            # The parts, for in-process use (tests, benchmarks): the engine core's own objects.
            self.model, self.decoder, self.kv_cache = assembly.model, assembly.decoder, assembly.kv_cache
            self.scheduler, self.core, self.metrics = assembly.scheduler, assembly.core, assembly.metrics
            self.decoder_device, self.num_threads = assembly.decoder_device, assembly.num_threads
        config = self.config
        self.decoder_name = self.facts.decoder_name
        self.max_batch_size = config.max_batch_size
        #: The languages a request may name (text/languages.py): the manifest's, the checkpoint's, or the family's.
        self.languages = self.manifest.spoken_languages(self.layout)
        self.sampling_defaults = SamplingParams.from_config(config.sampling)
        #: The voices: presets, registered (cloned) ones, their references and pronunciations.
        self.voice_catalogue = VoiceCatalogue(self)
        #: Request preparation for in-process use (the speech service keeps its own over this engine).
        self.requests = RequestPreparer(self)

    def encode(self, samples: np.ndarray) -> torch.Tensor:
        """A recording's codes (the decoder's encoder, in the engine core: never on its loop)."""
        return self.backend.encode(samples)

    def speaker_embedding(self, samples: np.ndarray) -> torch.Tensor | None:
        """A recording's speaker embedding (``samples`` at the decoder's rate), for a model that
        clones by one (its speaker_sample_rate); None for the others."""
        if self.facts.speaker_sample_rate is None:
            return None
        return self.backend.speaker_embedding(samples)

    # --- facts -----------------------------------------------------------------------------------

    @property
    def sample_rate(self) -> int:
        return self.facts.sample_rate

    @property
    def samples_per_frame(self) -> int:
        """Audio samples the decoder makes of each frame of codes."""
        return self.facts.samples_per_frame

    @property
    def max_seq_len(self) -> int:
        return self.facts.max_seq_len

    # --- requests --------------------------------------------------------------------------------

    def create_context(self, text: str, **kwargs: Any) -> TTSContext:
        """A checked context of a whole text, for in-process use (tests, ``synthesize``, the warm-up):
        :meth:`RequestPreparer.create_context <audio_pipeline.service.prepare.RequestPreparer.create_context>`."""
        return self.requests.create_context(text, **kwargs)

    def check_room(self, pending: int = 0) -> None:
        """Raises the error a request submitted now would get (Unavailable while the engine does not
        accept work, ResourceExhausted when its queue is full or the server is past its capacity:
        max_queue_wait_ms), with ``pending`` others being prepared for submission; the service's one
        admission call."""
        self.backend.check_room(pending)

    @property
    def healthy(self) -> bool:
        """False while the engine core cannot serve (its loop failed for good; its process ended and
        a new one is starting): health NOT_SERVING."""
        return self.backend.healthy

    def on_health(self, unhealthy, healthy=None) -> None:
        """``unhealthy()`` runs (on an engine thread) when the engine core stops serving, ``healthy()``
        when a new one serves again (a core in its own process is restarted)."""
        self.backend.on_health(unhealthy, healthy)

    def holdings(self) -> tuple[int, int, int, int]:
        """(queued, running) requests, the KV cache's sequences and blocks in use, in the engine core."""
        return self.backend.holdings()

    def submit(self, context: TTSContext, sink: Sink) -> None:
        self.backend.submit(context, sink)

    def cancel(self, request_id: str) -> None:
        self.backend.cancel(request_id)

    def extend(self, request_id: str, words: list, close: bool = False) -> None:
        """More words (and with ``close`` their end) for a running text-stream request."""
        self.backend.extend(request_id, words, close)

    def start(self) -> None:
        self.backend.start()

    def stop(self, timeout: float | None = None) -> None:
        self.backend.stop(timeout)

    def warmup(self) -> float:
        """Runs one short request end to end (and loads the sentence segmenter); returns its seconds.
        Then everything alive leaves the garbage collector's generations (CoreAssembly.settle says why)."""
        started = time.monotonic()
        segments("Warm up. Done.")
        # A model that speaks only as a reference and has no default voice: any codes (and speaker
        # embedding, where it clones by one) will do.
        reference = None
        if self.layout.requires_reference and self.manifest.default_voice is None:
            speaker = (torch.zeros(self.facts.hidden_size)
                       if self.facts.speaker_sample_rate is not None else None)
            reference = VoicePrompt("warm up", torch.zeros(2 * self.layout.codes_per_frame, dtype=torch.long), speaker)
        self.synthesize("warm up", temperature=0.0, max_tokens=2 * self.layout.tokens_per_frame,
                        request_id=f"warmup-{uuid.uuid4().hex[:8]}", reference=reference)
        self.backend.settle()  # the engine core's: its process's heap (core/assembly.py)
        if self.engine_process == "subprocess":  # and this process's own
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


__all__ = ["TTSEngine", "SynthesisResult", "DEFAULT_MODEL", "resolve_engine_process"]
