"""End to end with real LangChain: an unmodified LangChain agent under ``opentelemetry-instrument``
talks to the embedded policy server, its spans travel over OTLP/gRPC to a real ``spanrl
receive`` process, and the assembled rollout holds exactly one transition per model call.

Both openinference instrumentors (LangChain and OpenAI) and spanrl's are on, so every call is
seen twice: a LangChain ``ChatOpenAI`` LLM span with the OpenAI SDK's LLM span under it. The
store must keep both spans; the rollout must count the call once, with the ids the policy
engine itself produced (recorded here, in the server's process) and not re-tokenized text.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from opentelemetry.proto.trace.v1 import trace_pb2

from spanrl.instrumentation import semconv
from spanrl.instrumentation.packed_values import unpack_token_ids
from spanrl.otlp_receiver.store import SpanStore

REPO = Path(__file__).resolve().parents[2]
AGENT = REPO / "examples" / "langchain_agent" / "agent.py"
INSTRUMENT = Path(sys.executable).parent / "opentelemetry-instrument"
ROLLOUT_ID, TASK_ID, ATTEMPT = "lc-rollout-1", "lc-task-7", 1
OUTPUT_CONTENT = "llm.output_messages.0.message.content"  # openinference's key, on both spans


def agent_environment(otlp_endpoint: str, base_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "OPENAI_"))}
    env.update(
        OTEL_EXPORTER_OTLP_ENDPOINT=otlp_endpoint,
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_SERVICE_NAME="langchain-calc-agent",
        OTEL_RESOURCE_ATTRIBUTES=(f"{semconv.ROLLOUT_ID}={ROLLOUT_ID},{semconv.TASK_ID}={TASK_ID},"
                                  f"{semconv.ATTEMPT}={ATTEMPT}"),
        OPENAI_BASE_URL=base_url,
        OPENAI_API_KEY="unused",
        OPENAI_MODEL="policy",
        # Sampled, as in training, but seeded: every call answers differently, reproducibly.
        AGENT_TEMPERATURE="1",
        AGENT_SEED="3",
        PYTHONUNBUFFERED="1",
    )
    return env


def run_agent(env: dict[str, str], transcript: Path) -> subprocess.CompletedProcess:
    command = [str(INSTRUMENT), sys.executable, str(AGENT), "--transcript", str(transcript),
               json.dumps({"id": TASK_ID, "question": "12+30"})]
    process = subprocess.Popen(command, env=env, cwd=str(REPO), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def complete_rollout(receiver_http: str, rollout_id: str) -> None:
    request = urllib.request.Request(f"{receiver_http}/spanrl/v1/rollouts/{rollout_id}/complete",
                                     data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status in (200, 202), response.status


def wait_for_assembled(store: SpanStore, rollout_id: str, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rollouts, _ = store.completed_rollouts(since=0)
        for rollout in rollouts:
            if rollout.rollout_id == rollout_id:
                return rollout
        time.sleep(0.1)
    raise AssertionError(f"rollout {rollout_id} was not assembled within {timeout_s} s")


def stored_llm_spans(store: SpanStore, rollout_id: str) -> list[trace_pb2.Span]:
    spans = []
    for stored in store.rollout_spans(rollout_id):
        span = trace_pb2.Span()
        span.ParseFromString(stored.body)
        attributes = {kv.key: kv.value for kv in span.attributes}
        kind = attributes.get("openinference.span.kind")
        if kind is not None and kind.string_value == "LLM":
            spans.append(span)
    return sorted(spans, key=lambda s: s.start_time_unix_nano)


def token_ids(span: trace_pb2.Span, key: str) -> tuple[int, ...] | None:
    """A token-id attribute's ids, packed (what spanrl's instrumentation writes) or an array."""
    for kv in span.attributes:
        if kv.key == key:
            if kv.value.WhichOneof("value") == "string_value":
                return tuple(unpack_token_ids(kv.value.string_value))
            return tuple(v.int_value for v in kv.value.array_value.values)
    return None


def string_attribute(span: trace_pb2.Span, key: str) -> str | None:
    for kv in span.attributes:
        if kv.key == key:
            return kv.value.string_value
    return None


def test_langchain_agent_calls_become_one_transition_each(tmp_path, policy_server, receiver):
    engine = policy_server.engine
    transcript = tmp_path / "transcript.json"
    result = run_agent(agent_environment(receiver["grpc"], policy_server.base_url), transcript)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    replies = json.loads(transcript.read_text())

    # The server answered one request per model call the agent made, and at least two turns
    # (the random model never follows the format, so the agent reminds it and asks again).
    jobs = engine.jobs
    assert len(jobs) == len(replies) >= 2, (len(jobs), replies)
    served = [(tuple(job.prompt_ids), tuple(job.result.choices[0].token_ids)) for job in jobs]
    for (_, response_ids), reply in zip(served, replies, strict=True):
        assert engine.tokenizer.decode(list(response_ids), skip_special_tokens=True) == reply

    complete_rollout(receiver["http"], ROLLOUT_ID)
    store = SpanStore(receiver["db"])
    try:
        rollout = wait_for_assembled(store, ROLLOUT_ID)
        llm_spans = stored_llm_spans(store, ROLLOUT_ID)
    finally:
        store.close()

    # The store keeps both views of every call: LangChain's ``ChatOpenAI`` span and the OpenAI
    # SDK's span, which carries the ids. (openinference's LangChain tracer does not make its
    # span the current one, so the SDK span is not its child: pair them by time and content.)
    sdk_spans = [s for s in llm_spans if token_ids(s, semconv.LLM_PROMPT_TOKEN_IDS) is not None]
    langchain_spans = [s for s in llm_spans if s.name == "ChatOpenAI"]
    assert len(sdk_spans) == len(langchain_spans) == len(jobs) == len(llm_spans) // 2, \
        [s.name for s in llm_spans]
    for langchain_span, sdk_span, reply in zip(langchain_spans, sdk_spans, replies, strict=True):
        assert token_ids(langchain_span, semconv.LLM_PROMPT_TOKEN_IDS) is None
        assert langchain_span.start_time_unix_nano <= sdk_span.start_time_unix_nano
        assert sdk_span.end_time_unix_nano <= langchain_span.end_time_unix_nano
        assert string_attribute(langchain_span, OUTPUT_CONTENT) == reply
        assert string_attribute(sdk_span, OUTPUT_CONTENT) == reply

    # ...yet the rollout has exactly one transition per call, in the agent's call order, with
    # the engine's own ids (a doubled, shifted or re-tokenized transition fails here).
    assert rollout.task_id == TASK_ID and rollout.attempt == ATTEMPT
    assert rollout.end_reason == "explicit"
    # Each LangChain span was merged into its SDK span, not skipped as a call without ids.
    assert f"{len(jobs)} LLM span(s) recorded the same call as another span and were merged" \
        in rollout.problems, rollout.problems
    assert not any("no engine token ids" in p for p in rollout.problems), rollout.problems
    assert [(t.prompt_token_ids, t.response_token_ids) for t in rollout.transitions] == served
    assert [t.index for t in rollout.transitions] == list(range(len(served)))
    assert [t.span_id for t in rollout.transitions] == [s.span_id.hex() for s in sdk_spans]
    for transition in rollout.transitions:
        assert transition.retokenized is False
        assert transition.policy_version == 0
        assert transition.choice_index == 0
    # Each later prompt holds the earlier turns: the order is the conversation's order.
    for earlier, later in zip(rollout.transitions, rollout.transitions[1:], strict=False):
        assert len(later.prompt_token_ids) > len(earlier.prompt_token_ids)
        assert later.prompt_token_ids[:len(earlier.prompt_token_ids)] == earlier.prompt_token_ids
