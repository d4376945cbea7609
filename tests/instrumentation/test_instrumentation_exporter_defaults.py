"""The opentelemetry-instrument hooks' safe defaults, checked in a real agent process: the
attribute count limit is raised, every span is sampled, metrics and logs exporters are off —
and each yields to the user's own setting."""

from __future__ import annotations

from spanrl.exporter.safe_defaults import RAISED_ATTRIBUTE_COUNT_LIMIT

SIGNAL_ENV = {
    "OTEL_METRIC_EXPORT_INTERVAL": "200",
    "OTEL_PYTHON_LOGGING_AUTO_INSTRUMENTATION_ENABLED": "true",
}


def names(collector):
    return {s["name"] for s in collector.spans()}


def test_defaults_when_the_user_chose_nothing(trace_collector, run_agent, harness):
    env = harness.agent_environment(trace_collector.endpoint, "http://127.0.0.1:9", **SIGNAL_ENV)
    result = run_agent("signals_agent.py", env)
    assert result.returncode == 0, result.stderr
    assert RAISED_ATTRIBUTE_COUNT_LIMIT > 300
    assert int(result.stdout.split()[-1]) == 300
    assert harness.wait_for(lambda: {"big", "under-unsampled-parent"} <= names(trace_collector))
    big = [s for s in trace_collector.spans() if s["name"] == "big"][0]
    assert len([k for k in big["attributes"] if k.startswith("attribute.")]) == 300
    assert trace_collector.signals.metrics_requests == 0
    assert trace_collector.signals.logs_requests == 0


def test_user_settings_win(trace_collector, run_agent, harness):
    env = harness.agent_environment(
        trace_collector.endpoint, "http://127.0.0.1:9",
        OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT="50",
        OTEL_TRACES_SAMPLER="parentbased_always_on",
        OTEL_LOGS_EXPORTER="otlp",
        **SIGNAL_ENV,
    )
    # metrics chosen with the opentelemetry-instrument flag rather than the variable
    result = run_agent("signals_agent.py", env, flags=("--metrics_exporter", "otlp"))
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.split()[-1]) == 50
    assert harness.wait_for(lambda: "big" in names(trace_collector))
    assert harness.wait_for(lambda: trace_collector.signals.metrics_requests > 0)
    assert harness.wait_for(lambda: trace_collector.signals.logs_requests > 0)
    assert "under-unsampled-parent" not in names(trace_collector)
