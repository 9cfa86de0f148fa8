"""A tiny random phoneme-lpc-frame voice (the shipped slt-en's tokenizer, front end and vocoder
around a small random Llama with a depth head, written as the recipe writes one), and the greedy
frames of a dense reference: transformers' LlamaModel over the whole sequence each frame, plus
the depth head."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

SHIPPED = Path(__file__).resolve().parent.parent / "audio_pipeline" / "builtin" / "slt-en"
#: The shipped voices' shared front end (their manifests' layout option front_end_dir).
FRONT_END = SHIPPED.parent / "front-end-en"


def write_tiny_frame_voice(path: Path, seed: int = 0, folded: bool = False) -> Path:
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from recipes.builtin_voice import frame_training
    from recipes.builtin_voice.train import model_config

    path.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SHIPPED / name, path / name)
    for name in ("lexicon.txt.gz", "prosody.json"):
        shutil.copy(FRONT_END / name, path / name)
    shutil.copytree(SHIPPED / "decoder", path / "decoder", dirs_exist_ok=True)
    torch.manual_seed(seed)
    config = LlamaConfig(**model_config(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        **frame_training.config_extra(64, folded=folded)))
    model = LlamaForCausalLM(config)
    frame_training.extend(model, config)
    with torch.no_grad():  # sharper than the default init, so greedy choices are far apart
        model.model.embed_tokens.weight.normal_(0, 0.5)
    config.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"},
              path / "model.safetensors")
    manifest = json.loads((SHIPPED / "audio_pipeline.json").read_text())
    manifest.update(family="phoneme-lpc-frame", description="tiny random phoneme-lpc-frame voice (tests)")
    manifest["layout_options"].pop("front_end_dir")  # the files are copied beside the model
    if folded:
        manifest["layout_options"] = {**manifest.get("layout_options", {}), "prompt": "folded"}
    (path / "audio_pipeline.json").write_text(json.dumps(manifest, indent=2))
    return path


def load_reference(path: Path):
    """transformers' LlamaForCausalLM of the checkpoint with its depth head loaded beside it."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from recipes.builtin_voice import frame_training

    config = LlamaConfig.from_pretrained(path)
    model = LlamaForCausalLM(config)
    frame_training.extend(model, config)
    state = load_file(path / "model.safetensors")
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model.eval()


@torch.no_grad()
def reference_frames(model, layout, prompt: list[int]) -> list[list[int]]:
    """Greedy frames of ``prompt`` (every frame of its alignment), recomputing the whole sequence
    for each one."""
    from audio_pipeline.models.frame_head import frame_embeddings, token_embeddings

    head = model.depth.head
    embedding = model.model.embed_tokens
    alignment = layout.alignment(prompt)
    ids = list(prompt)
    rows = layout.prompt_frames(prompt).tolist()
    out = []
    start = head.code_offsets[head.token_column]
    for position in range(alignment.tokens):
        tokens, frames = torch.tensor([ids]), torch.tensor([rows])
        inputs = token_embeddings(embedding, tokens, head) + frame_embeddings(embedding, frames, head)
        hidden = model.model(inputs_embeds=inputs).last_hidden_state[0, -1]
        envelope = int((hidden @ embedding.weight[start:start + head.codebook_size].T).argmax())
        prosody = int(model.depth(hidden[None], torch.tensor([envelope]), embedding)[0].argmax())
        frame = alignment.frame_codes(position)
        frame[head.token_column], frame[head.depth_column] = envelope, prosody
        out.append(frame)
        ids.append(start + envelope)
        rows.append(frame)
    return out
