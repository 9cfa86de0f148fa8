"""Built-in models: ``builtin:NAME``. The voices are shipped inside the package (package data):
``builtin:NAME`` is the directory NAME here; ``builtin:tiny-orpheus`` (a tiny random Orpheus-layout
test model) is written on first use to the cache.

``slt-en-v5`` is the built-in voice (the default model, the fifth generation: the fourth's model
retrained on a codec of the teacher's own vocoder parameters), ``slt-en-v4`` the fourth (one
backbone pass per frame, one prompt position per phoneme), ``slt-en-frame`` the third (the same
frame model with two prompt positions per phoneme, trained on less speech), ``slt-en`` the second
(four positions per frame), ``lpc-en`` the first; all are made by recipes/builtin_voice (see its
NOTES.md).
"""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile
from pathlib import Path

#: Shipped model names (directories beside this file).
SHIPPED_MODELS = ("slt-en-v5", "slt-en-v4", "slt-en", "slt-en-frame", "lpc-en")


def shipped_model_dir(name: str) -> Path:
    """The directory of shipped model ``name``; FileNotFoundError when its files are missing."""
    path = Path(__file__).resolve().parent / name
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"built-in model {name!r}: {path} is missing from this installation")
    return path


#: Built-in models written on first use: name -> (version, the writer's module and function). The
#: version is part of the cache path.
BUILTIN_MODELS = {"tiny-orpheus": (1, "audio_pipeline.testing.tiny_models", "write_tiny_orpheus_model")}


def builtin_cache_dir() -> Path:
    return Path(os.environ.get("AUDIO_PIPELINE_CACHE", Path.home() / ".cache" / "audio-pipeline"))


def resolve_builtin_model(name: str) -> Path:
    """The directory of built-in model ``name``: shipped in the package, or written on first use
    (atomically) to the cache."""
    if name in SHIPPED_MODELS:
        return shipped_model_dir(name)
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown built-in model {name!r}; available: {', '.join((*SHIPPED_MODELS, *BUILTIN_MODELS))}")
    version, module, function = BUILTIN_MODELS[name]
    target = builtin_cache_dir() / "builtin" / f"{name}-v{version}"
    if (target / "config.json").is_file():  # the whole directory appears at once (a rename)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        getattr(importlib.import_module(module), function)(staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # not a concurrent writer's finished copy
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
