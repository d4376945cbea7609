"""Running an unmodified agent of a framework, or one of a framework's own example programs,
under ``opentelemetry-instrument`` against the embedded policy server and a real ``spanrl
receive``, and checking what the receiver made of it. Used by the tests of tests/frameworks.

``run_unmodified`` checks what holds for every framework: the program exits 0 without a
traceback, and the rollout has one transition per request the engine served, with exactly the
engine's prompt and response ids, policy version 0, none re-tokenized. Calls are compared as a
multiset: agents that run in parallel (``asyncio.gather``) reach the engine in any order.
"""

from __future__ import annotations

import subprocess
from collections import Counter
from pathlib import Path

from spanrl.otlp_receiver.span_tree import record_from_body
from spanrl.otlp_receiver.store import SpanStore
from spanrl.schema.rollouts import AssembledRollout
from tests.integration.agent_runs import agent_environment, assembled

NO_IDS = "has no engine token ids"


def run_unmodified(program: list[str], policy_server, receiver, rollout_id: str, bin_dir: Path, *,
                   cwd: Path | None = None, stdin: str = "", extra_env: dict[str, str] | None = None,
                   not_calls: tuple[str, ...] = (), timeout_s: float = 540) -> tuple[str, AssembledRollout]:
    """Run ``BIN/opentelemetry-instrument BIN/python *program``; return its stdout and rollout.

    ``not_calls``: span names of LLM-kind spans a framework's instrumentor records that are no
    calls of their own (the receiver reports them as calls without ids and skips them); any
    other call without ids fails the check."""
    engine = policy_server.engine
    served_before = len(engine.jobs)
    service = program[1] if program[0] == "-m" else Path(program[0]).stem  # a module, or a script
    env = agent_environment(service, receiver["grpc"], policy_server.base_url, rollout_id, extra_env)
    result = subprocess.run([str(bin_dir / "opentelemetry-instrument"), str(bin_dir / "python"), *program],
                            cwd=cwd, env=env, input=stdin, capture_output=True, text=True, timeout=timeout_s)
    output = f"stdout:\n{result.stdout[-2000:]}\nstderr:\n{result.stderr[-4000:]}"
    assert result.returncode == 0, output
    assert "Traceback" not in result.stderr, output

    store = SpanStore(receiver["db"])
    try:
        rollout = assembled(store, receiver["http"], rollout_id)
    finally:
        store.close()
    unexpected = [p for p in rollout.problems if NO_IDS in p and not any(f"('{name}')" in p for name in not_calls)]
    assert not unexpected, rollout.problems
    served = Counter((tuple(job.prompt_ids), tuple(job.result.choices[0].token_ids))
                     for job in engine.jobs[served_before:])
    assert served, "the program made no request to the policy server"
    assert Counter((t.prompt_token_ids, t.response_token_ids) for t in rollout.transitions) == served
    for transition in rollout.transitions:
        assert transition.retokenized is False and transition.policy_version == 0
    return result.stdout, rollout


def decoded_prompts(policy_server, rollout: AssembledRollout) -> list[str]:
    tokenizer = policy_server.engine.tokenizer
    return [tokenizer.decode(list(t.prompt_token_ids)) for t in rollout.transitions]


def decoded_replies(policy_server, rollout: AssembledRollout) -> list[str]:
    tokenizer = policy_server.engine.tokenizer
    return [tokenizer.decode(list(t.response_token_ids), skip_special_tokens=True) for t in rollout.transitions]


def call_span_names(receiver, rollout: AssembledRollout) -> list[str]:
    """The name of the span each transition was made from (e.g. openinference's ``Response``
    for a Responses API call, ``ChatCompletion`` for chat completions)."""
    store = SpanStore(receiver["db"])
    try:
        records = [record_from_body(span.body) for span in store.rollout_spans(rollout.rollout_id)]
    finally:
        store.close()
    names = {record.key: record.name for record in records}
    return [names[t.span_id] for t in rollout.transitions]
