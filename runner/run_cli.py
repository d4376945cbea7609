"""``spanrl run CONFIG``: the runner command (settings in runner/settings.py).

Registered by ``core/cli.py``, which builds ``RunnerSettings`` (flags > ``OTEL_SPANRL_RUN_*``
> the YAML file > defaults), prints them and calls ``run_command``. A receiver or bridge that
cannot be reached at start (after ``bridge_wait_s``) is a ``UserError``: one line, exit 2.
"""

from __future__ import annotations

import argparse
import sys

from spanrl.settings_loader import CommandSettings

from .settings import RunnerSettings

SETTINGS = CommandSettings("run", RunnerSettings, "RUN", config_positional=True)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run",
        help="pull tasks from the trainer bridge and run your agent on each",
        description="Pull tasks from the trainer bridge and run the agent once per attempt, "
        "with the rollout identity set and OPENAI_BASE_URL pointing at the policy.",
    )
    SETTINGS.add_to(parser)
    parser.set_defaults(func=run_command)


def run_command(settings: RunnerSettings) -> int:
    import logging
    import os
    import signal

    from spanrl.errors import UserError
    from spanrl.exporter.in_process import start_tracing, stop_tracing
    from spanrl.startup_checks import wait_until_reachable

    from .agent_process import forget_runner_settings
    from .bridge_client import BridgeUnavailable
    from .runner import Runner

    forget_runner_settings()  # read into `settings` already; agents and their tools must not find them
    # without a receiver every rollout's spans would be dropped: say so instead of running blind
    wait_until_reachable(settings.otlp_endpoint, settings.bridge_wait_s, "the receiver (otlp_endpoint)",
                         "start `spanrl receive` first, or point --otlp-endpoint at its OTLP/gRPC port")
    for chatty in ("httpx", "httpx2", "openai"):  # one INFO line per agent request otherwise
        logging.getLogger(chatty).setLevel(logging.WARNING)
    # Rollouts end every few seconds: export within 0.2 s instead of the SDK's 5 s default.
    os.environ.setdefault("OTEL_BSP_SCHEDULE_DELAY", "200")
    start_tracing(settings.otlp_endpoint, instrument_openai=settings.agent is not None,
                  service_name="spanrl-runner")
    try:
        runner = Runner(settings)  # a bad agent spec raises UserError: core/cli.py says it
        signal.signal(signal.SIGTERM, lambda *_: runner.stop())
        counts = runner.run()
    except BridgeUnavailable as exc:  # at start: nothing was run yet, a setting to fix
        raise UserError(f"{exc}; start `spanrl train` first, or point --bridge-url at its task API "
                        f"(the URL `spanrl train` prints)") from exc
    finally:
        stop_tracing()
    print("rollouts: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    if runner.gave_up:
        print(f"spanrl run: {runner.stop_reason}; stopped", file=sys.stderr)
        return 1
    return 0
