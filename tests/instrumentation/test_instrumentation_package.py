"""The distribution's public surface: every entry point of spanrl's groups loads, the agent-side
packages stay free of torch, and OTEL_SPANRL_* variables are opentelemetry-instrument flags."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

from opentelemetry.instrumentation.instrumentor import BaseInstrumentor

from spanrl.exporter import environment_variables
from spanrl.instrumentation import semconv

GROUPS = (
    "opentelemetry_instrumentor",
    "opentelemetry_pre_instrument",
    "opentelemetry_post_instrument",
    "opentelemetry_environment_variables",
)


def spanrl_entry_points(group):
    return [ep for ep in entry_points(group=group) if ep.dist is not None and ep.dist.name == "spanrl"]


def test_every_entry_point_of_the_distribution_loads():
    loaded = {group: {ep.name: ep.load() for ep in spanrl_entry_points(group)} for group in GROUPS}
    instrumentor = loaded["opentelemetry_instrumentor"]["spanrl_openai"]
    assert issubclass(instrumentor, BaseInstrumentor)
    assert any("openai" in spec for spec in instrumentor().instrumentation_dependencies())
    assert callable(loaded["opentelemetry_pre_instrument"]["spanrl"])
    assert callable(loaded["opentelemetry_post_instrument"]["spanrl"])
    assert loaded["opentelemetry_environment_variables"]["spanrl"] is environment_variables
    # the name must not clash with openinference's own "openai" instrumentor entry point
    assert "openai" not in loaded["opentelemetry_instrumentor"]


def test_environment_variable_constants_name_themselves():
    names = [n for n in dir(environment_variables) if n.startswith("OTEL_")]
    assert "OTEL_SPANRL_REQUEST_TOKEN_IDS" in names and "OTEL_SPANRL_RECEIVER_TOKEN" in names
    for name in names:
        assert name.startswith(semconv.ENV_PREFIX)
        assert getattr(environment_variables, name) == name


def test_spanrl_variables_are_opentelemetry_instrument_flags(harness):
    result = subprocess.run([str(harness.bin / "opentelemetry-instrument"), "--help"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    for name in dir(environment_variables):
        if name.startswith("OTEL_SPANRL_"):
            assert f"--{name[len('OTEL_'):].lower()}" in result.stdout


def test_agent_side_imports_do_not_import_torch():
    code = (
        "import sys\n"
        "import spanrl.instrumentation, spanrl.exporter\n"
        "import spanrl.instrumentation.openai_instrumentor, spanrl.exporter.hook\n"
        "import spanrl.exporter.in_process, spanrl.exporter.span_processor\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "torch" not in result.stdout.split(",")
    assert "transformers" not in result.stdout.split(",")
