"""The real ``spanrl receive`` process and ``spanrl inspect`` on what it stored."""

from __future__ import annotations

import json

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace.export import SpanExportResult

from spanrl.cli import main as spanrl_main
from spanrl.instrumentation import semconv
from spanrl.otlp_receiver.store import SpanStore


def test_receive_cli_settings_env_shutdown_and_inspect(receiver_process, memory_tracer, kit, tmp_path, capsys):
    db = tmp_path / "cli.db"
    process = receiver_process(
        "--credit", "discounted", db=db,
        env={"OTEL_SPANRL_RECEIVER_TOKEN": "from-env", "OTEL_SPANRL_RECEIVER_GAMMA": "0.5"},
    ).start()
    printed = "".join(process.output)
    assert "credit = discounted" in printed and "gamma = 0.5" in printed
    assert "token = ***" in printed and "from-env" not in printed

    kit.emit_agent_rollout(memory_tracer.tracer, "r-cli", calls=2, reward=None, tool_error=True)
    with memory_tracer.tracer.start_as_current_span("judge", attributes=kit.rollout_attrs("r-cli")) as judge:
        judge.add_event(semconv.REWARD_EVENT, {semconv.REWARD_VALUE: 2.0, semconv.REWARD_RESPONSE_ID: "resp-r-cli-0"})
    spans = memory_tracer.exporter.get_finished_spans()
    url = f"http://127.0.0.1:{process.http_port}/v1/traces"
    refused = OTLPSpanExporter(endpoint=url, timeout=5)
    assert refused.export(spans) == SpanExportResult.FAILURE  # no token
    refused.shutdown()
    exporter = OTLPSpanExporter(endpoint=url, headers={"Authorization": "Bearer from-env"}, timeout=5)
    assert exporter.export(spans) == SpanExportResult.SUCCESS
    exporter.shutdown()

    with SpanStore(db) as store:
        (rollout,) = kit.wait_for(lambda: store.completed_rollouts(0)[0])
    # the reward names the first call's response id: discounted returns with gamma 0.5
    assert [t.reward for t in rollout.transitions] == [2.0, 0.0]
    assert [t.return_ for t in rollout.transitions] == [2.0, 0.0]
    assert process.terminate() == 0
    assert any("stopped" in line for line in process.output)

    capsys.readouterr()
    assert spanrl_main(["inspect", "rollouts", "--db", str(db)]) == 0
    table = capsys.readouterr().out
    assert "r-cli" in table and "assembled" in table and "rollout_span" in table
    assert spanrl_main(["inspect", "rollout", "r-cli", "--db", str(db)]) == 0
    tree = capsys.readouterr().out
    assert semconv.ROLLOUT_SPAN_NAME in tree and f"  llm-0 [{semconv.SPAN_KIND_LLM}]" in tree
    assert "transition #0" in tree
    assert "reward reward=2" in tree and "ERROR" in tree  # the failed tool
    assert spanrl_main(["inspect", "transitions", "--json", "--db", str(db)]) == 0
    transitions = json.loads(capsys.readouterr().out)
    assert [t["response_token_ids"] for t in transitions] == [[110, 2], [111, 2]]
    assert spanrl_main(["inspect", "rollout", "r-cli", "--json", "--db", str(db)]) == 0
    detail = json.loads(capsys.readouterr().out)
    assert detail["assembled"]["variables"] == {"answer": "42"}
    assert len(detail["spans"]) == 6
    assert spanrl_main(["inspect", "rollout", "nope", "--db", str(db)]) == 2  # a user error: one line, exit 2


def test_receive_cli_reports_a_port_in_use(tmp_path):
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for flags in (["--grpc-port", str(port), "--http-port", "0"], ["--grpc-port", "0", "--http-port", str(port)]):
            result = subprocess.run(
                [sys.executable, "-m", "spanrl", "receive", "--db", str(tmp_path / "x.db"), *flags],
                capture_output=True, text=True, timeout=60,
            )
            assert result.returncode == 2
            assert "cannot start the receiver: cannot bind OTLP/" in result.stderr
            assert f"127.0.0.1:{port}" in result.stderr
