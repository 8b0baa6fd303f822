"""Typed configs from plain dicts / YAML, with errors that name the bad key and the fix.

Configs are frozen dataclasses whose fields carry their documentation in ``metadata["help"]``.
``from_dict(cls, data)`` builds one recursively (nested dataclasses, ``list[...]``, ``Optional``,
``Literal``), rejecting unknown keys with the closest valid name and wrong types with the expected one.
Range checks live in each class's ``__post_init__`` and raise ``ConfigError`` through ``check``.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value or key is invalid; the message names the key path and the fix."""


def field(default: Any = dataclasses.MISSING, *, help: str, default_factory: Any = dataclasses.MISSING):
    """A dataclass field with its documentation (shown by ``describe`` and ``mrl ... --help``)."""
    kwargs: dict[str, Any] = {"metadata": {"help": help}}
    if default_factory is not dataclasses.MISSING:
        kwargs["default_factory"] = default_factory
    else:
        kwargs["default"] = default
    return dataclasses.field(**kwargs)


def check(condition: bool, key: str, message: str) -> None:
    """Raise ``ConfigError`` naming ``key`` unless ``condition`` holds."""
    if not condition:
        raise ConfigError(f"config key '{key}': {message}")


def one_line(e: BaseException) -> str:
    """``Type: first line of the message``."""
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"


def import_attribute(module: str, attr: str, where: str):
    """``module``'s (dotted) attribute ``attr``; ValueError starting ``where:`` (one line) when the module does
    not import or has no such attribute. How config values name code (``package.module:name``)."""
    import importlib

    try:
        obj = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 -- ImportError and whatever the module raises on import
        raise ValueError(f"{where}: cannot import {module!r} ({one_line(e)}); put it on PYTHONPATH or "
                         "install it") from None
    for name in attr.split("."):
        if not hasattr(obj, name):
            raise ValueError(f"{where}: module {module!r} has no {attr!r}")
        obj = getattr(obj, name)
    return obj


def config_warning(key: str, message: str) -> None:
    """One line on stderr for a config that runs but probably not as meant: ``warning: config key '...': ...``."""
    print(f"warning: config key '{key}': {message}", file=sys.stderr, flush=True)


def _suggest(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return f"{hint} Valid keys: {', '.join(sorted(valid))}."


def _type_name(tp: Any) -> str:
    """A type as ``config-help`` shows it; a choice (``Literal``) lists its allowed values."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return ("one of " if len(args) > 1 else "") + " | ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " or ".join("None" if a is type(None) else _type_name(a) for a in args)
    if origin in (list, tuple) and args:
        return f"list of {_type_name(args[0])}"
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[-1] if errors else f"config key '{key}': invalid value {value!r}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"config key '{key}': {value!r} is not one of {list(args)}.")
        return value
    if origin in (list, tuple, typing.Sequence):
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key '{key}': expected a list, got {type(value).__name__} {value!r}.")
        item = args[0] if args else Any
        items = [_convert(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}': expected a mapping, got {type(value).__name__}.")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}': expected a mapping of {_type_name(tp)} fields, got {value!r}.")
        return from_dict(tp, value, prefix=key)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"config key '{key}': expected true/false, got {value!r}.")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config key '{key}': expected an integer, got {value!r}.")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config key '{key}': expected a number, got {value!r}.")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"config key '{key}': expected a string, got {value!r}.")
        return value
    return value


def from_dict(cls: type[T], data: dict[str, Any] | None, *, prefix: str = "") -> T:
    """Build dataclass ``cls`` from ``data``; unknown keys and wrong types raise ``ConfigError``."""
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"config section '{prefix or cls.__name__}': expected a mapping, got {data!r}.")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if name not in fields:
            raise ConfigError(f"unknown config key '{key}'.{_suggest(str(name), list(fields))}")
        kwargs[name] = _convert(value, hints[name], key)
    missing = [n for n, f in fields.items() if n not in kwargs and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        where = f" in '{prefix}'" if prefix else ""
        raise ConfigError(f"missing required config key(s){where}: {', '.join(missing)}.")
    try:
        return cls(**kwargs)
    except ConfigError as e:
        if prefix and "config key '" in str(e) and f"'{prefix}." not in str(e):
            raise ConfigError(str(e).replace("config key '", f"config key '{prefix}.", 1)) from None
        raise


def to_dict(config: Any) -> Any:
    """Plain-data form of a config (round-trips through ``from_dict`` and YAML)."""
    if dataclasses.is_dataclass(config):
        return {f.name: to_dict(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if isinstance(config, (list, tuple)):
        return [to_dict(v) for v in config]
    if isinstance(config, dict):
        return {k: to_dict(v) for k, v in config.items()}
    return config


def _yaml_error(path: Path, e: yaml.YAMLError) -> str:
    """PyYAML's error as one line ``file:line:column: not valid YAML: problem``; a tab gets "use spaces"."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    what = getattr(e, "problem", None) or getattr(e, "context", None) or " ".join(str(e).split())
    if "\\t" in repr(what) or (mark is not None and _char_at(path, mark.line, mark.column) == "\t"):
        what += " (a tab: YAML indents with spaces; use spaces)"
    return f"{where}: not valid YAML: {what}"


def _char_at(path: Path, line: int, column: int) -> str:
    lines = path.read_text().splitlines()
    return lines[line][column:column + 1] if line < len(lines) else ""


def load_yaml(cls: type[T], path: str | Path) -> T:
    """Load ``cls`` from a YAML file; errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist. Pass --config with a YAML file (see experiments/).")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(_yaml_error(path, e)) from None
    try:
        return from_dict(cls, data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


def describe(cls: type, prefix: str = "") -> list[str]:
    """One line per field, ``key (type, default): help`` — the config reference."""
    lines = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            lines.extend(describe(tp, key + "."))
            continue
        item = (typing.get_args(tp) or [None])[0]
        if typing.get_origin(tp) in (list, tuple) and dataclasses.is_dataclass(item):
            need = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            lines.append(f"{key} (list of {_type_name(item)}, {'required' if need else 'default [...]'}): "
                         f"{f.metadata.get('help', '')}")
            lines.extend(describe(item, key + "[i]."))
            continue
        if f.default is not dataclasses.MISSING:
            default = f"default {f.default!r}"
        else:
            default = "required" if f.default_factory is dataclasses.MISSING else "default [...]"
        lines.append(f"{key} ({_type_name(tp)}, {default}): {f.metadata.get('help', '')}")
    return lines
