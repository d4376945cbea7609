"""Telemetry off is said, once, on stderr: an agent under the real ``opentelemetry-instrument``
whose OTel SDK cannot start (an exporter that is not installed; a protobuf the OTLP exporter's
generated code refuses), is disabled (``OTEL_SDK_DISABLED=true``), or whose spanrl instrumentor
is skipped still runs and exits as it would, and stderr holds exactly one ``spanrl:`` line
saying why. A working environment gets no such line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

INSTRUMENT = Path(sys.executable).parent / "opentelemetry-instrument"
AGENT = "import sys; print('agent ran'); sys.exit(3)"  # a distinctive exit code, kept as it is


def run_agent(tmp_path: Path, **env_vars: str) -> subprocess.CompletedProcess:
    script = tmp_path / "agent.py"
    script.write_text(AGENT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none",
                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", **env_vars})
    return subprocess.run([str(INSTRUMENT), sys.executable, str(script)], env=env, capture_output=True, text=True,
                          timeout=120)


def spanrl_lines(result: subprocess.CompletedProcess) -> list[str]:
    assert result.returncode == 3 and result.stdout.strip() == "agent ran", result.stderr[-2000:]
    return [line for line in result.stderr.splitlines() if line.startswith("spanrl:")]


def test_a_working_environment_says_nothing(tmp_path):
    assert spanrl_lines(run_agent(tmp_path)) == []


def test_a_disabled_sdk_is_said_once(tmp_path):
    (line,) = spanrl_lines(run_agent(tmp_path, OTEL_SDK_DISABLED="true"))
    assert "telemetry is OFF" in line and "OTEL_SDK_DISABLED=true" in line


def test_an_sdk_that_cannot_start_is_said_once(tmp_path):
    (line,) = spanrl_lines(run_agent(tmp_path, OTEL_TRACES_EXPORTER="zipkin_json"))
    assert "telemetry is OFF" in line and "will fail to start" in line and "'zipkin_json'" in line


# protobuf 5.29 (what AutoGen pins), installed beside this environment by .ci/run, never by a test
OLD_PROTOBUF = Path(sys.prefix) / "protobuf-5.29"
OLD_PROTOBUF_INSTALL = f"python -m pip install --no-deps --target {OLD_PROTOBUF} protobuf==5.29.5"


def test_a_protobuf_the_exporter_refuses_is_said_once_with_the_fix(tmp_path):
    from importlib.metadata import version

    assert (OLD_PROTOBUF / "google" / "protobuf").is_dir(), f"protobuf 5.29.5 is missing: {OLD_PROTOBUF_INSTALL}"
    assert int(version("protobuf").split(".")[0]) >= 6, "the test environment's protobuf is the one the exporter wants"
    result = run_agent(tmp_path, PYTHONPATH=os.pathsep.join([str(OLD_PROTOBUF), os.environ.get("PYTHONPATH", "")]))
    (line,) = spanrl_lines(result)
    assert "telemetry is OFF" in line and "will fail to start" in line
    assert "protobuf 5.29.5 is installed" in line and "spanrl doctor" in line


def test_a_skipped_instrumentor_is_said_once(tmp_path):
    (line,) = spanrl_lines(run_agent(tmp_path, OTEL_PYTHON_DISABLED_INSTRUMENTATIONS="spanrl_openai"))
    assert "OpenAI calls are NOT recorded" in line and "OTEL_PYTHON_DISABLED_INSTRUMENTATIONS" in line
