"""Shared by the reliability tests and ``bench/reliability.py``: ``spanrl receive`` as a real
subprocess (optionally under a file-size limit), its stats endpoint and memory, free ports."""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class ReceiverProcess:
    """``spanrl receive`` as a subprocess (the real CLI), optionally with a file-size limit."""

    def __init__(self, db: Path, *extra: str, file_size_limit: int | None = None) -> None:
        self.db = db
        self.extra = extra
        self.file_size_limit = file_size_limit
        self.proc: subprocess.Popen | None = None
        self.grpc_port = 0
        self.http_port = 0
        self.output: list[str] = []

    def _command(self, argv: list[str]) -> list[str]:
        """``argv``, started under the file-size limit when there is one: a small Python shim sets it
        and execs the command (no ``preexec_fn``: running Python code between fork and exec in a
        process with threads, as this test process has, can crash the child)."""
        if self.file_size_limit is None:
            return argv
        shim = ("import os, resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), "
                "resource.RLIM_INFINITY)); os.execv(sys.argv[2], sys.argv[2:])")
        return [sys.executable, "-c", shim, str(self.file_size_limit), *argv]

    def start(self, grpc_port: int = 0, http_port: int = 0) -> ReceiverProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            self._command([sys.executable, "-m", "spanrl", "receive", "--db", str(self.db), "--grpc-port",
                           str(grpc_port), "--http-port", str(http_port), "--grace-s", "0.2", "--poll-s", "0.05",
                           *self.extra]),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError("spanrl receive exited early:\n" + "".join(self.output))
            self.output.append(line)
            match = re.search(r"ready, OTLP/gRPC [\d.]+:(\d+), OTLP/HTTP https?://[\d.]+:(\d+)", line)
            if match:
                self.grpc_port, self.http_port = int(match.group(1)), int(match.group(2))
                break
        else:
            raise AssertionError("spanrl receive did not get ready:\n" + "".join(self.output))
        threading.Thread(target=self._drain, daemon=True).start()
        return self

    def _drain(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.output.append(line)

    def raise_file_size_limit(self) -> None:
        """Space returns: lift the running receiver's file-size limit (prlimit on its pid)."""
        assert self.proc is not None
        resource.prlimit(self.proc.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stats(self) -> dict:
        """``GET /spanrl/v1/stats`` of the running receiver."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/spanrl/v1/stats", timeout=10) as answer:
            return json.loads(answer.read())

    def rss_bytes(self) -> int:
        """The receiver process's resident memory now (VmRSS)."""
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS line")
