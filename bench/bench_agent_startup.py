"""CPU an agent process spends starting under ``opentelemetry-instrument``: instrumentors deferred
until their library is imported (spanrl's default) against all loaded at start-up.

Starts the same agent program many times, interleaved, in three set-ups:

- ``plain``:    ``python AGENT`` (no instrumentation): the baseline;
- ``eager``:    ``opentelemetry-instrument python AGENT`` with ``OTEL_SPANRL_DEFER_INSTRUMENTORS=false``
                (every installed instrumentor loads its library at start-up, as OTel does);
- ``deferred``: the same with spanrl's default: the LLM-SDK and framework instrumentors spanrl
                depends on turn on when the agent imports their library.

The agent imports the libraries named by ``--imports`` (default ``openai``: an OpenAI agent) and
exits; spans go nowhere (``OTEL_TRACES_EXPORTER=none``). Prints each set-up's CPU seconds per
start (user + system of the child, min / median / max over ``--rounds``), what each instrumented
set-up adds over ``plain``, and the ratio eager / deferred of those additions. Which of the
instrumented libraries are installed decides what deferring saves: say so with the figures.

Run: python bench/bench_agent_startup.py [--rounds 5] [--imports openai]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys

SETUPS = ("plain", "eager", "deferred")
LIBRARIES = ("openai", "anthropic", "langchain_core", "crewai")


def child_cpu_seconds(command: list[str], env: dict[str, str]) -> float:
    """User + system CPU seconds of ``command`` and its children, run to its end."""
    before = os.times()
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    after = os.times()
    return (after.children_user - before.children_user) + (after.children_system - before.children_system)


def command_for(setup: str, imports: list[str]) -> tuple[list[str], dict[str, str]]:
    program = [sys.executable, "-c", "".join(f"import {name}\n" for name in imports) or "pass"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # every start would compile the modules it imports again
    env.update(OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none", OTEL_LOGS_EXPORTER="none")
    if setup == "plain":
        return program, env
    launcher = shutil.which("opentelemetry-instrument", path=os.path.dirname(sys.executable))
    if launcher is None:
        raise SystemExit("opentelemetry-instrument is not installed beside this Python")
    env["OTEL_SPANRL_DEFER_INSTRUMENTORS"] = "false" if setup == "eager" else "true"
    return [launcher, *program], env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="starts of each set-up, interleaved")
    parser.add_argument("--imports", nargs="*", default=["openai"], help="what the agent imports")
    args = parser.parse_args()
    installed = [name for name in LIBRARIES if importlib.util.find_spec(name) is not None]
    print(f"agent imports: {' '.join(args.imports) or 'nothing'}; "
          f"instrumented libraries installed: {' '.join(installed)}")
    commands = {setup: command_for(setup, args.imports) for setup in SETUPS}
    for setup in SETUPS:  # one untimed start each: the page cache and any bytecode written
        child_cpu_seconds(*commands[setup])
    seconds: dict[str, list[float]] = {setup: [] for setup in SETUPS}
    for number in range(args.rounds):
        for setup in SETUPS:
            seconds[setup].append(child_cpu_seconds(*commands[setup]))
        print(f"round {number + 1}/{args.rounds}: " + ", ".join(f"{s} {seconds[s][-1]:.2f} s" for s in SETUPS),
              flush=True)
    medians = {setup: statistics.median(values) for setup, values in seconds.items()}
    for setup in SETUPS:
        values = seconds[setup]
        print(f"{setup:9s} CPU per start: {min(values):.2f} / {medians[setup]:.2f} / {max(values):.2f} s "
              f"(min / median / max)")
    added = {setup: medians[setup] - medians["plain"] for setup in ("eager", "deferred")}
    print(f"added by opentelemetry-instrument (medians): eager {added['eager']:.2f} s, deferred "
          f"{added['deferred']:.2f} s; eager / deferred = {added['eager'] / max(added['deferred'], 1e-9):.2f}x")


if __name__ == "__main__":
    main()
