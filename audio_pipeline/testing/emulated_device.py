"""An emulated device, for measuring a GPU server's host side on a CPU (benchmarks only).

On a GPU the model's step and the audio decoder's calls run on the device while the host (the
engine loop, the scheduler, the doors, the encoders) goes on; on a small CPU the real model's
step takes the cores the host would use. With the device emulated, a step of the language model
takes ``step_ms`` on the device's own timeline and a decoder call is a sleep of ``decoder_ms`` (a
sleep releases the interpreter, as a device's kernels do), and everything else runs as served: the
scheduler, the runner's staging, the update, the chunking, the encoders, both doors.

A step is launched as on a GPU: the host stages its inputs and queues it; it starts on the device
when the step before it ends (or at once) and ends ``step_ms`` later; the step's result is ready
then (PendingStep.result sleeps until that moment, as it waits for a CUDA event). No thread runs
the step: the CPU's overlap worker, which a GPU does not have, would hold the interpreter after
every step and make the host pay for the emulation (measured: 0.6-1.3 ms a pass at 256 streams).

The sampling is part of the emulated step too: on a GPU it is device work inside the step (a
captured graph after the forward pass, whose host cost is a launch), so ``step_ms`` stands for
the forward pass and the sampling together, and the host must not pay the sampler's CPU time
(about 9 ms a pass at 256 rows on a 2-core CPU, as much as the emulated step itself). The runner's
``ModelRunner._sample`` is routed, for an emulated model alone, to a draw that costs a few
microseconds: each row gets a random code of its frame slot's codebook, the token a trained
model's peaked logits give, or where the layout allows no code there (a forced token: an
alignment's, a forced end of speech) the first candidate the row allows, so every token is one the
real sampler could pick (SamplingRows' candidates and ``blocked``). A frame model's frame is random
codes with the token's code in its token column and the codes the alignment fixes. End of speech is
never drawn unless forced, so streams speak to max_tokens (an aligned voice to its alignment's
end). The repetition counts, which only the real sampler reads, are left as they are. The hidden
states are zeros, and the decoder's audio is silence of the right length.

``bench.serve --emulate-step-ms MS --emulate-decoder-ms MS`` serves this way; in a program,
``EmulatedDevice(step_ms, decoder_ms).install(engine)``.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

if TYPE_CHECKING:
    from audio_pipeline.core.model_runner import ModelRunner
    from audio_pipeline.core.sampler import SamplingRows
    from audio_pipeline.service.engine import TTSEngine

#: The emulated models, each with its sampling (what ModelRunner._sample does for their runners).
_EMULATED_SAMPLING: "weakref.WeakKeyDictionary[Any, Callable[..., torch.Tensor]]" = weakref.WeakKeyDictionary()
#: The emulated models, each with its device (whose timeline ModelRunner.launch follows for their runners).
_EMULATED_DEVICES: "weakref.WeakKeyDictionary[Any, EmulatedDevice]" = weakref.WeakKeyDictionary()


@dataclass
class Completion:
    """A launched step's end on the emulated device's timeline: what PendingStep.result waits for
    (as it waits for a CUDA event), a sleep until then."""

    at: float

    def synchronize(self) -> None:
        left = self.at - time.monotonic()
        if left > 0:
            time.sleep(left)


@dataclass
class EmulatedDevice:
    """Sleeps in place of the model's step and the decoder's calls, a cheap draw in place of the
    sampling; counts the steps and the calls."""

    step_ms: float
    decoder_ms: float = 0.0
    #: Model steps and decoder calls made so far (the benchmark's and the tests' check).
    steps: int = 0
    decoder_calls: int = 0
    seed: int = 0
    #: When the emulated device has run every step launched so far (time.monotonic()).
    device_free: float = 0.0

    def __post_init__(self) -> None:
        if self.step_ms < 0 or self.decoder_ms < 0:
            raise ValueError(f"emulated times must be >= 0 ms, got step {self.step_ms}, decoder {self.decoder_ms}")

    def install(self, engine: "TTSEngine") -> "EmulatedDevice":
        """Replaces ``engine``'s model step, its sampling and its decoder calls (before its first request)."""
        model, decoder, layout = engine.model, engine.decoder, engine.layout
        hidden = int(model.model.config.hidden_size)
        dtype, device = model.dtype, model.devices[0]

        def step(tokens: torch.Tensor, positions: torch.Tensor, batch: Any, **inputs: Any) -> torch.Tensor:
            # Queued on the device's own timeline: it starts when the step before it ends (or now)
            # and ends step_ms later; the launch returns at once (ModelRunner.launch, _route_launch).
            self.steps += 1
            self.device_free = max(time.monotonic(), self.device_free) + self.step_ms / 1000.0
            return torch.zeros(tokens.shape[0], hidden, dtype=dtype, device=device)

        draws = np.random.default_rng(self.seed)
        column = layout.token_column

        def sample(runner: "ModelRunner", inputs: dict[str, torch.Tensor], rows: "SamplingRows") -> torch.Tensor:
            """The step's samples, shaped as ModelRunner._sample's, from the host's sampling rows alone."""
            batch, codebook = rows.starts.shape[0], rows.codebook_size
            picks = draws.integers(0, codebook, batch)
            blocked = rows.blocked
            refused = blocked[np.arange(batch), picks]
            if refused.any():  # forced rows: the one candidate the row allows (the first, if several)
                picks[refused] = np.argmax(~blocked[refused], axis=1)
            stops = rows.extra_ids[np.arange(batch), np.maximum(picks - codebook, 0)]
            ids = torch.from_numpy(np.where(picks < codebook, rows.starts + picks, stops))
            codes_per_token = runner.frame_sampling.codes
            if codes_per_token > 1:  # [B, 1 + codes]: the id, then its frame (core/depth.py's complete)
                frames = torch.from_numpy(draws.integers(0, codebook, (batch, codes_per_token)))
                frames[:, column] = torch.from_numpy(picks)
                fixed = inputs["depth_fixed"].cpu()
                ids = torch.cat([ids[:, None], torch.where(fixed >= 0, fixed, frames)], dim=1)
            return ids.to(device)

        frame, samples = decoder.tokens_per_frame, decoder.samples_per_frame

        def silence(codes: torch.Tensor) -> torch.Tensor:
            return torch.zeros(codes.numel() // frame * samples, dtype=torch.float32)

        def decode_batch(batch: list[torch.Tensor], **_: Any) -> list[torch.Tensor]:
            self.decoder_calls += 1
            time.sleep(self.decoder_ms / 1000.0)
            return [silence(codes) for codes in batch]

        def decode_blocks(blocks: list[torch.Tensor], states: list[Any], **_: Any) -> list[tuple[torch.Tensor, Any]]:
            self.decoder_calls += 1
            time.sleep(self.decoder_ms / 1000.0)
            return [(silence(codes), state) for codes, state in zip(blocks, states)]

        model.forward = step
        _route_sampling()
        _route_launch()
        _EMULATED_SAMPLING[model] = sample
        _EMULATED_DEVICES[model] = self
        decoder.decode_batch = decode_batch
        decoder.decode_blocks = decode_blocks
        decoder.graphs = None  # nothing to capture: the calls are sleeps
        return self


def _route_sampling() -> None:
    """Makes ModelRunner._sample (once per process) sample as the emulation does for a runner whose
    model is emulated (the engine builds its runner after ``install``), as it did for the others."""
    from audio_pipeline.core.model_runner import ModelRunner

    real = ModelRunner._sample
    if getattr(real, "routes_emulated_sampling", False):
        return

    def _sample(runner: "ModelRunner", hidden: torch.Tensor, device: dict[str, torch.Tensor], rows: "SamplingRows",
                *args: Any, **kwargs: Any) -> torch.Tensor:
        emulated = _EMULATED_SAMPLING.get(runner.model)
        if emulated is not None:
            return emulated(runner, device, rows)
        return real(runner, hidden, device, rows, *args, **kwargs)

    _sample.__doc__, _sample.__wrapped__ = real.__doc__, real  # type: ignore[attr-defined]
    _sample.routes_emulated_sampling = True  # type: ignore[attr-defined]
    ModelRunner._sample = _sample


def _route_launch() -> None:
    """Makes ModelRunner.launch (once per process) launch a step of an emulated model as a GPU
    does: the host stages the inputs and queues the step, the device runs it on its own timeline
    and the step's result is ready when it ends there. So the runner of an emulated model keeps no
    worker thread (the CPU's overlap, which would hold the interpreter a device does not), and the
    host's work overlaps the device's as it does on a GPU."""
    from audio_pipeline.core.model_runner import ModelRunner

    real = ModelRunner.launch
    if getattr(real, "routes_emulated_launch", False):
        return

    def launch(runner: "ModelRunner", items: Any, **options: Any) -> Any:
        device = _EMULATED_DEVICES.get(runner.model)
        if device is None:
            return real(runner, items, **options)
        if runner._worker is not None:  # the device runs ahead by itself
            runner._worker.shutdown(wait=True)
            runner._worker = None
        pending = real(runner, items, **options)
        if pending.items:
            pending.done = Completion(device.device_free)
        return pending

    launch.__doc__, launch.__wrapped__ = real.__doc__, real  # type: ignore[attr-defined]
    launch.routes_emulated_launch = True  # type: ignore[attr-defined]
    ModelRunner.launch = launch


def install_in_every_engine(step_ms: float, decoder_ms: float) -> None:
    """Every engine core this process builds from now on runs on an emulated device, and so does
    every engine core process it starts (engine_process = subprocess): what the benchmark's server
    process does before it serves."""
    from audio_pipeline.core.assembly import CoreAssembly
    from audio_pipeline.core.process.client import CoreProcess

    build = CoreAssembly.__init__

    def emulated_init(assembly: CoreAssembly, *args: Any, **kwargs: Any) -> None:
        build(assembly, *args, **kwargs)
        assembly.emulated_device = EmulatedDevice(step_ms, decoder_ms).install(assembly)

    CoreAssembly.__init__ = emulated_init
    hook = (__name__, "install_in_every_engine", (float(step_ms), float(decoder_ms)))
    if hook not in CoreProcess.hooks:
        CoreProcess.hooks.append(hook)
