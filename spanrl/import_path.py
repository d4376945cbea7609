"""Loading a Python object named ``module:attribute`` (agents for the runner, reward
functions for the trainer), with errors that say what was wrong. Stdlib only."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from .errors import UserError


def load_callable(spec: str) -> Callable[[dict], Any]:
    module_name, _, attribute = spec.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(f"cannot import module {module_name!r}: {exc}") from exc
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise UserError(f"module {module_name!r} has no attribute {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise UserError(f"{spec!r} is not callable")
    return target
