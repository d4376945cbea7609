"""``spanrl run CONFIG``: the runner command (settings in runner/settings.py)."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from spanrl.settings_loader import add_settings_flags

    from .settings import RunnerSettings

    parser = subparsers.add_parser(
        "run",
        help="pull tasks from the trainer bridge and run your agent on each",
        description="Pull tasks from the trainer bridge and run the agent once per attempt, "
        "with the rollout identity set and OPENAI_BASE_URL pointing at the policy.",
    )
    parser.add_argument("config", nargs="?", help="YAML file of runner settings")
    add_settings_flags(parser, RunnerSettings, "RUN")
    parser.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    import logging
    import os
    import signal

    from spanrl.env_settings import SettingError
    from spanrl.exporter.in_process import start_tracing, stop_tracing
    from spanrl.settings_loader import describe_settings, load_settings

    from .bridge_client import BridgeUnavailable
    from .runner import Runner
    from .settings import RunnerSettings

    logger = logging.getLogger("spanrl.runner")
    for chatty in ("httpx", "httpx2", "openai"):  # one INFO line per agent request otherwise
        logging.getLogger(chatty).setLevel(logging.WARNING)
    try:
        settings = load_settings(RunnerSettings, "RUN", args.config, args)
    except (SettingError, ValueError) as exc:
        print(f"spanrl run: {exc}")
        return 2
    logger.info("runner settings:\n%s", describe_settings(settings))
    # Rollouts end every few seconds: export within 0.2 s instead of the SDK's 5 s default.
    os.environ.setdefault("OTEL_BSP_SCHEDULE_DELAY", "200")
    start_tracing(settings.otlp_endpoint, instrument_openai=settings.agent is not None,
                  service_name="spanrl-runner")
    try:
        runner = Runner(settings)
    except ValueError as exc:
        print(f"spanrl run: {exc}")
        stop_tracing()
        return 2
    signal.signal(signal.SIGTERM, lambda *_: runner.stop())
    try:
        counts = runner.run()
    except BridgeUnavailable as exc:
        print(f"spanrl run: {exc}")
        return 1
    finally:
        stop_tracing()
    print("rollouts: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    if runner.gave_up:
        print(f"spanrl run: the bridge at {settings.bridge_url} stayed unreachable; stopped")
        return 1
    return 0
