"""``spanrl receive``: run the OTLP receiver until SIGTERM or SIGINT.

Registered by ``core/cli.py``, which builds ``ReceiverSettings`` (each flag overrides
``OTEL_SPANRL_RECEIVER_<FLAG>``, which overrides the ``--config`` YAML file, then the default)
and prints them at start-up. A receiver that cannot start (port taken, bad AIR rules file,
unusable store, a store another receiver is writing) raises ``UserError``: one line, exit 2.
"""

from __future__ import annotations

import argparse

from spanrl.otlp_receiver.settings import ENV_PREFIX_NAME, ReceiverSettings
from spanrl.settings_loader import CommandSettings

SETTINGS = CommandSettings("receive", ReceiverSettings, ENV_PREFIX_NAME)


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "receive",
        help="OTLP receiver: spans -> durable store -> rollouts of transitions",
        description="Receive OTLP traces over gRPC and HTTP, store them durably, assemble rollouts.",
    )
    SETTINGS.add_to(parser)
    parser.set_defaults(func=handle)
    return parser


def handle(settings: ReceiverSettings) -> int:
    import logging
    import signal
    import threading

    from spanrl.errors import UserError
    from spanrl.otlp_receiver.air import AirRuleError
    from spanrl.otlp_receiver.retokenize import RetokenizeError
    from spanrl.otlp_receiver.server import ReceiverServer
    from spanrl.otlp_receiver.store import StoreError
    from spanrl.startup_checks import ensure_port_free

    log = logging.getLogger("spanrl.receive")
    cannot = "cannot start the receiver: cannot bind"
    ensure_port_free(settings.host, settings.grpc_port, "grpc_port", f"{cannot} OTLP/gRPC on")
    ensure_port_free(settings.host, settings.http_port, "http_port", f"{cannot} OTLP/HTTP on")
    try:
        server = ReceiverServer(settings).start()
    except (AirRuleError, RetokenizeError, StoreError, OSError) as exc:
        raise UserError(f"cannot start the receiver: {exc}") from exc
    stop = threading.Event()

    def request_stop(signum, frame) -> None:
        log.info("signal %d: shutting down", signum)
        stop.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    # said once the signals are handled: whoever waits for this line may stop us right away
    print(
        f"spanrl receive: ready, OTLP/gRPC {settings.host}:{server.grpc_port},"
        f" OTLP/HTTP {'https' if settings.tls else 'http'}://{settings.host}:{server.http_port},"
        f" store {settings.db}{' (TLS)' if settings.tls else ''}",
        flush=True,
    )
    while not stop.wait(0.5):
        pass
    server.stop()
    print("spanrl receive: stopped", flush=True)
    return 0
