"""Every command's settings: one dataclass filled from flags, ``OTEL_SPANRL_*`` variables, YAML.

Each command (``receive``, ``serve``, ``train``, ``run``, ``demo``, ``model init``) declares a
dataclass whose fields carry their help in ``field(metadata={"help": ...})``, and registers it
with a ``CommandSettings``. A field ``x_y`` becomes the option ``--x-y``, the variable
``OTEL_SPANRL_<PREFIX>_X_Y`` and the YAML key ``x_y``; precedence: flag > variable > file >
default. Types come from the annotations: ``bool`` (``--x/--no-x``; true/false/1/0/yes/no),
``int``, ``float``, ``str``, ``X | None``, lists and tuples (JSON list or comma-separated; a
list flag may be repeated) and dicts (JSON object).

A field whose type is itself a dataclass is a nested block: ``trainer: TrainerConfig`` is the
YAML mapping ``trainer: {clip_ratio_low: 0.2}``, the flag ``--trainer-clip-ratio-low`` and the
variable ``OTEL_SPANRL_TRAIN_TRAINER_CLIP_RATIO_LOW``. Its ``metadata["exclude"]`` names the
nested fields that the command sets another way (a top-level key), so no setting has two names.

Other field metadata: ``positional`` (a positional argument, e.g. ``spanrl serve MODEL_DIR``),
``import_folders`` (a list of folders to import modules from: entries written in the config
file are relative to the file's folder, and that folder itself is added, so a config file
beside its reward or agent module finds it from any working directory),
``secret`` (printed as ``***``), ``deprecated_env`` (an old variable name still read, with a
warning). Values of dict settings whose key looks like a key, token, secret or password are
printed as ``***`` too, and so are credentials inside any printed text (``mask_credentials``):
the password of a URL (``https://user:***@host``), secret-looking URL parameters (``?token=***``)
and the value of secret-looking command arguments (``--api-key=***``, ``--api-key ***``). Bad
values raise ``SettingError`` naming where they came from.
Stdlib + PyYAML; imports nothing heavy, so ``spanrl --help`` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from .env_settings import parse_bool
from .errors import SettingError

logger = logging.getLogger(__name__)

S = TypeVar("S")

MASK = "***"
SECRET_KEY = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL", re.IGNORECASE)
# a name with a part (between -, _ or .) that says it holds a secret: api-key, auth_token, apikey
# (but not max-tokens or author)
_SECRET_WORD = r"[\w.-]*?(?<![a-z0-9])(?:api)?(?:key|token|secret|password|passwd|credentials?|auth)(?![a-z0-9])[\w.-]*"
URL_PASSWORD = re.compile(r"(\b[a-z][a-z0-9+.-]*://[^/@:\s]*:)[^/@\s]+(@)", re.IGNORECASE)
URL_SECRET_PARAMETER = re.compile(rf"([?&]{_SECRET_WORD}=)[^&#\s]+", re.IGNORECASE)
SECRET_ARGUMENT = re.compile(rf"((?:^|\s)--?{_SECRET_WORD}(?:=|\s+))(?!-)\S+", re.IGNORECASE)
SECRET_FLAG = re.compile(rf"--?{_SECRET_WORD}", re.IGNORECASE)


@dataclass(frozen=True)
class FieldKind:
    """What a field's annotation says about how to read it."""

    base: Any                 # bool, int, float, str, list, tuple, dict, or a dataclass (a block)
    item: Any = str           # the element type of a list or tuple
    optional: bool = False

    @property
    def is_block(self) -> bool:
        return dataclasses.is_dataclass(self.base)


def setting(default: Any, help_text: str, **metadata: Any) -> Any:
    """A settings field: its default (a list or dict default is copied for each object), its help
    text (shown by ``--help``) and any other metadata named above (``secret=True``, ...)."""
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata={"help": help_text, **metadata})
    if isinstance(default, dict):
        return dataclasses.field(default_factory=lambda: dict(default), metadata={"help": help_text, **metadata})
    return dataclasses.field(default=default, metadata={"help": help_text, **metadata})


def field_kind(cls: type, field: dataclasses.Field) -> FieldKind:
    hint = typing.get_type_hints(cls)[field.name]
    optional = False
    origin = typing.get_origin(hint)
    if origin is typing.Union or origin is types.UnionType:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        hint = args[0] if len(args) == 1 else str
        origin = typing.get_origin(hint)
    if origin in (list, tuple):
        items = [a for a in typing.get_args(hint) if a is not Ellipsis]
        return FieldKind(origin, items[0] if items else str, optional)
    if origin is dict or hint in (list, tuple, dict):
        return FieldKind(origin or hint, str, optional)
    return FieldKind(hint, str, optional)


def _scalar(kind: Any, raw: Any) -> Any:
    if kind is bool:
        return raw if isinstance(raw, bool) else parse_bool(str(raw))
    if kind is int and isinstance(raw, float) and not raw.is_integer():
        raise ValueError("expected a whole number")
    if kind in (int, float, str):
        return kind(raw)
    return raw


def _sequence(raw: Any, from_text: bool) -> list:
    """A list from YAML (a list), or from flags/variables: texts that are JSON lists or comma-separated.

    A repeated list flag arrives as a list of texts (``--corpus a.txt --corpus b.txt``).
    """
    if not from_text and isinstance(raw, (list, tuple)):
        return list(raw)
    values: list = []
    for text in raw if isinstance(raw, list) else [raw]:
        if not isinstance(text, str):
            raise ValueError("expected a list")
        if text.strip().startswith("["):
            loaded = json.loads(text)
            if not isinstance(loaded, list):
                raise ValueError("expected a JSON list")
            values.extend(loaded)
        else:
            values.extend(part.strip() for part in text.split(",") if part.strip())
    return values


def parse_value(kind: FieldKind, raw: Any, where: str, from_text: bool = True) -> Any:
    """``raw`` as a value of ``kind``: a flag's or variable's text (``from_text``) or a YAML value."""
    try:
        if raw is None:
            if kind.optional:
                return None
            raise ValueError("a value is required")
        if kind.base in (list, tuple):
            items = [_scalar(kind.item, item) for item in _sequence(raw, from_text)]
            return tuple(items) if kind.base is tuple else items
        if kind.base is dict:
            value = json.loads(raw) if isinstance(raw, str) else raw
            if not isinstance(value, dict):
                raise ValueError("expected a mapping (a JSON object)")
            return value
        return _scalar(kind.base, raw)
    except (ValueError, TypeError, SettingError) as exc:
        raise SettingError(f"{where}: invalid value {raw!r}: {exc}") from exc


def env_name(prefix: str, field_name: str) -> str:
    return f"OTEL_SPANRL_{prefix}_{field_name}".upper()


def _flag(path: str) -> str:
    return "--" + path.replace(".", "-").replace("_", "-")


def _settable_fields(cls: type, exclude: tuple = ()) -> list[tuple[dataclasses.Field, FieldKind]]:
    return [(f, field_kind(cls, f)) for f in dataclasses.fields(cls) if f.init and f.name not in exclude]


def _default_of(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def _required(field: dataclasses.Field) -> bool:
    return field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING


def add_settings_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, prefix: str,
                       _path: str = "", _exclude: tuple = ()) -> None:
    """Add one option per dataclass field (positional fields as arguments), blocks in groups."""
    for field, kind in _settable_fields(cls, _exclude):
        path = _path + field.name
        if kind.is_block:
            group = parser.add_argument_group(
                f"{field.name}: block", f"{field.metadata.get('help', '')} (YAML mapping '{field.name}:')")
            add_settings_flags(group, kind.base, prefix, path + ".", field.metadata.get("exclude", ()))
            continue
        default = "required" if _required(field) else f"default: {_default_of(field)!r}"
        help_text = (f"{field.metadata.get('help', '')} "
                     f"(env {env_name(prefix, path.replace('.', '_'))}; {default})").replace("%", "%%")
        if field.metadata.get("positional"):
            parser.add_argument(path, nargs="?", default=None, metavar=field.name.upper(), help=help_text)
        elif kind.base is bool:
            parser.add_argument(_flag(path), dest=path, action=argparse.BooleanOptionalAction,
                                default=None, help=help_text)
        elif kind.base in (list, tuple):
            parser.add_argument(_flag(path), dest=path, action="append", default=None,
                                metavar=field.name.upper(), help=help_text + " (repeatable)")
        else:
            parser.add_argument(_flag(path), dest=path, default=None, metavar=field.name.upper(),
                                help=help_text)


def read_settings_file(config_path: str) -> dict:
    import yaml

    try:
        with open(config_path, encoding="utf-8") as f:
            from_file = yaml.safe_load(f)
    except FileNotFoundError as exc:
        raise SettingError(f"config file not found: {config_path}") from exc
    except OSError as exc:
        raise SettingError(f"cannot read config file {config_path}: {exc}") from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SettingError(f"config file {config_path} is not valid YAML{where}: {problem}; fix the file "
                           "(YAML: `key: value` a line, lists as [a, b])") from exc
    except UnicodeDecodeError as exc:
        raise SettingError(f"config file {config_path} is not UTF-8 text: {exc.reason} at byte {exc.start}") from exc
    if from_file is None:
        return {}
    if not isinstance(from_file, dict):
        raise SettingError(f"config file {config_path} must hold a mapping of settings")
    return from_file


def _env_value(environ: Mapping[str, str], name: str, field: dataclasses.Field) -> tuple[str | None, str]:
    value = environ.get(name)
    if value not in (None, ""):
        return value, name
    old = field.metadata.get("deprecated_env")
    if old and environ.get(old) not in (None, ""):
        logger.warning("%s is deprecated and will be removed in the next release: use %s", old, name)
        return environ[old], old
    return None, name


def _build(cls: type, prefix: str, from_file: dict, args: argparse.Namespace | None,
           environ: Mapping[str, str], where: str, path: str = "", exclude: tuple = (),
           config_dir: str | None = None) -> Any:
    settable = _settable_fields(cls, exclude)
    known = {f.name for f, _ in settable}
    unknown = sorted(set(from_file) - known)
    for name in unknown:
        if name in exclude:
            raise SettingError(f"{where}: {path}{name} is set by the top-level key {name!r}, not inside "
                               f"'{path.rstrip('.')}:'")
    if unknown:
        raise SettingError(f"{where}: unknown settings {[path + n for n in unknown]}; known: {sorted(known)}")
    values: dict[str, Any] = {}
    for field, kind in settable:
        dotted = path + field.name
        if kind.is_block:
            block = from_file.get(field.name) or {}
            if not isinstance(block, dict):
                raise SettingError(f"{where}: {dotted} must be a mapping of settings")
            values[field.name] = _build(kind.base, prefix, block, args, environ, where, dotted + ".",
                                        tuple(field.metadata.get("exclude", ())), config_dir)
            continue
        flag_value = getattr(args, dotted, None) if args is not None else None
        env_text, env_used = _env_value(environ, env_name(prefix, dotted.replace(".", "_")), field)
        if flag_value is not None:
            shown = dotted.upper() if field.metadata.get("positional") else _flag(dotted)
            values[field.name] = parse_value(kind, flag_value, shown)
        elif env_text is not None:
            values[field.name] = parse_value(kind, env_text, env_used)
        elif field.name in from_file:
            values[field.name] = parse_value(kind, from_file[field.name], f"{where}: {dotted}", from_text=False)
            if field.metadata.get("import_folders") and config_dir is not None:
                values[field.name] = [os.path.join(config_dir, str(folder)) for folder in values[field.name]]
        elif _required(field):
            raise SettingError(f"{dotted} is required: give it as an argument, as {env_used} "
                               "or in the config file")
        if field.metadata.get("import_folders") and config_dir is not None:
            folders = list(values.get(field.name, _default_of(field)) or [])
            values[field.name] = folders + [config_dir] if config_dir not in folders else folders
    return cls(**values)


def load_settings(cls: type[S], prefix: str, config_path: str | None = None,
                  args: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None) -> S:
    """Build ``cls`` from flags in ``args``, the environment, the YAML file, then defaults."""
    from_file = read_settings_file(config_path) if config_path else {}
    config_dir = os.path.dirname(os.path.abspath(config_path)) if config_path else None
    return _build(cls, prefix, from_file, args, os.environ if environ is None else environ,
                  f"config file {config_path}", config_dir=config_dir)


def mask_credentials(text: str) -> str:
    """``text`` with the credentials it may carry replaced by ``***``: a URL's password, URL
    parameters and command arguments whose names say key, token, secret or password."""
    text = URL_PASSWORD.sub(rf"\1{MASK}\2", text)
    text = URL_SECRET_PARAMETER.sub(rf"\1{MASK}", text)
    return SECRET_ARGUMENT.sub(rf"\1{MASK}", text)


def _masked(value: Any) -> Any:
    """``value`` as printed: text masked (``mask_credentials``), in lists the argument after a
    secret flag too (``["--api-key", "sk-..."]``), in dicts the values of secret-looking keys."""
    if isinstance(value, str):
        return mask_credentials(value)
    if isinstance(value, (list, tuple)):
        shown: list[Any] = []
        for item in value:
            after_flag = bool(shown) and isinstance(shown[-1], str) and SECRET_FLAG.fullmatch(shown[-1]) is not None
            shown.append(MASK if after_flag and isinstance(item, str) else _masked(item))
        return type(value)(shown)
    if isinstance(value, dict):
        return {k: MASK if SECRET_KEY.search(str(k)) and v not in (None, "") else _masked(v) for k, v in value.items()}
    return value


def _shown(field: dataclasses.Field, value: Any) -> Any:
    if field.metadata.get("secret") and value not in (None, ""):
        return MASK
    return _masked(value)


def settings_lines(settings: Any, prefix: str, path: str = "", exclude: tuple = ()) -> list[str]:
    lines = []
    for field, kind in _settable_fields(type(settings), exclude):
        value = getattr(settings, field.name)
        if kind.is_block:
            lines += settings_lines(value, prefix, path + field.name + ".", tuple(field.metadata.get("exclude", ())))
            continue
        name = env_name(prefix, (path + field.name).replace(".", "_"))
        shown = _shown(field, value)
        text = shown if isinstance(shown, str) and shown else repr(shown)
        lines.append(f"  {path}{field.name} = {text}   ({name})")
    return lines


def describe_settings(settings: Any, prefix: str) -> str:
    """One line per setting with its variable name, secrets masked, for the start-up print."""
    return "\n".join(settings_lines(settings, prefix))


@dataclass(frozen=True)
class CommandSettings:
    """How one command reads its settings: which dataclass, which variable prefix, which file.

    ``add_to`` adds the options to the command's parser (and ``set_defaults(settings=self)``);
    ``core/cli.py`` then builds the settings with ``from_args``, prints them and calls the
    command's ``func`` with the settings object.
    """

    command: str                   # as users type it: "train", "model init"
    cls: type
    prefix: str                    # OTEL_SPANRL_<PREFIX>_<FIELD>
    config_positional: bool = False  # `spanrl train FILE` (else `--config FILE`)

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        help_text = f"YAML file of {self.command} settings (flags and OTEL_SPANRL_{self.prefix}_* variables win)"
        if self.config_positional:
            parser.add_argument("config", nargs="?", help=help_text)
        else:
            parser.add_argument("--config", default=None, metavar="FILE", help=help_text)
        parser.add_argument("--print-settings", action="store_true",
                            help="print the settings this command would run with (secrets masked) and exit")
        add_settings_flags(parser, self.cls, self.prefix)
        parser.set_defaults(settings_spec=self)

    def from_args(self, args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> Any:
        return load_settings(self.cls, self.prefix, getattr(args, "config", None), args, environ)

    def describe(self, settings: Any) -> str:
        return f"spanrl {self.command} settings:\n{describe_settings(settings, self.prefix)}"
