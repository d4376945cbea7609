"""The local receiver and runner as child processes, for ``spanrl demo``, the SQL example's
pipeline (``examples/sql_agent/pipeline.py``) and ``bench/``: start, wait for, stop.

``LocalServices`` is a context manager: ``start_receiver`` runs ``spanrl receive`` on free ports
and waits until it listens, ``start_runner`` runs ``spanrl run`` against the bridge's port; each
child writes ``<log_dir>/<name>.log``. Leaving the block stops every child (the last started
first, killed after ``stop_timeout_s``) and closes the logs, also when start-up failed. While
children run, SIGTERM to this process raises ``SystemExit`` (in the main thread, when nothing else
handles SIGTERM), so the block is left and they are stopped rather than left running as orphans.
Stdlib only.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import IO


def _exit_for_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


# Ports are drawn from here up to the kernel's ephemeral range (Linux's default: 32768-60999).
_PORT_FLOOR = 20000
_EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_DRAWS = 64


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing holds right now, below the kernel's ephemeral range
    where there is room. A port the kernel hands out for ``bind(("127.0.0.1", 0))`` is one it
    also hands out to every process's outgoing connections and port-0 binds, and one of those can
    take it between this check and the child's own bind (a test's trainer once found its bridge
    port taken so); below that range only another explicit choice can."""
    ephemeral_start = _ephemeral_range_start()
    if ephemeral_start > _PORT_FLOOR:
        draw = random.SystemRandom()  # not the global generator: tests and agents seed that one
        for _ in range(_DRAWS):
            port = draw.randrange(_PORT_FLOOR, ephemeral_start)
            if _can_bind(port):
                return port
    with socket.socket() as s:  # no room below the range (or all taken): the kernel's choice
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ephemeral_range_start() -> int:
    try:
        with open(_EPHEMERAL_RANGE_FILE) as range_file:
            return int(range_file.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; macOS and Windows start theirs at 49152


def _can_bind(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def wait_for_port(port: int, process: subprocess.Popen, what: str, timeout_s: float = 60.0) -> None:
    """Until ``process`` listens on ``port`` of 127.0.0.1; ``RuntimeError`` when it exits or is too slow."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with code {process.returncode} while starting")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not open port {port} within {timeout_s:.0f} s")


@dataclass(frozen=True)
class ReceiverPorts:
    """Where the started receiver listens (OTLP/gRPC and OTLP/HTTP on 127.0.0.1)."""

    grpc: int
    http: int

    @property
    def otlp_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.grpc}"


class LocalServices:
    """Child processes with a log file each, all stopped on leaving the ``with`` block."""

    def __init__(self, log_dir: str, stop_timeout_s: float = 10.0) -> None:
        self.log_dir = log_dir
        self.stop_timeout_s = stop_timeout_s
        self.children: list[subprocess.Popen] = []
        self.logs: list[IO[str]] = []
        self._sigterm_handled = False  # whether this object installed the SIGTERM handler

    def start(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None) -> subprocess.Popen:
        """Run ``argv`` with stdout and stderr in ``<log_dir>/<name>.log``."""
        self._exit_on_sigterm()
        log = open(os.path.join(self.log_dir, f"{name}.log"), "w")  # noqa: SIM115 (closed by stop)
        self.logs.append(log)
        child = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT,
                                 env=None if env is None else dict(env))
        self.children.append(child)
        return child

    def start_receiver(self, db: str, *options: str) -> ReceiverPorts:
        """``spanrl receive`` into ``db`` on free ports (more ``options`` as flags); waits until it listens."""
        ports = ReceiverPorts(free_port(), free_port())
        receiver = self.start("receiver", [sys.executable, "-m", "spanrl", "receive", "--db", db,
                                           "--grpc-port", str(ports.grpc), "--http-port", str(ports.http),
                                           "--grace-s", "0.3", *options])
        wait_for_port(ports.grpc, receiver, "spanrl receive")
        return ports

    def start_runner(self, agent: str, bridge_port: int, receiver: ReceiverPorts, concurrency: int, *options: str,
                     env: Mapping[str, str] | None = None, python: str = sys.executable) -> subprocess.Popen:
        """``spanrl run`` of ``agent`` against the bridge on ``bridge_port``, exporting to ``receiver``;
        ``python``: the interpreter of the agent's environment (e.g. a framework's own venv)."""
        return self.start("runner", [python, "-m", "spanrl", "run", "--agent", agent,
                                     "--bridge-url", f"http://127.0.0.1:{bridge_port}",
                                     "--otlp-endpoint", receiver.otlp_endpoint,
                                     "--concurrency", str(concurrency), *options], env=env)

    def stop(self) -> None:
        """Stop every child (the last started first; killed after ``stop_timeout_s``) and close the logs."""
        for child in reversed(self.children):
            if child.poll() is None:
                child.terminate()
        for child in self.children:
            try:
                child.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        for log in self.logs:
            log.close()
        if self._sigterm_handled:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            self._sigterm_handled = False

    def _exit_on_sigterm(self) -> None:
        """SIGTERM -> ``SystemExit(143)``, so ``stop`` runs as the exception leaves the block (only
        the main thread can set handlers; a handler someone else set stays theirs)."""
        if self._sigterm_handled or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _exit_for_sigterm)
            self._sigterm_handled = True

    def __enter__(self) -> LocalServices:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stop()
