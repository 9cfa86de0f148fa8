"""The configuration reference page, docs/configuration-reference.md, written from the settings' own
field descriptions: ``python -m audio_pipeline.config_reference --write`` (without ``--write`` it
prints the page). ``tests/test_docs.py`` fails while the committed page differs from it."""

from __future__ import annotations

import argparse
import sys
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from audio_pipeline.config import sources
from audio_pipeline.config.settings import AudioGenerationConfig

#: The committed page, relative to the repository root.
PAGE = Path("docs") / "configuration-reference.md"
#: The command that rewrites it.
REGENERATE = ".venv/bin/python -m audio_pipeline.config_reference --write"


@dataclass(frozen=True)
class Setting:
    """One configuration field as a user sets it."""

    name: str
    flag: str | None
    env: str
    type: str
    default: str
    description: str
    free_keys: bool


@dataclass(frozen=True)
class Section:
    name: str
    description: str
    settings: list[Setting]


def sections(model: type[BaseModel] = AudioGenerationConfig) -> list[Section]:
    """The settings of ``model``, the top-level ones first, then one section per nested model, in
    the order the fields are declared."""
    flags = dedicated_flags()
    found: list[Section] = []

    def walk(section_model: type[BaseModel], path: tuple[str, ...], description: str) -> None:
        section = Section(".".join(path), description, [])
        found.append(section)
        nested = []
        for name, field in section_model.model_fields.items():
            inner = sources._section_model(field.annotation)
            if inner is not None:
                nested.append((inner, path + (name,), field.description or ""))
                continue
            dotted = ".".join(path + (name,))
            section.settings.append(Setting(
                name=dotted, flag=flags.get(dotted), env=sources.ENV_PREFIX + "__".join(path + (name,)).upper(),
                type=type_text(field.annotation) + _bounds_text(field), default=_default_text(field),
                description=" ".join((field.description or "").split()), free_keys=sources._is_dict(field.annotation)))
        for inner, inner_path, inner_description in nested:
            walk(inner, inner_path, inner_description)

    walk(model, (), "")
    return found


def dedicated_flags() -> dict[str, str]:
    """The command-line flags of ``audio-pipeline`` that set one field, by the field's dotted name:
    read from the parser and from the mapping the command line uses (``cli.config_overrides``)."""
    from audio_pipeline.cli import build_parser, config_overrides

    parser = build_parser()
    commands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    command = commands.choices["config"]
    fields = AudioGenerationConfig.model_fields
    found = {}
    for action in command._actions:
        if not action.option_strings or action.nargs == 0:
            continue
        flag = max(action.option_strings, key=len)
        value = list(action.choices)[-1] if action.choices else "x"
        args = command.parse_args([flag, str(value)])
        names = list(_dotted(config_overrides(args)))
        if not names and action.dest in fields and sources._section_model(fields[action.dest].annotation) is None:
            names = [action.dest]  # --config-file, --section-name: passed to load() under their own names
        for name in names:
            found[name] = flag
    return found


def type_text(annotation: Any) -> str:
    """A field's type in words: ``integer or none``, one of `auto`, `float32`, a list of integers."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Annotated:
        return type_text(args[0])
    if origin in (Union, UnionType):
        parts = [type_text(arg) for arg in args if arg is not type(None)]
        text = " or ".join(parts)
        return f"{text}, or none" if type(None) in args else text
    if origin is Literal:
        return "one of " + ", ".join(f"`{value}`" for value in args)
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return "one of " + ", ".join(f"`{member.value}`" for member in annotation)
    if origin is list:
        return f"a list of {_plural(type_text(args[0]))} (`1,2,3` or JSON)"
    if sources._is_dict(annotation):
        return "a mapping (JSON)"
    return {bool: "boolean", int: "integer", float: "number", str: "string"}.get(annotation, str(annotation))


def render() -> str:
    """The reference page as markdown."""
    lines = [
        "# Configuration reference",
        "",
        "Every setting of `AudioGenerationConfig`, written from the settings' own descriptions in",
        "`audio_pipeline/config/settings.py` by:",
        "",
        "```bash",
        REGENERATE,
        "```",
        "",
        "Edit the descriptions there, not this page. [Configuration](configuration.md) explains where",
        "values come from and which source wins.",
        "",
        "Each setting is set by any of:",
        "",
        "- a flag, `--task-arg NAME=VALUE` with the setting's dotted name (`-` and `_` alike), or the",
        "  dedicated flag where it has one;",
        "- the environment variable shown (`__` between the names of nested settings);",
        "- a key of a `--config-file` (YAML or TOML), sections as nested mappings.",
        "",
        "Values are text in flags and variables: lists as `28,56,112` or JSON, `none` for a setting",
        "that may be unset, booleans as `true`/`false`, sections and mappings as JSON.",
    ]
    for section in sections():
        lines += ["", f"## `{section.name}`" if section.name else "## Top-level settings"]
        if section.description:
            lines += ["", section.description]
        for setting in section.settings:
            lines += ["", f"### `{setting.name}`", ""]
            if setting.description:
                lines += [setting.description, ""]
            lines.append(f"- type: {setting.type}; default: {setting.default}")
            ways = [f"`--task-arg {setting.name}=VALUE`"]
            if setting.free_keys:
                ways.append(f"`--task-arg {setting.name}.KEY=VALUE` (one entry)")
            if setting.flag:
                ways.insert(0, f"`{setting.flag} VALUE`")
            lines.append("- flag: " + ", ".join(ways))
            env = f"`{setting.env}`"
            if setting.free_keys:
                env += f", `{setting.env}__KEY` (one entry)"
            lines.append(f"- environment: {env}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m audio_pipeline.config_reference", description=__doc__)
    parser.add_argument("--write", action="store_true", help=f"write {PAGE} (from the repository root)")
    args = parser.parse_args(argv)
    page = render()
    if args.write:
        target = Path(__file__).resolve().parents[1] / PAGE
        target.write_text(page)
        print(f"wrote {target}", file=sys.stderr)
    else:
        sys.stdout.write(page)
    return 0


def _default_text(field: Any) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "none (required)"
    else:
        value = field.default
    if isinstance(value, Enum):
        value = value.value
    text = sources.flag_text(value)
    return f"`{text}`" if text else "empty"


def _bounds_text(field: Any) -> str:
    """The field's numeric bounds (pydantic's ge, gt, le, lt) in words: ``; at least 1``."""
    words = {"ge": "at least", "gt": "above", "le": "at most", "lt": "below"}
    bounds = [f"{words[name]} {getattr(item, name)}" for item in field.metadata for name in words
              if hasattr(item, name)]
    return "; " + ", ".join(bounds) if bounds else ""


def _dotted(values: Mapping[str, Any], prefix: str = "") -> Iterator[str]:
    for key, value in values.items():
        if isinstance(value, Mapping):
            yield from _dotted(value, f"{prefix}{key}.")
        else:
            yield prefix + key


def _plural(text: str) -> str:
    return {"integer": "integers", "number": "numbers", "string": "strings", "boolean": "booleans"}.get(text, text)


if __name__ == "__main__":
    sys.exit(main())
