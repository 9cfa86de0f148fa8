"""Exports a trained checkpoint as an engine model directory (the built-in voice's shipped form).

    python -m recipes.builtin_voice.export --run runs/voice --out audio_pipeline/builtin/lpc-en
    python -m recipes.builtin_voice.export --run /tmp/bv3/run1 --out audio_pipeline/builtin/slt-en \
        --decoder mcep --decoder-dir /tmp/bv3/mcep --front-end /tmp/bv3 --voice slt-en   # second generation

Writes config.json and model.safetensors (float16, from the run), the tokenizer (tokenizer.json
and tokenizer_config.json: one token per id, phonemes as ``<ph:NAME>``), the lpc decoder
(decoder/config.json and decoder/envelope_codebook.npy) and audio_pipeline.json (family
``phoneme-lpc``, the voice, the decoder). With ``--decoder mcep`` the decoder directory comes from
the codec's fit (teacher_dataset.py), and ``--front-end DIR`` adds the lexicon front end's files
(lexicon.txt.gz, prosody.json) with the layout option ``front_end: lexicon`` in the manifest, and the licences of
what the voice learned from (LICENSES.md).
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


def from_checkpoint(run: Path, data: Path, name: str = "checkpoint.pt") -> Path:
    """Writes ``run``'s checkpoint ``name`` (checkpoint.pt: the latest, of a run still training;
    best.pt: the step with the lowest validation loss) as a finished run directory."""
    import torch
    from safetensors.torch import save_file

    from recipes.builtin_voice.dataset import load
    from recipes.builtin_voice.train import model_config

    args = json.loads((run / "train_args.json").read_text())
    hidden, layers, heads = int(args["hidden"]), int(args["layers"]), int(args.get("heads", 4))
    extra = {}
    if args.get("layout") == "phoneme-lpc-frame":
        from recipes.builtin_voice.frame_training import config_extra

        extra = config_extra(hidden, folded=args.get("fold_prompt") == "True")
    config = model_config(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=3 * hidden,
                          num_attention_heads=heads, num_key_value_heads=heads, **extra)
    state = torch.load(run / name, map_location="cpu", weights_only=False)
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


SECOND_DESCRIPTION = ("Built-in US English voice: a 4-layer Llama over CMU phones and learned durations, "
                      "trained on Festival's cmu_us_slt_arctic_hts speech, mel-cepstral vocoder (recipes/builtin_voice)")
#: The notices of what the second-generation voice is made from (Debian's copies).
NOTICES = {
    "Festival's CMU lexicon (festlex-cmu): the voice's lexicon.txt.gz is converted from it":
        "/usr/share/doc/festlex-cmu/copyright",
    "The cmu_us_slt_arctic_hts voice (festvox-us-slt-hts): the teacher whose speech the voice learned":
        "/usr/share/doc/festvox-us-slt-hts/copyright",
    "Festival, the teacher's synthesizer": "/usr/share/doc/festival/copyright",
}


def write_notices(out: Path) -> None:
    parts = ["# What this voice is made from, and the licences\n",
             "The voice's model, durations and codec are the audio-pipeline project's own (Apache-2.0), "
             "trained on speech that Festival made with the voice below; the lexicon is a converted "
             "form of Festival's CMU lexicon (one pronunciation per word). Their notices follow.\n"]
    for title, path in NOTICES.items():
        text = Path(path).read_text(encoding="utf-8", errors="replace") if Path(path).is_file() else "(not found)"
        parts.append(f"## {title}\n\n```\n{text.strip()}\n```\n")
    (out / "LICENSES.md").write_text("\n".join(parts))


def export(run: Path, out: Path, *, decoder: str = "lpc", decoder_dir: Path | None = None,
           front_end: Path | None = None, voice: str = VOICE) -> Path:
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
    if decoder == "lpc":
        save_lpc_decoder(out / "decoder", np.load(run / "envelope_codebook.npy").astype(np.float32))
    else:
        shutil.copytree(decoder_dir, out / "decoder")
    manifest = {
        "family": "phoneme-lpc",
        "description": DESCRIPTION,
        "voices": [{"name": voice, "language": "en-US",
                    "description": "US English, trained on eSpeak NG speech (the project's own small voice)"}],
        "default_voice": voice,
        "audio_decoder": decoder,
        "audio_decoder_weights": "decoder",
        # First audio after 2 frames, then 10-frame chunks; streams equal one-shot (causal_state).
        "streaming": {"chunk_size": [8, 40], "block_causal": True},
    }
    if front_end is not None:
        for name in ("lexicon.txt.gz", "prosody.json"):
            shutil.copyfile(front_end / name, out / name)
        write_notices(out)
        manifest.setdefault("layout_options", {})["front_end"] = "lexicon"
        manifest.update(description=SECOND_DESCRIPTION, voices=[{
            "name": voice, "language": "en-US",
            "description": "US English, learned from Festival's cmu_us_slt_arctic_hts voice (the project's own small voice)"}])
    if "frame_head" in config:  # trained with --layout phoneme-lpc-frame
        manifest.update(family="phoneme-lpc-frame", description=manifest["description"].replace(
            "a 4-layer Llama", "a 4-layer Llama run once per 20 ms frame, with a depth head,"))
        if config["frame_head"].get("fold"):  # trained with --fold-prompt
            manifest.setdefault("layout_options", {})["prompt"] = "folded"
    (out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True, help="train.py's output directory")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--checkpoint-data", type=Path,
                        help="export one of the run's checkpoints (training still going, or its best) with this dataset")
    parser.add_argument("--checkpoint", default="checkpoint.pt",
                        help="with --checkpoint-data: checkpoint.pt (the latest) or best.pt (the lowest validation loss)")
    parser.add_argument("--decoder", choices=["lpc", "mcep"], default="lpc")
    parser.add_argument("--decoder-dir", type=Path, help="with --decoder mcep: the fitted codec directory")
    parser.add_argument("--front-end", type=Path, help="a folder with lexicon.txt.gz and prosody.json")
    parser.add_argument("--voice", default=VOICE, help="the voice's name")
    args = parser.parse_args(argv)
    if args.decoder == "mcep" and args.decoder_dir is None:
        parser.error("--decoder mcep needs --decoder-dir")
    run = from_checkpoint(args.run, args.checkpoint_data, args.checkpoint) if args.checkpoint_data else args.run
    out = export(run, args.out, decoder=args.decoder, decoder_dir=args.decoder_dir, front_end=args.front_end,
                 voice=args.voice)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"exported {out} ({size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
