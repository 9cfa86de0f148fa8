"""Where configuration values come from, as pydantic-settings sources.

pydantic-settings reads the environment (``AUDIO_PIPELINE_<FIELD>``, ``__`` between nested names),
parses YAML and TOML files and merges the sources by precedence. What is ours: ``NAME=VALUE``
flags (read with the environment's value rules, so a value means the same in both), the choice
of file by ``config_file``/``section_name`` from a higher source, the model's streaming defaults,
and refusing unknown keys with the key and its source named: pydantic-settings skips environment
variables that name no field, and its errors do not say which source a key came from.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, BeforeValidator
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    TomlConfigSettingsSource,
    YamlConfigSettingsSource,
)
from pydantic_settings.sources.utils import parse_env_vars

#: Prefix of the environment variables that set fields: AUDIO_PIPELINE_BUFFER, AUDIO_PIPELINE_MODEL__DTYPE.
ENV_PREFIX = "AUDIO_PIPELINE_"
#: Variables with that prefix that other parts of the program read; they are not config fields.
ENV_NOT_CONFIG = frozenset({"AUDIO_PIPELINE_CACHE", "AUDIO_PIPELINE_SERVER", "AUDIO_PIPELINE_LOG_LEVEL",
                            "AUDIO_PIPELINE_TOKEN", "AUDIO_PIPELINE_AUTH_TOKENS", "AUDIO_PIPELINE_ADMIN_TOKENS",
                            "AUDIO_PIPELINE_TEST_DEVICE", "AUDIO_PIPELINE_TEST_DTYPE"})
_FILE_SOURCES = {".yaml": YamlConfigSettingsSource, ".yml": YamlConfigSettingsSource,
                 ".toml": TomlConfigSettingsSource}


def _split_commas(value: Any) -> Any:
    if isinstance(value, str) and not value.lstrip().startswith("["):
        return [part.strip() for part in value.split(",") if part.strip()]
    return json.loads(value) if isinstance(value, str) else value


_T = TypeVar("_T")
#: A list field, given as text (environment, flags) either as ``28,56,112`` or as JSON. NoDecode:
#: pydantic-settings would take JSON only.
CommaList = Annotated[_T, NoDecode, BeforeValidator(_split_commas)]


def json_values(settings: Any) -> Any:
    """Free settings given as text (environment, flags) read as JSON where they parse, else kept
    as strings: ``hop=512`` is a number, ``window=hann`` a string."""
    if not isinstance(settings, Mapping):
        return settings
    result = {}
    for key, value in settings.items():
        try:
            result[key] = json.loads(value) if isinstance(value, str) else value
        except ValueError:
            result[key] = value
    return result


#: Keys that are set under another name: a configuration written for the old name is told where to go.
MOVED = {"model.max_length": "max_length"}


def unknown_key_hint(key: str) -> str:
    """What an error about the unknown ``key`` adds when the setting lives under another name."""
    return f"; the setting is {MOVED[key]!r}" if key in MOVED else ""


def field_path(model: type[BaseModel], parts: list[str], source: str, within: tuple[str, ...] = ()) -> list[str]:
    """The field names of the key ``parts`` (of the section ``within``, named in errors); a free
    dictionary field (``audio_decoder_config``) takes the rest of the key as one entry.
    ValueError names the key and ``source`` when no field has that name."""
    path: list[str] = list(within)
    current: type[BaseModel] | None = model
    annotation: Any = None
    for index, raw in enumerate(parts):
        if current is None:
            if _is_dict(annotation):
                return path[len(within):] + [".".join(parts[index:])]
            raise ValueError(f"{'.'.join(path)} has no fields, so {'.'.join(path + parts[index:])!r} is unknown "
                             f"({source})")
        name = raw.strip()
        if name not in current.model_fields:
            key = ".".join(path + [name])
            guess = difflib.get_close_matches(name, list(current.model_fields), n=1)
            hint = unknown_key_hint(key) or (f"; did you mean {'.'.join(path + guess)!r}?" if guess else "")
            raise ValueError(f"unknown configuration key {key!r} ({source}){hint}")
        path.append(name)
        annotation = current.model_fields[name].annotation
        current = _section_model(annotation)
    return path[len(within):]


def check_keys(model: type[BaseModel], data: Mapping[str, Any], source: str, prefix: tuple[str, ...] = ()) -> None:
    """Refuses a key of the nested mapping ``data`` that names no field of ``model``."""
    for key, value in data.items():
        field_path(model, [str(key)], source, prefix)
        nested = _section_model(model.model_fields[str(key)].annotation)
        if nested is not None and isinstance(value, Mapping):
            check_keys(nested, value, source, prefix + (str(key),))


class EnvironSource(EnvSettingsSource):
    """``AUDIO_PIPELINE_*`` variables of a given environment (default: this process's; a Ray
    replica is given its caller's), refusing one that names no field."""

    def __init__(self, settings_cls: type[BaseSettings], environ: Mapping[str, str] | None = None) -> None:
        self._environ = environ
        super().__init__(settings_cls)

    def _load_env_vars(self) -> Mapping[str, str | None]:
        if self._environ is None:
            return super()._load_env_vars()
        return parse_env_vars(self._environ, self.case_sensitive, self.env_ignore_empty, self.env_parse_none_str)

    def __call__(self) -> dict[str, Any]:
        prefix, not_config = ENV_PREFIX.lower(), {name.lower() for name in ENV_NOT_CONFIG}
        for name in self.env_vars:
            if name.startswith(prefix) and name not in not_config:
                field_path(self.settings_cls, name[len(prefix):].split("__"), f"environment variable {name.upper()}")
        return super().__call__()


def flag_text(value: Any) -> str:
    """A flag's value as its NAME=VALUE text: true/false, none, lists comma-separated, objects as JSON."""
    if isinstance(value, str):
        return value
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(flag_text(item) for item in value)
    if isinstance(value, Mapping):
        return json.dumps(value)
    return str(value)


class FlagSource(EnvironSource):
    """``NAME=VALUE`` flags (``--task-arg``), or MAX's dictionary of NAME -> VALUE: dotted names
    reach nested fields, ``-`` and ``_`` alike; later flags win. Values are read as the
    environment's are (a dictionary's as :func:`flag_text` writes them)."""

    def __init__(self, settings_cls: type[BaseSettings], flags: Iterable[str] | Mapping[str, Any]) -> None:
        environ = {}
        if isinstance(flags, Mapping):
            flags = [f"{name}={flag_text(value)}" for name, value in flags.items()]
        for flag in [flags] if isinstance(flags, str) else flags:
            name, sep, value = flag.partition("=")
            if not sep:
                raise ValueError(f"audio flag {flag!r} has no '=': expected NAME=VALUE")
            path = field_path(settings_cls, name.strip().replace("-", "_").split("."), f"audio flag {flag!r}")
            environ[ENV_PREFIX + "__".join(path)] = value
        super().__init__(settings_cls, environ)


class ConfigFileSource(PydanticBaseSettingsSource):
    """The YAML or TOML file that a higher source names in ``config_file``, or its top-level
    section ``section_name``."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # __call__ reads the whole file at once

    def __call__(self) -> dict[str, Any]:
        state = self.current_state
        if state.get("config_file") is None:
            return {}
        return read_config_file(self.settings_cls, state["config_file"], state.get("section_name"))


def read_config_file(model: type[BaseSettings], path: str, section_name: str | None) -> dict[str, Any]:
    """The fields set by a YAML (.yaml, .yml) or TOML (.toml) file, or by one top-level section of it."""
    source = f"config file {str(path)!r}"
    reader = _FILE_SOURCES.get(Path(path).suffix.lower())
    if reader is None:
        raise ValueError(f"config_file {str(path)!r}: unsupported file type {Path(path).suffix!r} "
                         "(use .yaml, .yml or .toml)")
    if not Path(path).is_file():  # pydantic-settings skips a missing file; a named one must exist
        raise ValueError(f"config_file {str(path)!r} cannot be read: no such file")
    try:
        data = reader(model, Path(path))()
    except ImportError as exc:  # pydantic-settings reads TOML with tomllib, new in Python 3.11
        raise ValueError(f"config_file {str(path)!r} cannot be read here: {exc}") from None
    except (OSError, yaml.YAMLError, ValueError, TypeError) as exc:
        raise ValueError(f"config_file {str(path)!r} cannot be parsed as a mapping of field names: {exc}") from None
    if section_name is not None:
        if not isinstance(data.get(section_name), Mapping):
            raise ValueError(f"section_name {section_name!r} is not a section of {source} "
                             f"(sections: {', '.join(repr(k) for k, v in data.items() if isinstance(v, Mapping))})")
        data, source = dict(data[section_name]), f"{source} section {section_name!r}"
    for key in ("config_file", "section_name"):
        if key in data:
            raise ValueError(f"{key} cannot be set inside a config file ({source})")
    check_keys(model, data, source)
    return data


class ModelDefaultsSource(PydanticBaseSettingsSource):
    """Defaults that depend on what the sources above chose (the model's streaming settings, see
    ``_model_defaults``): below every source, above the fields' own defaults."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        return self.settings_cls._model_defaults(self.current_state)  # type: ignore[attr-defined]


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The model that ``annotation`` (perhaps ``X | None``) holds, if it is one."""
    candidates = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)
    return next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)


def _is_dict(annotation: Any) -> bool:
    return annotation is dict or get_origin(annotation) is dict
