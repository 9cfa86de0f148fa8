"""An emulated device, for measuring a GPU server's host side on a CPU (benchmarks only).

On a GPU the model's step and the audio decoder's calls run on the device while the host (the
engine loop, the scheduler, the doors, the encoders) goes on; on a small CPU the real model's
step takes the cores the host would use. With the device emulated, a step of the language model
is a sleep of ``step_ms`` and a decoder call a sleep of ``decoder_ms`` (sleeps release the
interpreter, as a device's kernels do), and everything else runs as served: the scheduler, the
runner's staging and sampling, the update, the chunking, the encoders, both doors. The step's
hidden states are zeros and its logits peaked as a trained model's are (one candidate code of each
row 20 above the rest, drawn from the emulation's own generator), so the sampler works as it does
on real speech (a flat distribution would send every row down its slow full-sort path) and every
token is a valid code; end of speech is never likely, so streams speak to max_tokens. The
decoder's audio is silence of the right length.

``bench.serve --emulate-step-ms MS --emulate-decoder-ms MS`` serves this way; in a program,
``EmulatedDevice(step_ms, decoder_ms).install(engine)``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from audio_pipeline.engine import TTSEngine


@dataclass
class EmulatedDevice:
    """Sleeps in place of the model's step and the decoder's calls; counts them."""

    step_ms: float
    decoder_ms: float = 0.0
    #: Model steps and decoder calls made so far (the benchmark's and the tests' check).
    steps: int = 0
    decoder_calls: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.step_ms < 0 or self.decoder_ms < 0:
            raise ValueError(f"emulated times must be >= 0 ms, got step {self.step_ms}, decoder {self.decoder_ms}")

    def install(self, engine: "TTSEngine") -> "EmulatedDevice":
        """Replaces ``engine``'s model step and decoder calls (before its first request)."""
        model, decoder = engine.model, engine.decoder
        hidden = int(model.model.config.hidden_size)
        dtype, device = model.dtype, model.devices[0]

        def step(tokens: torch.Tensor, positions: torch.Tensor, batch: Any, **inputs: Any) -> torch.Tensor:
            self.steps += 1
            time.sleep(self.step_ms / 1000.0)
            return torch.zeros(tokens.shape[0], hidden, dtype=dtype, device=device)

        codebook = engine.layout.codebook_size
        draws = torch.Generator().manual_seed(self.seed)

        def peaked_logits(hidden: torch.Tensor, groups: Any, order: torch.Tensor, extra_ids: torch.Tensor,
                          width: int) -> torch.Tensor:
            rows = hidden.shape[0]
            logits = torch.zeros(rows, width + extra_ids.shape[1], dtype=torch.float32)
            logits[torch.arange(rows), torch.randint(0, codebook, (rows,), generator=draws)] = 20.0
            return logits.to(device)

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
        model.compute_candidate_logits = peaked_logits
        model.compute_slot_logits = lambda hidden, starts, extra_ids, width, first, slots: peaked_logits(
            hidden, None, starts, extra_ids, width)
        decoder.decode_batch = decode_batch
        decoder.decode_blocks = decode_blocks
        decoder.graphs = None  # nothing to capture: the calls are sleeps
        return self


def install_in_every_engine(step_ms: float, decoder_ms: float) -> None:
    """Every TTSEngine this process builds from now on runs on an emulated device (what the
    benchmark's server process does before it serves)."""
    from audio_pipeline.engine import TTSEngine

    build = TTSEngine.__init__

    def emulated_init(engine: TTSEngine, *args: Any, **kwargs: Any) -> None:
        build(engine, *args, **kwargs)
        engine.emulated_device = EmulatedDevice(step_ms, decoder_ms).install(engine)

    TTSEngine.__init__ = emulated_init
