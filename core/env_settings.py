"""Reading ``OTEL_SPANRL_*`` environment variables with types and clear errors.

Every component's settings object is filled from CLI flags, then these variables, then
defaults. Stdlib only: agent-side code uses it too.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar, cast

from .errors import SettingError

__all__ = ["SettingError", "env_value", "parse_bool"]

T = TypeVar("T")

TRUE_WORDS = {"1", "true", "yes", "on"}
FALSE_WORDS = {"0", "false", "no", "off"}


def parse_bool(text: str) -> bool:
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise SettingError(f"expected one of {sorted(TRUE_WORDS | FALSE_WORDS)}, got {text!r}")


def env_value(name: str, default: T, parse: Callable[[str], T] | None = None) -> T:
    """The value of environment variable ``name`` parsed like ``default``, or ``default``.

    ``parse`` defaults to the type of ``default`` (``bool`` understands true/false/1/0/yes/no).
    """
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    reader: Callable[[str], Any]
    if parse is not None:
        reader = parse
    elif isinstance(default, bool):
        reader = parse_bool
    elif default is None:
        reader = str
    else:
        reader = cast(Callable[[str], Any], type(default))
    try:
        return cast(T, reader(raw))
    except (ValueError, SettingError) as exc:
        raise SettingError(f"environment variable {name}={raw!r} is invalid: {exc}") from exc
