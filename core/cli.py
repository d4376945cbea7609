"""The ``spanrl`` console script: one entry point, one subcommand per component.

Each subcommand lives in its component's own ``*_cli`` module, which exposes
``add_parser(subparsers)`` and sets ``func`` on its parser. Those modules import nothing heavy
at module level, so ``spanrl --help`` stays fast and never imports torch. A module that fails
to import is a bug: ``spanrl`` stops with its traceback instead of dropping the command.

A command with a settings object registers a ``settings_loader.CommandSettings`` (its parser's
``settings_spec`` default): ``main`` builds the settings (flags > ``OTEL_SPANRL_*`` > YAML >
defaults), prints them (secrets masked) and calls ``func(settings)``; ``--print-settings``
stops there. Other commands get ``func(args)``.

Errors are told apart in one place, ``main``: a ``spanrl.errors.UserError`` (bad setting,
missing file, taken port) is one line on stderr, ``spanrl <command>: <message>``, exit 2;
anything else is a bug and shows its traceback, exit 1; Ctrl-C exits 130. A reader that closes
the pipe early (``spanrl inspect ... | head``) ends the command quietly with exit 141.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import traceback
from typing import Any

from .errors import UserError
from .progress import quiet_library_bars

# command name -> module that defines it (in the order ``--help`` lists them)
COMMAND_MODULES = {
    "init": "spanrl.init_cli",
    "receive": "spanrl.otlp_receiver.receive_cli",
    "inspect": "spanrl.otlp_receiver.inspect_cli",
    "model": "spanrl.trainer_bridge.torch_backend.model_cli",
    "sft": "spanrl.trainer_bridge.sft_cli",
    "serve": "spanrl.trainer_bridge.torch_backend.serve_cli",
    "proxy": "spanrl.trainer_bridge.relay.proxy_cli",
    "prompts": "spanrl.trainer_bridge.prompts_cli",
    "train": "spanrl.trainer_bridge.train_cli",
    "eval": "spanrl.trainer_bridge.eval_cli",
    "run": "spanrl.runner.run_cli",
    "dashboard": "spanrl.dashboard.dashboard_cli",
    "demo": "spanrl.demo",
    "doctor": "spanrl.doctor",
}


class CommandImportError(ImportError):
    """A subcommand's module cannot be imported: a broken install or a bug, never skipped."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spanrl",
        description="Train the LLM inside an existing agent with RL, from its OpenTelemetry traces.",
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in COMMAND_MODULES.items():
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:
            raise CommandImportError(
                f"the {name!r} command's module {module_name} failed to import: {type(exc).__name__}: {exc}"
            ) from exc
        module.add_parser(subparsers)
    return parser


def settings_from_args(argv: list[str]) -> Any:
    """The settings object ``spanrl <argv>`` would run with, built without running the command."""
    args = build_parser().parse_args(argv)
    spec = getattr(args, "settings_spec", None)
    if spec is None:
        raise UserError(f"`spanrl {' '.join(argv)}` has no settings object")
    return spec.from_args(args)


def _run(args: argparse.Namespace) -> int:
    spec = getattr(args, "settings_spec", None)
    if spec is None:
        return int(args.func(args) or 0)
    settings = spec.from_args(args)
    print(spec.describe(settings), flush=True)
    if args.print_settings:
        return 0
    return int(args.func(settings) or 0)


def _quiet_stdout() -> None:
    """After EPIPE on stdout: point it at /dev/null so the interpreter's own flush at exit does not
    print a second BrokenPipeError (as Python's docs on SIGPIPE recommend)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def main(argv: list[str] | None = None) -> int:
    command = "spanrl"
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        logging.basicConfig(
            level=getattr(logging, str(args.log_level).upper(), logging.INFO),
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
        quiet_library_bars()  # stderr is a file or a pipe: no library redraws a bar into it
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        spec = getattr(args, "settings_spec", None)
        command = f"spanrl {spec.command if spec is not None else args.command}"
        status = _run(args)
        sys.stdout.flush()  # a reader that left early (`| head`) shows here, in the handler below
        return status
    except BrokenPipeError:
        _quiet_stdout()
        return 141  # 128 + SIGPIPE, what a shell reports for a program killed by a closed pipe
    except UserError as exc:
        message = " ".join(str(exc).splitlines())  # one line, whatever the message holds
        print(f"{command}: {message}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception:  # a bug: the traceback is what a report needs
        traceback.print_exc()
        print(f"{command}: internal error (a bug, not a setting): please report it with the traceback above",
              file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
