"""Loading a Python object named ``module:attribute`` (agents for the runner, reward
functions for the trainer), with errors that say what was wrong. Stdlib only.

Where modules are found: the folders given (``python_path``; a config file's own folder is
among them, see ``settings_loader``), then the usual ``sys.path``, then the current directory
(a console script, unlike ``python -m``, does not put it on ``sys.path``).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from .errors import UserError


def add_import_folders(folders: Sequence[str]) -> None:
    """Put ``folders`` first on ``sys.path`` (in their order) and the current directory last."""
    for folder in reversed([os.path.abspath(f) for f in folders]):
        if folder in sys.path:
            sys.path.remove(folder)
        sys.path.insert(0, folder)
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())


def load_callable(spec: str, search_path: Sequence[str] = ()) -> Callable[[dict], Any]:
    """The callable ``module:attribute`` names, importable from ``search_path`` folders."""
    add_import_folders(search_path)
    module_name, _, attribute = spec.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        hint = ""
        if isinstance(exc, ModuleNotFoundError) and exc.name and module_name.split(".")[0] == exc.name.split(".")[0]:
            where = ", ".join([os.path.abspath(f) for f in search_path] + [os.getcwd()])
            hint = (f" (searched {where} and the installed packages: put the module's folder in "
                    "python_path, or the config file beside the module)")
        raise UserError(f"cannot import module {module_name!r}: {exc}{hint}") from exc
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise UserError(f"module {module_name!r} has no attribute {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise UserError(f"{spec!r} is not callable")
    return target
