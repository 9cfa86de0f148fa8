"""Where a model comes from and what it runs on: its local directory (``builtin:NAME`` or a path),
the torch device and dtype the configuration names, its tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


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


def load_tokenizer(model_dir: Path, *, plain: bool = False, family: Any = None) -> Any:
    """The model's tokenizer: its family's own (``family.tokenizer``, layouts/registry.py), else
    transformers' AutoTokenizer, or for a plain checkpoint (a family's ``plain_checkpoint``) its
    vocabulary through ``tokenizers`` alone (checkpoints/plain_config.py)."""
    if family is not None and family.tokenizer is not None:
        return family.tokenizer(Path(model_dir))
    if plain:
        from audio_pipeline.checkpoints.plain_config import VocabularyTokenizer

        return VocabularyTokenizer(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
