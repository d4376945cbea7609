"""The agent command as a child process: its environment, how the task reaches it, its output.

Called by ``attempts.run_command_attempt`` once per attempt (and by ``run_cli`` for
``forget_runner_settings``). What the child gets and what the runner keeps of it:

- its environment is the runner's minus the runner's and the trainer's own settings variables
  (``OTEL_SPANRL_RUN_*``, ``OTEL_SPANRL_TRAIN_*``: the bridge token among them), plus the rollout
  identity, the policy endpoint, the OTLP endpoint and the task;
- the task arrives as JSON on stdin, and in ``SPANRL_TASK`` when it fits in one environment
  variable; a larger one (Linux refuses a variable over 128 KiB) is written to a file readable
  by the user alone, named by ``SPANRL_TASK_FILE`` and removed when the child ends;
- stdout and stderr are read as they come into bounded buffers (their last ``OUTPUT_TAIL_BYTES``
  and ``STDERR_TAIL_BYTES``), so an agent printing without end cannot fill the runner's memory;
- at the timeout the child's whole process group is killed.
"""

from __future__ import annotations

import json
import os
import select
import selectors
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass

from spanrl.bridge_protocol import ClaimedAttempt
from spanrl.instrumentation import RolloutIdentity

# Settings variables of `spanrl run` and `spanrl train` (core/settings_loader.py names them
# OTEL_SPANRL_<COMMAND>_<FIELD>): credentials of the runner and the trainer, never the agent's.
RUNNER_ONLY_ENV_PREFIXES = ("OTEL_SPANRL_RUN_", "OTEL_SPANRL_TRAIN_")
TASK_VARIABLE = "SPANRL_TASK"
TASK_FILE_VARIABLE = "SPANRL_TASK_FILE"
# Linux's limit on one "NAME=value" string is 32 pages (128 KiB); stay well below it.
TASK_VARIABLE_MAX_BYTES = 96 * 1024
OUTPUT_TAIL_BYTES = 64 * 1024  # of stdout: the output is its last line
STDERR_TAIL_BYTES = 8 * 1024  # of stderr: the end of it explains a crash
READ_CHUNK = 32 * 1024
WRITE_CHUNK = getattr(select, "PIPE_BUF", 512)  # a write this small never blocks on a ready pipe


class AgentTimedOut(Exception):
    """The agent did not finish within the rollout timeout."""


@dataclass(frozen=True)
class ChildResult:
    returncode: int
    stdout_tail: bytes
    stderr_tail: bytes


def without_runner_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without the runner's and the trainer's settings variables."""
    return {k: v for k, v in environ.items() if not k.startswith(RUNNER_ONLY_ENV_PREFIXES)}


def forget_runner_settings() -> None:
    """Remove the runner's and trainer's settings variables from this process's environment
    (once ``spanrl run`` has read them), so in-process agents and the tools they start do not
    find them there."""
    for key in [k for k in os.environ if k.startswith(RUNNER_ONLY_ENV_PREFIXES)]:
        del os.environ[key]


def command_environment(claim: ClaimedAttempt, otlp_endpoint: str, extra_env: Mapping,
                        task_json: str, task_file: str | None = None) -> dict[str, str]:
    """The child's environment: rollout identity, policy endpoint, OTLP endpoint, the task (in
    ``SPANRL_TASK``, or ``SPANRL_TASK_FILE`` naming ``task_file``)."""
    env = without_runner_settings(os.environ)
    env.update({str(k): str(v) for k, v in extra_env.items()})
    attributes = RolloutIdentity(claim.rollout_id, claim.task_id, claim.attempt).as_attributes()
    identity = ",".join(f"{key}={value}" for key, value in attributes.items())
    existing = env.get("OTEL_RESOURCE_ATTRIBUTES", "").strip(",")
    env["OTEL_RESOURCE_ATTRIBUTES"] = f"{existing},{identity}" if existing else identity
    env["OPENAI_BASE_URL"] = claim.policy_base_url
    env["OPENAI_MODEL"] = claim.model
    env.setdefault("OPENAI_API_KEY", "spanrl")
    env["OTEL_EXPORTER_OTLP_ENDPOINT"] = otlp_endpoint
    env.setdefault("OTEL_TRACES_EXPORTER", "otlp")
    env.setdefault("OTEL_SERVICE_NAME", "spanrl-agent")
    env.setdefault("OTEL_BSP_SCHEDULE_DELAY", "200")
    env.pop(TASK_VARIABLE, None)
    env.pop(TASK_FILE_VARIABLE, None)
    if task_file is None:
        env[TASK_VARIABLE] = task_json
    else:
        env[TASK_FILE_VARIABLE] = task_file
    return env


def task_needs_a_file(task_json: str) -> bool:
    return len(task_json.encode()) > TASK_VARIABLE_MAX_BYTES


def write_task_file(task: dict) -> str:
    """The task as JSON in a new file only its owner can read (``mkstemp`` makes it 0600)."""
    descriptor, path = tempfile.mkstemp(prefix="spanrl-task-", suffix=".json")
    with os.fdopen(descriptor, "w", encoding="utf-8") as f:
        json.dump(task, f)
    return path


def run_child(argv: list[str], env: dict[str, str], stdin_data: bytes, timeout_s: float) -> ChildResult:
    """Run ``argv`` to its end, feeding ``stdin_data``; raises ``AgentTimedOut`` (the process
    group killed) when it takes longer than ``timeout_s``."""
    child = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
        start_new_session=True,  # its own process group: a timeout kills its children too
    )
    deadline = time.monotonic() + timeout_s
    try:
        stdout, stderr = _exchange(child, stdin_data, deadline)
        returncode = child.wait(timeout=max(0.0, deadline - time.monotonic()))
    except (AgentTimedOut, subprocess.TimeoutExpired):
        raise AgentTimedOut(f"agent did not finish within {timeout_s:g} s (killed)") from None
    finally:
        if child.poll() is None:
            kill_group(child)
            child.wait()
        for pipe in (child.stdin, child.stdout, child.stderr):
            if pipe is not None and not pipe.closed:
                pipe.close()
    return ChildResult(returncode, stdout, stderr)


class _Tail:
    """The last ``limit`` bytes written to it."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.data = bytearray()

    def add(self, chunk: bytes) -> None:
        self.data += chunk
        if len(self.data) > self.limit:
            del self.data[: len(self.data) - self.limit]


def _exchange(child: subprocess.Popen, stdin_data: bytes, deadline: float) -> tuple[bytes, bytes]:
    """Write ``stdin_data`` and read both outputs until they close; their tails."""
    assert child.stdin is not None and child.stdout is not None and child.stderr is not None
    tails = {child.stdout.fileno(): _Tail(OUTPUT_TAIL_BYTES), child.stderr.fileno(): _Tail(STDERR_TAIL_BYTES)}
    pending = memoryview(stdin_data)
    with selectors.DefaultSelector() as selector:
        for descriptor in tails:
            selector.register(descriptor, selectors.EVENT_READ)
        if pending:
            selector.register(child.stdin.fileno(), selectors.EVENT_WRITE)
        else:
            child.stdin.close()
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AgentTimedOut()
            for key, _ in selector.select(remaining):
                if key.fd in tails:
                    chunk = os.read(key.fd, READ_CHUNK)
                    if chunk:
                        tails[key.fd].add(chunk)
                    else:
                        selector.unregister(key.fd)
                    continue
                try:
                    pending = pending[os.write(key.fd, pending[:WRITE_CHUNK]):]
                except BrokenPipeError:  # the agent stopped reading its task: its business
                    pending = pending[:0]
                if not pending:
                    selector.unregister(key.fd)
                    child.stdin.close()
    return bytes(tails[child.stdout.fileno()].data), bytes(tails[child.stderr.fileno()].data)


def kill_group(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
