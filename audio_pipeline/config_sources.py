"""Where configuration values come from: config files, environment variables and NAME=VALUE flags.

Every function returns a nested dict keyed by field names (``-`` read as ``_``), checked against
the pydantic model it is meant for, so that an unknown key is reported with the place it came from.
"""

from __future__ import annotations

import difflib
import json
import math
import re
import types
from collections.abc import Iterable, Mapping
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: TOML files need 3.11's tomllib
    tomllib = None  # type: ignore[assignment]

#: Prefix of the environment variables that set fields: AUDIO_PIPELINE_BUFFER, AUDIO_PIPELINE_MODEL__DTYPE.
ENV_PREFIX = "AUDIO_PIPELINE_"
#: Variables with that prefix that other parts of the program read; they are not config fields.
ENV_NOT_CONFIG = frozenset({"AUDIO_PIPELINE_CACHE", "AUDIO_PIPELINE_SERVER", "AUDIO_PIPELINE_LOG_LEVEL",
                            "AUDIO_PIPELINE_TOKEN", "AUDIO_PIPELINE_AUTH_TOKENS", "AUDIO_PIPELINE_ADMIN_TOKENS"})
_NONE_WORDS = ("none", "")
_INT = re.compile(r"[+-]?\d+")


def deep_merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` updated by ``top``; nested mappings (and models) merge key by key, ``top`` winning."""
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, BaseModel):
            value = value.model_dump(exclude_unset=True)
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def read_config_file(model: type[BaseModel], path: str | Path, section_name: str | None) -> dict[str, Any]:
    """The fields set by a YAML (.yaml, .yml) or TOML (.toml) file, or by one top-level section of it."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".yaml", ".yml", ".toml"):
        raise ValueError(f"config_file {str(path)!r}: unsupported file type {suffix!r} (use .yaml, .yml or .toml)")
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"config_file {str(path)!r} cannot be read: {exc.strerror or exc}") from None
    try:
        if suffix == ".toml":
            if tomllib is None:
                raise ValueError("TOML config files need Python 3.11 or newer")
            data = tomllib.loads(text)
        else:
            data = yaml.safe_load(text)
    except (yaml.YAMLError, ValueError) as exc:
        raise ValueError(f"config_file {str(path)!r} cannot be parsed: {exc}") from None
    data = {} if data is None else data
    if not isinstance(data, Mapping):
        raise ValueError(f"config_file {str(path)!r} must hold a mapping of field names, not {type(data).__name__}")
    source = f"config file {str(path)!r}"
    if section_name is not None:
        if section_name not in data:
            raise ValueError(f"section_name {section_name!r} is not a section of {source} "
                             f"(sections: {', '.join(map(repr, data)) or 'none'})")
        data = data[section_name]
        source += f" section {section_name!r}"
        if not isinstance(data, Mapping):
            raise ValueError(f"{source} must be a mapping of field names, not {type(data).__name__}")
    for key in ("config_file", "section_name"):
        if key in data:
            raise ValueError(f"{key} cannot be set inside a config file ({source})")
    return normalize_mapping(model, data, source)


def normalize_mapping(model: type[BaseModel], data: Mapping[str, Any], source: str) -> dict[str, Any]:
    """``data`` with its keys checked against ``model``; keys may be nested, dotted or ``__``-joined."""
    result: dict[str, Any] = {}
    for raw_key, value in data.items():
        parts = re.split(r"\.|__", str(raw_key))
        path, annotation = _field_path(model, parts, source, written=str(raw_key))
        nested_model, _ = _section_model(annotation)
        if nested_model is not None and isinstance(value, Mapping):
            value = normalize_mapping(nested_model, value, source + f" under {'.'.join(path)!r}")
        result = deep_merge(result, _nest(path, value))
    return result


def parse_env(model: type[BaseModel], env: Mapping[str, str]) -> dict[str, Any]:
    """The fields set by ``AUDIO_PIPELINE_<FIELD>`` variables (nested fields joined by ``__``)."""
    result: dict[str, Any] = {}
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX) or name in ENV_NOT_CONFIG:
            continue
        source = f"environment variable {name}"
        path, annotation = _field_path(model, name[len(ENV_PREFIX):].lower().split("__"), source)
        result = deep_merge(result, _nest(path, parse_value(annotation, env[name], ".".join(path), source)))
    return result


def parse_flags(model: type[BaseModel], flags: Iterable[str] | Mapping[str, Any]) -> dict[str, Any]:
    """The fields set by ``NAME=VALUE`` strings (``--task-arg``), or a mapping of names to values.

    Strings are parsed by the field's type (see ``parse_value``); other values in a mapping are
    taken as they are. Later flags win over earlier ones.
    """
    if isinstance(flags, Mapping):
        pairs = [(str(name), value, f"audio flag {name!r}") for name, value in flags.items()]
    else:
        if isinstance(flags, str):
            flags = [flags]
        pairs = []
        for flag in flags:
            name, sep, value = flag.partition("=")
            if not sep:
                raise ValueError(f"audio flag {flag!r} has no '=': expected NAME=VALUE")
            pairs.append((name, value, f"audio flag {flag!r}"))
    result: dict[str, Any] = {}
    for name, value, source in pairs:
        if not isinstance(value, str):
            result = deep_merge(result, normalize_mapping(model, {name.strip(): value}, source))
            continue
        path, annotation = _field_path(model, name.strip().split("."), source)
        result = deep_merge(result, _nest(path, parse_value(annotation, value, ".".join(path), source)))
    return result


def parse_value(annotation: Any, text: str, key: str, source: str) -> Any:
    """``text`` read as a value of type ``annotation``; ValueError naming ``key`` and ``source``.

    Booleans are only true/false, integers and floats are parsed strictly, enums by value, lists
    are comma-separated, ``none`` (or nothing) clears an optional field, and settings of free
    dictionaries are JSON when they parse as JSON and strings otherwise.
    """
    kind, optional = _unwrap(annotation)
    word = text.strip()

    def bad(expected: str) -> ValueError:
        return ValueError(f"invalid value {text!r} for {key} ({source}): expected {expected}")

    if optional and word.lower() in _NONE_WORDS:
        return None
    if kind is Any:
        try:
            return json.loads(word)
        except ValueError:
            return text
    if kind is bool:
        if word.lower() not in ("true", "false"):
            raise bad("true or false")
        return word.lower() == "true"
    if kind is int:
        if not _INT.fullmatch(word):
            raise bad("an integer")
        return int(word)
    if kind is float:
        try:
            number = float(word)
        except ValueError:
            raise bad("a number") from None
        if not math.isfinite(number):
            raise bad("a finite number")
        return number
    if isinstance(kind, type) and issubclass(kind, Enum):
        for member in kind:
            if word.lower() == str(member.value).lower():
                return member
        raise bad("one of " + ", ".join(str(m.value) for m in kind))
    if get_origin(kind) is Literal:
        if word not in get_args(kind):
            raise bad("one of " + ", ".join(map(str, get_args(kind))))
        return word
    if get_origin(kind) is list:
        (item,) = get_args(kind)
        return [parse_value(item, part, key, source) for part in word.split(",") if part.strip()]
    if get_origin(kind) is dict or (isinstance(kind, type) and issubclass(kind, BaseModel)):
        try:
            value = json.loads(word)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise bad(f"a JSON object, or set one entry with {key}.NAME=VALUE")
        return value
    return text


def _field_path(model: type[BaseModel], parts: list[str], source: str,
                written: str | None = None) -> tuple[list[str], Any]:
    """Field names of the dotted key ``parts`` and the annotation of the last one.

    Names may use ``-`` for ``_``. Below a free dictionary field (``audio_decoder_config``) the rest
    of the key is one setting name, kept as written. Errors quote ``written`` (default: dotted parts).
    """
    written = ".".join(parts) if written is None else written
    path: list[str] = []
    annotation: Any = None
    current: type[BaseModel] | None = model
    for index, raw in enumerate(parts):
        if current is None:
            if _unwrap(annotation)[0] is dict or get_origin(_unwrap(annotation)[0]) is dict:
                return path + [".".join(parts[index:])], Any
            raise ValueError(f"{'.'.join(path)} has no fields, so {written!r} is unknown ({source})")
        name = raw.strip().replace("-", "_")
        if name not in current.model_fields:
            guess = difflib.get_close_matches(name, list(current.model_fields), n=1)
            hint = f"; did you mean {'.'.join(path + guess)!r}?" if guess else ""
            raise ValueError(f"unknown configuration key {written!r} ({source}){hint}")
        path.append(name)
        annotation = current.model_fields[name].annotation
        current, _ = _section_model(annotation)
    return path, annotation


def _section_model(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    kind, optional = _unwrap(annotation)
    return (kind if isinstance(kind, type) and issubclass(kind, BaseModel) else None), optional


def _unwrap(annotation: Any) -> tuple[Any, bool]:
    """(the type inside ``X | None`` and ``Annotated[X, ...]``, whether None is allowed)."""
    optional = False
    if get_origin(annotation) in (Union, types.UnionType):
        args = [arg for arg in get_args(annotation) if arg is not type(None)]
        optional = len(args) < len(get_args(annotation))
        annotation = args[0] if len(args) == 1 else Any
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) is list:
        (item,) = get_args(annotation)
        annotation = list[_unwrap(item)[0]]
    return annotation, optional


def _nest(path: list[str], value: Any) -> dict[str, Any]:
    for name in reversed(path[1:]):
        value = {name: value}
    return {path[0]: value}
