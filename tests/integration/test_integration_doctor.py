"""``spanrl doctor`` as a user runs it (a real process), against a real ``spanrl receive`` and the
embedded policy server: a working environment passes every check, exits 0 and its test span is
in the receiver's store; a broken one names each problem with its fix and exits 1."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys

from spanrl.child_processes import free_port
from spanrl.doctor import TEST_SPAN_NAME


def run_doctor(*args: str, **env_vars: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "OPENAI_"))}
    env.update(env_vars)
    return subprocess.run([sys.executable, "-m", "spanrl", "doctor", "--timeout-s", "5", *args], env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_working_environment_passes_and_its_test_span_is_stored(receiver, policy_server):
    result = run_doctor("--receiver", receiver["grpc"], OPENAI_BASE_URL=policy_server.base_url)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert not [line for line in lines if line.startswith(("FAIL", "warn"))], result.stdout
    assert any(line.startswith("ok   test span") for line in lines)
    assert any(line.startswith("ok   policy endpoint") and "serves policy (policy version 0)" in line
               for line in lines)
    with sqlite3.connect(receiver["db"]) as db:
        (stored,) = db.execute("SELECT count(*) FROM spans WHERE name = ?", (TEST_SPAN_NAME,)).fetchone()
    assert stored == 1


def test_a_broken_environment_names_each_problem_and_its_fix(tmp_path):
    nothing = free_port()
    result = run_doctor("--receiver", f"http://127.0.0.1:{nothing}", "--policy-url",
                        f"http://127.0.0.1:{nothing}/v1", OTEL_SDK_DISABLED="true",
                        OTEL_PYTHON_DISABLED_INSTRUMENTATIONS="spanrl_openai")
    assert result.returncode == 1, result.stdout + result.stderr
    failed = [line.split(":")[0] for line in result.stdout.splitlines() if line.startswith("FAIL")]
    assert failed == ["FAIL OTel SDK", "FAIL spanrl instrumentor", "FAIL receiver", "FAIL policy endpoint"]
    assert result.stdout.count("     fix: ") == 4
    assert "unset OTEL_SDK_DISABLED" in result.stdout and "start `spanrl receive`" in result.stdout
    assert "4 problem(s) to fix" in result.stdout
