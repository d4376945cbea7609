"""The distribution's public surface: every entry point of spanrl's groups loads, the agent-side
packages stay free of torch, and OTEL_SPANRL_* variables are opentelemetry-instrument flags."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib.metadata import distribution, entry_points, version
from pathlib import Path

from opentelemetry.instrumentation.dependencies import get_dependency_conflicts, get_dist_dependency_conflicts
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor
from packaging.requirements import Requirement

from spanrl.exporter import environment_variables
from spanrl.instrumentation import semconv

ROOT = Path(__file__).resolve().parents[2]
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


def _instruments_extra_of_pyproject() -> list[Requirement]:
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    assert "instruments" not in extras  # each of its requirements would be needed by every instrumentor
    return [Requirement(spec) for spec in extras["instruments-any"]]


def test_the_instruments_extra_is_exactly_what_the_instrumentors_instrument():
    """opentelemetry-instrument reads the extra (any one of its SDKs loads spanrl's instrumentors),
    each instrumentor's instrument() reads its own requirement: one meaning."""
    from spanrl.instrumentation.anthropic_instrumentor import SpanrlAnthropicInstrumentor
    from spanrl.instrumentation.openai_instrumentor import SpanrlOpenAIInstrumentor
    from spanrl.instrumentation.package import _instruments_any

    declared = sorted(str(r) for r in _instruments_extra_of_pyproject())
    assert declared == sorted(str(Requirement(spec)) for spec in _instruments_any)
    each = [*SpanrlOpenAIInstrumentor().instrumentation_dependencies(),
            *SpanrlAnthropicInstrumentor().instrumentation_dependencies()]
    assert sorted(str(Requirement(spec)) for spec in each) == declared
    # and the installed distribution's metadata says the same (an editable install may lag)
    installed = [Requirement(r) for r in distribution("spanrl").requires or ()
                 if Requirement(r).marker is not None and Requirement(r).marker.evaluate({"extra": "instruments-any"})]
    assert sorted(f"{r.name}{r.specifier}" for r in installed) == declared


def test_with_the_installed_openai_neither_dependency_check_skips_the_instrumentor():
    from spanrl.instrumentation.openai_instrumentor import SpanrlOpenAIInstrumentor

    # the check opentelemetry-instrument's loader runs on the distribution's "instruments-any" extra
    assert get_dist_dependency_conflicts(distribution("spanrl")) is None
    # the check BaseInstrumentor.instrument() runs on instrumentation_dependencies()
    assert SpanrlOpenAIInstrumentor()._check_dependency_conflicts() is None
    # and it is a real check: an SDK older than the range would be reported
    assert get_dependency_conflicts([f"openai > {version('openai')}"]) is not None


def test_the_wire_keys_are_the_documented_ones():
    """The exact keys of DESIGN.md's table: other tools and other languages write these."""
    assert (semconv.ROLLOUT_ID, semconv.TASK_ID, semconv.ATTEMPT, semconv.AGENT_NAME) == (
        "spanrl.rollout.id", "spanrl.task.id", "spanrl.attempt", "spanrl.agent.name")
    assert (semconv.LLM_PROMPT_TOKEN_IDS, semconv.LLM_POLICY_VERSION, semconv.LLM_RETOKENIZED) == (
        "spanrl.llm.prompt_token_ids", "spanrl.llm.policy_version", "spanrl.llm.retokenized")
    assert semconv.llm_response_token_ids(1) == "spanrl.llm.response.1.token_ids"
    assert semconv.llm_response_logprobs(0) == "spanrl.llm.response.0.logprobs"
    assert semconv.variable("answer") == "spanrl.variable.answer"
    assert (semconv.REWARD_EVENT, semconv.REWARD_VALUE, semconv.REWARD_NAME, semconv.ROLLOUT_SPAN_NAME) == (
        "spanrl.reward", "spanrl.reward.value", "spanrl.reward.name", "spanrl.rollout")
    assert (semconv.REQUEST_RETURN_TOKEN_IDS, semconv.RESPONSE_PROMPT_TOKEN_IDS, semconv.RESPONSE_CHOICE_TOKEN_IDS,
            semconv.RESPONSE_POLICY_VERSION, semconv.POLICY_VERSION_HEADER) == (
        "return_token_ids", "prompt_token_ids", "token_ids", "policy_version", "x-spanrl-policy-version")
    assert (semconv.OPENINFERENCE_SPAN_KIND, semconv.SPAN_KIND_LLM) == ("openinference.span.kind", "LLM")
    assert (semconv.REQUEST_ENABLE_RESPONSE_MESSAGES, semconv.RESPONSE_INPUT_MESSAGES,
            semconv.RESPONSE_OUTPUT_MESSAGES, semconv.RESPONSE_MESSAGE_TOKENS) == (
        "enable_response_messages", "input_messages", "output_messages", "tokens")


def test_the_native_span_scanner_spells_only_keys_of_semconv():
    """_span_scan.c cannot import semconv: every spanrl key it spells must be one of semconv's."""
    source = (ROOT / "otlp_receiver" / "_span_scan.c").read_text()
    spelled = set(re.findall(r'"(spanrl\.[a-z_.]*)"', source))
    known = {value for name, value in vars(semconv).items() if name.isupper() and isinstance(value, str)}
    assert spelled and spelled <= known, spelled - known


def test_it_says_so_when_openinference_declines_the_installed_openai(monkeypatch, caplog):
    """openinference makes the LLM span and checks its own openai range: when it declines,
    spanrl's instrumentor warns instead of silently recording nothing."""
    from openinference.instrumentation.openai import OpenAIInstrumentor

    from spanrl.instrumentation.openai_instrumentor import SpanrlOpenAIInstrumentor

    assert not OpenAIInstrumentor().is_instrumented_by_opentelemetry
    monkeypatch.setattr(OpenAIInstrumentor, "instrumentation_dependencies",
                        lambda self: (f"openai > {version('openai')}",))  # as if the SDK were too old for it
    instrumentor = SpanrlOpenAIInstrumentor()
    with caplog.at_level("WARNING", logger="spanrl"):
        instrumentor.instrument()
    try:
        assert not OpenAIInstrumentor().is_instrumented_by_opentelemetry
        assert "did not turn on" in caplog.text and f"openai > {version('openai')}" in caplog.text
    finally:
        instrumentor.uninstrument()
