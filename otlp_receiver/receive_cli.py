"""``spanrl receive``: run the OTLP receiver until SIGTERM or SIGINT.

Registered by ``spanrl/cli.py``. Each flag overrides ``OTEL_SPANRL_RECEIVER_<FLAG>``, which
overrides the default; the settings in force are printed at start-up.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from spanrl.otlp_receiver.settings import HELP, ReceiverSettings, env_name

_BOOL_FIELDS = {"complete_on_rollout_span"}


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "receive",
        help="OTLP receiver: spans -> durable store -> rollouts of transitions",
        description="Receive OTLP traces over gRPC and HTTP, store them durably, assemble rollouts.",
    )
    for f in fields(ReceiverSettings):
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{HELP.get(f.name, '')} (env {env_name(f.name)}; default {f.default!r})"
        if f.name in _BOOL_FIELDS:
            parser.add_argument(flag, dest=f.name, default=None, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            kind = str if f.type in ("str", "str | None") else (int if f.type == "int" else float)
            parser.add_argument(flag, dest=f.name, default=None, type=kind, help=help_text)
    parser.set_defaults(func=handle)
    return parser


def handle(args: argparse.Namespace) -> int:
    import logging
    import signal
    import threading

    from spanrl.env_settings import SettingError
    from spanrl.otlp_receiver.air import AirRuleError
    from spanrl.otlp_receiver.retokenize import RetokenizeError
    from spanrl.otlp_receiver.server import ReceiverServer
    from spanrl.otlp_receiver.settings import settings_from
    from spanrl.otlp_receiver.store import StoreError

    log = logging.getLogger("spanrl.receive")
    try:
        settings = settings_from({f.name: getattr(args, f.name, None) for f in fields(ReceiverSettings)})
        print("spanrl receive settings:\n" + settings.describe(), flush=True)
        server = ReceiverServer(settings).start()
    except (SettingError, AirRuleError, RetokenizeError, StoreError, OSError) as exc:
        log.error("cannot start the receiver: %s", exc)
        return 2
    print(
        f"spanrl receive: ready, OTLP/gRPC {settings.host}:{server.grpc_port},"
        f" OTLP/HTTP http://{settings.host}:{server.http_port}, store {settings.db}",
        flush=True,
    )
    stop = threading.Event()

    def request_stop(signum, frame) -> None:
        log.info("signal %d: shutting down", signum)
        stop.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    while not stop.wait(0.5):
        pass
    server.stop()
    print("spanrl receive: stopped", flush=True)
    return 0
