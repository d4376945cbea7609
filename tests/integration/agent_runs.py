"""Running an unmodified agent end to end, shared by the integration and framework tests: the
agent runs under ``opentelemetry-instrument`` (of the main environment, or of a framework's own
venv built by .ci/frameworks_env.sh), calls the embedded policy server and exports its spans
over OTLP/gRPC to a real ``spanrl receive``; the assembled rollout is read from the store.

Agents print their replies as a JSON list on their last stdout line, one per LLM call.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from spanrl.instrumentation import semconv
from spanrl.otlp_receiver.store import SpanStore
from spanrl.schema.rollouts import AssembledRollout

MAIN_BIN = Path(sys.executable).parent


def agent_environment(service_name: str, otlp_endpoint: str, base_url: str, rollout_id: str,
                      extra_env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of an agent run: this one without its OTel/OpenAI variables, plus the
    receiver, the endpoint and the rollout identity; ``extra_env`` may replace any of them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "OPENAI_"))}
    env.update(OTEL_EXPORTER_OTLP_ENDPOINT=otlp_endpoint, OTEL_TRACES_EXPORTER="otlp",
               OTEL_SERVICE_NAME=service_name, OTEL_RESOURCE_ATTRIBUTES=f"{semconv.ROLLOUT_ID}={rollout_id}",
               OPENAI_BASE_URL=base_url, OPENAI_API_KEY="unused", OPENAI_MODEL="policy", PYTHONUNBUFFERED="1")
    env.update(extra_env or {})
    return env


def run_agent(script: Path, otlp_endpoint: str, base_url: str, rollout_id: str, bin_dir: Path = MAIN_BIN,
              extra_env: dict[str, str] | None = None, timeout_s: float = 180) -> subprocess.CompletedProcess:
    """``BIN/opentelemetry-instrument BIN/python SCRIPT``, as a user runs an agent."""
    env = agent_environment(script.stem, otlp_endpoint, base_url, rollout_id, extra_env)
    return subprocess.run([str(bin_dir / "opentelemetry-instrument"), str(bin_dir / "python"), str(script)],
                          env=env, capture_output=True, text=True, timeout=timeout_s)


def assembled(store: SpanStore, receiver_http: str, rollout_id: str, timeout_s: float = 20.0) -> AssembledRollout:
    request = urllib.request.Request(f"{receiver_http}/spanrl/v1/rollouts/{rollout_id}/complete", data=b"",
                                     method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status in (200, 202)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for rollout in store.completed_rollouts(since=0)[0]:
            if rollout.rollout_id == rollout_id:
                return rollout
        time.sleep(0.1)
    raise AssertionError(f"rollout {rollout_id} was not assembled within {timeout_s} s")


def run_and_assemble(script: Path, policy_server, receiver, rollout_id: str, bin_dir: Path = MAIN_BIN,
                     extra_env: dict[str, str] | None = None,
                     one_call_per_reply: bool = True) -> tuple[list[str], AssembledRollout]:
    """Run ``script``; check one transition per call, each with the engine's ids and version
    (the requests the policy server's engine served, recorded in this process). With
    ``one_call_per_reply`` the agent's printed replies are its calls' decoded responses, in order;
    without it (a framework that asks again after a reply it cannot use) the caller checks them."""
    engine = policy_server.engine
    result = run_agent(script, receiver["grpc"], policy_server.base_url, rollout_id, bin_dir, extra_env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    replies = json.loads(result.stdout.strip().splitlines()[-1])
    served = [(tuple(job.prompt_ids), tuple(job.result.choices[0].token_ids)) for job in engine.jobs]
    if one_call_per_reply:
        assert len(replies) == len(engine.jobs)
        for (_, response_ids), reply in zip(served, replies, strict=True):
            assert engine.tokenizer.decode(list(response_ids), skip_special_tokens=True) == reply

    store = SpanStore(receiver["db"])
    try:
        rollout = assembled(store, receiver["http"], rollout_id)
    finally:
        store.close()
    assert not any("no engine token ids" in p for p in rollout.problems), rollout.problems
    assert [(t.prompt_token_ids, t.response_token_ids) for t in rollout.transitions] == served
    for transition in rollout.transitions:
        assert transition.retokenized is False and transition.policy_version == 0
    return replies, rollout
