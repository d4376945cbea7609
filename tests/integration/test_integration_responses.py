"""End to end with the Responses API: an unmodified agent under ``opentelemetry-instrument``
talks to the embedded policy server; its spans travel over OTLP/gRPC to a real ``spanrl
receive`` process, and the assembled rollout holds exactly one transition per call with the ids
the policy engine produced (recorded in the server's process). The agents: one calling
``client.responses.create`` (sync, streamed, the stream helper, async), and one written with the
OpenAI Agents SDK and its default (Responses) model.
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

AGENTS = Path(__file__).resolve().parent / "agents"
INSTRUMENT = Path(sys.executable).parent / "opentelemetry-instrument"
ROLLOUT_ID = "responses-rollout-1"


def run_agent(script: str, otlp_endpoint: str, base_url: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "OPENAI_"))}
    env.update(OTEL_EXPORTER_OTLP_ENDPOINT=otlp_endpoint, OTEL_TRACES_EXPORTER="otlp",
               OTEL_SERVICE_NAME="responses-agent", OTEL_RESOURCE_ATTRIBUTES=f"{semconv.ROLLOUT_ID}={ROLLOUT_ID}",
               OPENAI_BASE_URL=base_url, OPENAI_API_KEY="unused", OPENAI_MODEL="policy", PYTHONUNBUFFERED="1",
               OPENAI_AGENTS_DISABLE_TRACING="1")
    return subprocess.run([str(INSTRUMENT), sys.executable, str(AGENTS / script)], env=env, capture_output=True,
                          text=True, timeout=120)


def assembled(store: SpanStore, receiver_http: str, timeout_s: float = 20.0):
    request = urllib.request.Request(f"{receiver_http}/spanrl/v1/rollouts/{ROLLOUT_ID}/complete", data=b"",
                                     method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status in (200, 202)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for rollout in store.completed_rollouts(since=0)[0]:
            if rollout.rollout_id == ROLLOUT_ID:
                return rollout
        time.sleep(0.1)
    raise AssertionError(f"rollout {ROLLOUT_ID} was not assembled within {timeout_s} s")


def run_and_assemble(script: str, policy_server, receiver):
    """Run ``script``; check one transition per call, each with the engine's ids and version."""
    engine = policy_server.engine
    result = run_agent(script, receiver["grpc"], policy_server.base_url)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    replies = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(replies) == len(engine.jobs)
    served = [(tuple(job.prompt_ids), tuple(job.result.choices[0].token_ids)) for job in engine.jobs]
    for (_, response_ids), reply in zip(served, replies, strict=True):
        assert engine.tokenizer.decode(list(response_ids), skip_special_tokens=True) == reply

    store = SpanStore(receiver["db"])
    try:
        rollout = assembled(store, receiver["http"])
    finally:
        store.close()
    assert not any("no engine token ids" in p for p in rollout.problems), rollout.problems
    assert [(t.prompt_token_ids, t.response_token_ids) for t in rollout.transitions] == served
    for transition in rollout.transitions:
        assert transition.retokenized is False and transition.policy_version == 0
    return replies, rollout


def test_responses_calls_become_one_transition_each_with_the_engines_ids(policy_server, receiver):
    engine = policy_server.engine
    replies, rollout = run_and_assemble("responses_agent.py", policy_server, receiver)
    assert len(replies) == 5
    # one conversation: each prompt holds the first question and the reply before it (the server
    # kept the conversation for previous_response_id), but not the first call's instructions
    prompts = [engine.tokenizer.decode(list(t.prompt_token_ids)) for t in rollout.transitions]
    assert "Answer with ANSWER n." in prompts[0]
    for prompt, previous_reply in zip(prompts[1:], replies, strict=False):
        assert "What is 12 + 30?" in prompt and previous_reply in prompt
        assert "Answer with ANSWER n." not in prompt
    assert '"name": "add"' in prompts[2] and "42" in prompts[2]


def test_an_agents_sdk_agent_with_its_default_model_trains_with_zero_code(policy_server, receiver):
    engine = policy_server.engine
    # The SDK raises on a reply cut by max_tokens (status incomplete), and the random model
    # rarely samples its end token: here every token ends a reply, so each reply is one token.
    engine.eos_ids = set(range(len(engine.tokenizer)))
    replies, rollout = run_and_assemble("agents_sdk_agent.py", policy_server, receiver)
    assert len(replies) == 3
    prompts = [engine.tokenizer.decode(list(t.prompt_token_ids)) for t in rollout.transitions]
    assert all("Answer with ANSWER n." in prompt for prompt in prompts)  # the agent's instructions
    assert "What is 12 + 30?" in prompts[1] and replies[0] in prompts[1]  # continued on the server
    assert "What is 12 + 30?" not in prompts[2]
    assert all(len(t.response_token_ids) == 1 for t in rollout.transitions)
