"""The ``spanrl`` console script: one entry point, one subcommand per component.

Each subcommand lives in its component's own ``*_cli`` module, which exposes
``add_parser(subparsers)`` and sets ``func`` on its parser. Those modules import nothing heavy
at module level, so ``spanrl --help`` stays fast and never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# command name -> module that defines it (in the order ``--help`` lists them)
COMMAND_MODULES = {
    "receive": "spanrl.otlp_receiver.receive_cli",
    "inspect": "spanrl.otlp_receiver.inspect_cli",
    "model": "spanrl.trainer_bridge.torch_backend.model_cli",
    "serve": "spanrl.trainer_bridge.torch_backend.serve_cli",
    "train": "spanrl.trainer_bridge.train_cli",
    "run": "spanrl.runner.run_cli",
    "demo": "spanrl.demo",
}


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
        except ModuleNotFoundError as exc:
            if exc.name is not None and exc.name.startswith("spanrl"):
                continue  # a component not built yet in this checkout
            raise
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
