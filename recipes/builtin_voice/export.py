"""Exports a trained checkpoint as an engine model directory (the built-in voice's shipped form).

    python -m recipes.builtin_voice.export --run runs/voice --out audio_pipeline/builtin/lpc-en

Writes config.json and model.safetensors (float16, from the run), the tokenizer (tokenizer.json
and tokenizer_config.json: one token per id, phonemes as ``<ph:NAME>``), the lpc decoder
(decoder/config.json and decoder/envelope_codebook.npy) and audio_pipeline.json (family
``phoneme-lpc``, the voice, the decoder).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import numpy as np

VOICE = "lpc-en"
DESCRIPTION = ("Built-in US English voice: a 4-layer Llama over eSpeak NG phonemes and durations, "
               "trained on eSpeak NG speech, LPC vocoder (recipes/builtin_voice)")


def from_checkpoint(run: Path, data: Path) -> Path:
    """Writes ``run``'s latest checkpoint.pt (a run still training) as a finished run directory."""
    import torch
    from safetensors.torch import save_file

    from recipes.builtin_voice.dataset import load
    from recipes.builtin_voice.train import model_config

    args = json.loads((run / "train_args.json").read_text())
    hidden, layers, heads = int(args["hidden"]), int(args["layers"]), int(args.get("heads", 4))
    config = model_config(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=3 * hidden,
                          num_attention_heads=heads, num_key_value_heads=heads)
    state = torch.load(run / "checkpoint.pt", map_location="cpu", weights_only=False)
    snapshot = run / f"step-{state['step']}"
    snapshot.mkdir(exist_ok=True)
    (snapshot / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.half().contiguous() for k, v in state["model"].items() if k != "lm_head.weight"},
              str(snapshot / "model.safetensors"))
    dataset = load(data)
    (snapshot / "phonemes.json").write_text(json.dumps(dataset["inventory"]))
    np.save(snapshot / "envelope_codebook.npy", dataset["centroids"])
    print(f"checkpoint of step {state['step']} -> {snapshot}")
    return snapshot


def export(run: Path, out: Path) -> Path:
    from audio_pipeline.decoders.lpc import save_lpc_decoder
    from audio_pipeline.layouts.manifest import MANIFEST_NAME
    from audio_pipeline.layouts.phoneme_lpc import write_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((run / "config.json").read_text())
    config.pop("transformers_version", None)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.copyfile(run / "model.safetensors", out / "model.safetensors")
    inventory = json.loads((run / "phonemes.json").read_text())
    write_tokenizer(out, inventory)
    if (out / "decoder").exists():
        shutil.rmtree(out / "decoder")
    save_lpc_decoder(out / "decoder", np.load(run / "envelope_codebook.npy").astype(np.float32))
    (out / MANIFEST_NAME).write_text(json.dumps({
        "family": "phoneme-lpc",
        "description": DESCRIPTION,
        "voices": [{"name": VOICE, "language": "en-US",
                    "description": "US English, trained on eSpeak NG speech (the project's own small voice)"}],
        "default_voice": VOICE,
        "audio_decoder": "lpc",
        "audio_decoder_weights": "decoder",
    }, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True, help="train.py's output directory")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--checkpoint-data", type=Path,
                        help="export the run's latest checkpoint.pt (training still going) with this dataset")
    args = parser.parse_args(argv)
    run = from_checkpoint(args.run, args.checkpoint_data) if args.checkpoint_data else args.run
    out = export(run, args.out)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"exported {out} ({size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
