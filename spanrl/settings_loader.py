"""Settings objects filled from CLI flags, ``OTEL_SPANRL_*`` variables, a YAML file and defaults.

Used by ``spanrl train`` and ``spanrl run``: each declares a dataclass of settings, and this
module turns its fields into ``--flag-name`` options and ``OTEL_SPANRL_<PREFIX>_<FIELD>``
environment variables. Precedence: flag > environment > YAML file > default. Stdlib + PyYAML.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import types
import typing
from typing import Any, TypeVar

import yaml

from .env_settings import SettingError, parse_bool

S = TypeVar("S")


def _field_kind(cls: type, field: dataclasses.Field) -> Any:
    hint = typing.get_type_hints(cls)[field.name]
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0] if len(args) == 1 else str
        origin = typing.get_origin(hint)
    if origin in (list, tuple, dict):
        return origin
    return hint


def _parse(kind: Any, raw: Any, where: str) -> Any:
    try:
        if raw is None:
            return None
        if kind is bool:
            return raw if isinstance(raw, bool) else parse_bool(str(raw))
        if kind in (int, float, str):
            return kind(raw)
        if kind in (list, dict):
            value = json.loads(raw) if isinstance(raw, str) and kind is dict else raw
            if kind is list and isinstance(value, str):
                value = json.loads(value) if value.strip().startswith("[") else value.split(",")
            if not isinstance(value, kind):
                raise ValueError(f"expected a {kind.__name__}")
            return value
        return raw
    except (ValueError, TypeError, SettingError, json.JSONDecodeError) as exc:
        raise SettingError(f"{where}: invalid value {raw!r}: {exc}") from exc


def env_name(prefix: str, field_name: str) -> str:
    return f"OTEL_SPANRL_{prefix}_{field_name}".upper()


def add_settings_flags(parser: argparse.ArgumentParser, cls: type, prefix: str) -> None:
    """Add one ``--field-name`` option per dataclass field (help from field metadata)."""
    for field in dataclasses.fields(cls):
        kind = _field_kind(cls, field)
        flag = "--" + field.name.replace("_", "-")
        default = field.default if field.default is not dataclasses.MISSING else None
        help_text = field.metadata.get("help", "")
        help_text = f"{help_text} (env {env_name(prefix, field.name)}; default: {default!r})"
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            parser.add_argument(flag, default=None, help=help_text, metavar=field.name.upper())


def load_settings(cls: type[S], prefix: str, config_path: str | None = None,
                  args: argparse.Namespace | None = None) -> S:
    """Build ``cls`` from flags in ``args``, the environment, the YAML file, then defaults."""
    from_file: dict = {}
    if config_path:
        try:
            with open(config_path, encoding="utf-8") as f:
                from_file = yaml.safe_load(f) or {}
        except FileNotFoundError as exc:
            raise SettingError(f"config file not found: {config_path}") from exc
        except yaml.YAMLError as exc:
            raise SettingError(f"config file {config_path} is not valid YAML: {exc}") from exc
        if not isinstance(from_file, dict):
            raise SettingError(f"config file {config_path} must hold a mapping of settings")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(from_file) - names)
    if unknown:
        raise SettingError(
            f"config file {config_path} has unknown settings {unknown}; known: {sorted(names)}"
        )
    values = {}
    for field in dataclasses.fields(cls):
        kind = _field_kind(cls, field)
        flag_value = getattr(args, field.name, None) if args is not None else None
        env_value = os.environ.get(env_name(prefix, field.name))
        if flag_value is not None:
            values[field.name] = _parse(kind, flag_value, "--" + field.name.replace("_", "-"))
        elif env_value not in (None, ""):
            values[field.name] = _parse(kind, env_value, env_name(prefix, field.name))
        elif field.name in from_file:
            values[field.name] = _parse(kind, from_file[field.name], f"{config_path}: {field.name}")
    try:
        return cls(**values)
    except TypeError as exc:
        raise SettingError(f"incomplete settings: {exc}") from exc


def describe_settings(settings: Any) -> str:
    """One line per setting, for the start-up log."""
    return "\n".join(f"  {k} = {v!r}" for k, v in dataclasses.asdict(settings).items())
