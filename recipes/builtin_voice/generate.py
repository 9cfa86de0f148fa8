"""Speaks with a trained checkpoint directly (transformers + the LPC codec), for evaluation during the
recipe: the front-end (eSpeak NG phonemes and durations) fixes each frame's phoneme marker, the
model fills in the three acoustic tokens of every frame.

    python -m recipes.builtin_voice.generate --model runs/voice --evaluate
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from recipes.builtin_voice.dataset import align
from recipes.builtin_voice.lpc_codec import HOP, RATE
from recipes.builtin_voice.train import BOS, ENV, F0, GAIN, PHONEME, START_OF_SPEECH


class Voice:
    def __init__(self, model_dir: Path, temperature: float = 0.0):
        from transformers import LlamaForCausalLM

        from recipes.builtin_voice.espeak import ESpeak

        from audio_pipeline.decoders import load_audio_decoder
        from audio_pipeline.decoders.lpc import save_lpc_decoder

        self.model = LlamaForCausalLM.from_pretrained(model_dir).eval()
        if not (model_dir / "lpc").is_dir():
            save_lpc_decoder(model_dir / "lpc", np.load(model_dir / "envelope_codebook.npy"))
        self.decoder = load_audio_decoder("lpc", str(model_dir / "lpc"))
        self.lookup = {name: i for i, name in enumerate(json.loads((model_dir / "phonemes.json").read_text()))}
        self.frontend = ESpeak()
        self.temperature = temperature

    def schedule(self, text: str) -> tuple[list[int], np.ndarray]:
        """(phoneme ids, per frame the index of its phoneme) from the front-end."""
        u = self.frontend.synthesize(text)
        frames = int(len(u.samples) / u.sample_rate * RATE) // HOP
        names, frame_phoneme = align(u.phonemes, u.sample_rate, frames)
        pause = self.lookup.get("_", 0)
        return [self.lookup.get(n, pause) for n in names], frame_phoneme

    def _pick(self, logits: torch.Tensor, start: int, size: int) -> int:
        scores = logits[start:start + size]
        if self.temperature <= 0:
            return int(scores.argmax())
        return int(torch.multinomial(torch.softmax(scores / self.temperature, dim=0), 1))

    @torch.inference_mode()
    def speak(self, text: str) -> tuple[np.ndarray, int]:
        phonemes, frame_phoneme = self.schedule(text)
        prompt = [BOS, *(PHONEME + p for p in phonemes), START_OF_SPEECH]
        out = self.model(torch.tensor([prompt]), use_cache=True)
        past = out.past_key_values
        codes = []
        for index in frame_phoneme:
            marker = PHONEME + phonemes[index]
            out = self.model(torch.tensor([[marker]]), past_key_values=past, use_cache=True)
            env = self._pick(out.logits[0, -1], ENV, 1024)
            out = self.model(torch.tensor([[ENV + env]]), past_key_values=out.past_key_values, use_cache=True)
            f0 = self._pick(out.logits[0, -1], F0, 64)
            out = self.model(torch.tensor([[F0 + f0]]), past_key_values=out.past_key_values, use_cache=True)
            gain = self._pick(out.logits[0, -1], GAIN, 32)
            out = self.model(torch.tensor([[GAIN + gain]]), past_key_values=out.past_key_values, use_cache=True)
            past = out.past_key_values
            codes.append((phonemes[index], env, f0, gain))
        audio = self.decoder.decode(torch.tensor(codes, dtype=torch.long).reshape(-1))
        return audio.numpy(), self.decoder.sample_rate


def main(argv: list[str] | None = None) -> int:
    import tempfile

    import soundfile as sf

    from recipes.builtin_voice.corpus import held_out, sentences
    from recipes.builtin_voice.evaluate import evaluate

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--text", help="speak this into --output")
    parser.add_argument("--output", type=Path)
    parser.add_argument("--evaluate", action="store_true", help="closed-set identification and WER, 40 held-out")
    parser.add_argument("--count", type=int, default=40)
    args = parser.parse_args(argv)
    voice = Voice(args.model)
    if args.text:
        audio, rate = voice.speak(args.text)
        sf.write(args.output or "voice.wav", audio, rate)
    if args.evaluate:
        test = held_out(args.count, train=sentences(6000))
        with tempfile.NamedTemporaryFile(suffix=".jsgf") as grammar:
            result = evaluate(test, voice.speak, grammar.name)
        print(f"model {args.model}: closed-set identification {result['identified']}/{result['sentences']} "
              f"({result['accuracy']:.0%}), WER {result['wer']:.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
