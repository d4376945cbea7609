"""``spanrl dashboard``: serve the read-only web dashboard over a store and a run's output folder.

Registered by ``core/cli.py``, which builds ``DashboardSettings`` (flag > ``OTEL_SPANRL_DASHBOARD_*``
> ``--config`` YAML > default) and prints them. Runs uvicorn until SIGINT or SIGTERM. A store or
output folder that is missing or wrong does not stop it: the pages say what is wrong (training
may create them later). Needs the ``dashboard`` extra (FastAPI, uvicorn, Jinja2); without it the
command says what to install.
"""

from __future__ import annotations

import argparse

from spanrl.server_connections import IDLE_CONNECTION_TIMEOUT_S
from spanrl.settings_loader import CommandSettings

from .settings import ENV_PREFIX_NAME, DashboardSettings

SETTINGS = CommandSettings("dashboard", DashboardSettings, ENV_PREFIX_NAME)


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "dashboard",
        help="web dashboard: watch training, look inside any rollout (read-only)",
        description="Serve a read-only web dashboard over a span store and a training run's output folder.",
    )
    SETTINGS.add_to(parser)
    parser.set_defaults(func=handle)
    return parser


def handle(settings: DashboardSettings) -> int:
    import logging
    import socket

    from spanrl.errors import UserError
    from spanrl.startup_checks import ensure_port_free

    try:
        import uvicorn

        from .app import create_app
    except ImportError as exc:
        raise UserError(f"the dashboard needs FastAPI, uvicorn and Jinja2 ({exc}); install them with "
                        "`pip install 'spanrl[dashboard]'`") from exc
    ensure_port_free(settings.host, settings.port, "port", "the dashboard cannot listen on")
    # bind first, so port 0 can be told and a taken port fails here, before uvicorn starts
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    sock = socket.create_server((settings.host, settings.port), family=family)
    port = sock.getsockname()[1]
    config = uvicorn.Config(create_app(settings), log_level="warning", access_log=False,
                            timeout_keep_alive=IDLE_CONNECTION_TIMEOUT_S)
    server = uvicorn.Server(config)
    logging.getLogger("spanrl.dashboard").info("serving store %s and run %s", settings.store, settings.output_dir)
    print(f"spanrl dashboard: ready, http://{settings.host}:{port}/", flush=True)
    server.run(sockets=[sock])
    print("spanrl dashboard: stopped", flush=True)
    return 0
