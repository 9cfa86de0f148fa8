"""Models shipped inside the package (package data): ``builtin:NAME`` is the directory NAME here.

``slt-en-frame`` is the built-in voice (the default model: one backbone pass per frame), ``slt-en``
the same voice with four positions per frame, ``lpc-en`` the first generation; all are made by
recipes/builtin_voice (see its NOTES.md).
"""

from __future__ import annotations

from pathlib import Path

#: Shipped model names (directories beside this file).
SHIPPED_MODELS = ("slt-en", "slt-en-frame", "lpc-en")


def shipped_model_dir(name: str) -> Path:
    """The directory of shipped model ``name``; FileNotFoundError when its files are missing."""
    path = Path(__file__).resolve().parent / name
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"built-in model {name!r}: {path} is missing from this installation")
    return path
