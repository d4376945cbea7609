"""Under ``opentelemetry-instrument``, the LLM-SDK and framework instrumentors spanrl depends on turn
on when the agent imports their library (``spanrl.exporter.deferred_instrumentors``): an agent that
never imports Anthropic's SDK or LangChain does not load them at start-up, and one that does gets
them instrumented as before. The recording itself, deferred, is what every other end-to-end test of
this folder and tests/integration checks (their agents run under ``opentelemetry-instrument``)."""

from __future__ import annotations

import importlib
import json
import logging
import sys
from importlib.metadata import EntryPoint

from opentelemetry.instrumentation.distro import BaseDistro, DefaultDistro

from spanrl.exporter import deferred_instrumentors

ALREADY_ON_WARNING = "already instrumented"
ALL_ON = ["openinference_anthropic", "openinference_langchain", "openinference_openai", "spanrl_anthropic",
          "spanrl_openai"]


def run_deferred_agent(run_agent, harness, collector, *imports, **env):
    result = run_agent("deferred_imports_agent.py", harness.agent_environment(collector.endpoint, "http://127.0.0.1:9",
                                                                                  **env), *imports)
    assert result.returncode == 0, result.stderr
    assert ALREADY_ON_WARNING not in result.stderr.lower(), result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


def test_an_openai_agent_loads_neither_anthropic_nor_langchain(trace_collector, run_agent, harness):
    report, _ = run_deferred_agent(run_agent, harness, trace_collector, "openai")
    assert report["before"] == {"imported": [], "on": []}
    assert report["after"] == {"imported": ["openai"], "on": ["openinference_openai", "spanrl_openai"]}


def test_each_library_is_instrumented_when_the_agent_imports_it(trace_collector, run_agent, harness):
    report, _ = run_deferred_agent(run_agent, harness, trace_collector, "anthropic", "langchain_core", "openai")
    assert report["before"]["on"] == []
    assert report["after"] == {"imported": ["anthropic", "langchain_core", "openai"], "on": ALL_ON}


def test_turned_off_every_installed_library_is_instrumented_at_start_up(trace_collector, run_agent, harness):
    report, _ = run_deferred_agent(run_agent, harness, trace_collector, OTEL_SPANRL_DEFER_INSTRUMENTORS="false")
    assert report["before"] == {"imported": ["anthropic", "langchain_core", "openai"], "on": ALL_ON}


def test_a_failing_instrumentor_is_logged_and_the_agents_import_goes_on(tmp_path, monkeypatch, caplog):
    (tmp_path / "spanrl_test_some_sdk.py").write_text("ANSWER = 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    broken = EntryPoint("broken_sdk", "spanrl_no_such_module:Instrumentor", "opentelemetry_instrumentor")
    monkeypatch.setitem(deferred_instrumentors.DEFERRED_UNTIL_IMPORTED, broken.value, "spanrl_test_some_sdk")
    try:
        assert deferred_instrumentors.defer_until_imported()
        assert BaseDistro.load_instrumentor(DefaultDistro(), broken) is None  # waits for the import
        with caplog.at_level(logging.ERROR, logger=deferred_instrumentors.__name__):
            module = importlib.import_module("spanrl_test_some_sdk")
    finally:
        deferred_instrumentors.stop_deferring()
        sys.modules.pop("spanrl_test_some_sdk", None)
    assert module.ANSWER == 42
    assert "instrumenting broken_sdk on the import of spanrl_test_some_sdk failed" in caplog.text
    assert "No module named 'spanrl_no_such_module'" in caplog.text


def test_the_loader_is_wrapped_once_and_given_back():
    original = BaseDistro.__dict__["load_instrumentor"]
    try:
        assert deferred_instrumentors.defer_until_imported()
        assert not deferred_instrumentors.defer_until_imported()
        assert BaseDistro.__dict__["load_instrumentor"].spanrl_original is original
    finally:
        deferred_instrumentors.stop_deferring()
    assert BaseDistro.__dict__["load_instrumentor"] is original
