"""A reward function that asks for ``calls`` is given the rollout's LLM calls as text, read back
from the store's spans. Spans from the real OTel SDK (the calls' text as OpenInference attributes),
encoded as OTLP, written to a real store and assembled by the receiver's code; scored by the real
training loop and by the warm start's choice of rollouts, with retrieval QA's ``search_reward``
(graded by how far the agent's searches reached along the question's chain)."""

from __future__ import annotations

import json

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from spanrl.bridge_protocol import Attempt
from spanrl.instrumentation import semconv
from spanrl.otlp_receiver.assembly import AssemblyOptions, assemble_rollout
from spanrl.otlp_receiver.call_text import ChatText, to_attributes
from spanrl.otlp_receiver.otlp_decode import decode_request
from spanrl.otlp_receiver.span_tree import records_from_bodies
from spanrl.otlp_receiver.store import SpanStore
from spanrl.trainer_bridge.rollout_calls import rollout_calls
from spanrl.trainer_bridge.task_dispatch import Outcome
from spanrl.trainer_bridge.train_settings import TrainSettings
from spanrl.trainer_bridge.training_loop import TrainingLoop
from spanrl.trainer_bridge.warm_start import WarmStartConfig, choose_rollouts

REWARDS = "spanrl.examples.retrieval_qa.reward"
TASK = {"id": "qa-0", "question": "In which country is Rilvo Foods based?", "answer": "Hulix",
        "kind": "company_country", "hops": ["Rilvo Foods", "Losat"]}
RILVO = "Rilvo Foods was founded by Lotor Nevmarul. Rilvo Foods is based in Losat."
LOSAT = "Losat is a city in Hulix."


def _call(results: list[str], reply: dict) -> dict:
    """An LLM call's span attributes: the question, one search and result per entry of ``results``, ``reply``."""
    messages = [{"role": "user", "content": TASK["question"]}]
    for index, result in enumerate(results):
        call = {"id": f"c{index}", "type": "function", "function": {"name": "search", "arguments": "{}"}}
        messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "content": result, "tool_call_id": f"c{index}"}]
    return {semconv.OPENINFERENCE_SPAN_KIND: semconv.SPAN_KIND_LLM, semconv.LLM_PROMPT_TOKEN_IDS: [1, len(results)],
            semconv.llm_response_token_ids(0): [2], semconv.AGENT_NAME: "researcher",
            **to_attributes(ChatText(messages=messages, reply=reply))}


def _store_rollout(store: SpanStore, rollout_id: str, results: list[str], answer: str) -> None:
    """A rollout that searched ``len(results)`` times (one call each) and answered ``answer``, in ``store``."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span(semconv.ROLLOUT_SPAN_NAME, attributes={
            semconv.ROLLOUT_ID: rollout_id, semconv.TASK_ID: TASK["id"], semconv.variable("output"): answer}):
        for searches in range(len(results) + 1):
            reply = ({"role": "assistant", "content": answer} if searches == len(results) else
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "x", "type": "function", "function": {"name": "search", "arguments": "{}"}}]})
            with tracer.start_as_current_span("llm", attributes={semconv.ROLLOUT_ID: rollout_id,
                                                                 **_call(results[:searches], reply)}):
                pass
    provider.shutdown()
    rows = decode_request(encode_spans(exporter.get_finished_spans())).rows
    store.write_spans(rows)
    records = records_from_bodies(row.body for row in rows)
    store.save_assembled(assemble_rollout(rollout_id, records, "rollout_span", AssemblyOptions()))


# rollout id -> (the tool results it was shown, its answer)
ROLLOUTS = {"right": ([RILVO, LOSAT], "Hulix"), "reached the answer": ([RILVO, LOSAT], "Losat"),
            "one hop": ([RILVO], "Losat"), "no search": ([], "Dorfi")}
EXPECTED = {"right": 1.0, "reached the answer": 0.5, "one hop": 0.25, "no search": 0.0}


def _tasks_file(tmp_path) -> str:
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps(TASK) + "\n")
    return str(tasks)


def test_the_training_loop_gives_a_reward_function_the_rollouts_calls(tmp_path):
    loop = TrainingLoop(TrainSettings(tasks=_tasks_file(tmp_path), model="unused-by-the-loop",
                                      store=str(tmp_path / "s.db"), assembly_wait_s=5.0,
                                      reward=f"{REWARDS}:search_reward"))
    for rollout_id, (results, answer) in ROLLOUTS.items():
        _store_rollout(loop.store, rollout_id, results, answer)
    attempts = [Attempt(rollout_id, TASK["id"], 0, TASK, 0) for rollout_id in ROLLOUTS]
    report = loop.collect(attempts, {a.rollout_id: Outcome("ok") for a in attempts})
    assert {item.attempt.rollout_id: item.score for item in report.scored} == EXPECTED


def test_rollout_calls_are_the_calls_in_order_with_prompt_reply_and_agent(tmp_path):
    with SpanStore(tmp_path / "s.db") as store:
        _store_rollout(store, "r", [RILVO, LOSAT], "Hulix")
        calls = rollout_calls(store, store.assembled_rollout("r"))
    assert [len(call["messages"]) for call in calls] == [1, 3, 5]
    assert [m["content"] for m in calls[2]["messages"] if m["role"] == "tool"] == [RILVO, LOSAT]
    assert calls[2]["reply"]["content"] == "Hulix"
    assert calls[0]["reply"]["tool_calls"][0]["function"]["name"] == "search"
    assert {call["agent"] for call in calls} == {"researcher"}


def test_the_warm_start_chooses_rollouts_by_a_reward_that_reads_calls(tmp_path):
    with SpanStore(tmp_path / "s.db") as store:
        for rollout_id, (results, answer) in ROLLOUTS.items():
            _store_rollout(store, rollout_id, results, answer)
    chosen = choose_rollouts(WarmStartConfig(store=str(tmp_path / "s.db"), tasks=_tasks_file(tmp_path),
                                             reward=f"{REWARDS}:search_reward", min_reward=0.25))
    assert (chosen.rollouts, chosen.scored, chosen.best, chosen.worst_chosen) == (3, 4, 1.0, 0.25)


def _collect(loop: TrainingLoop, held_out: bool = False, prefix: str = ""):
    for rollout_id, (results, answer) in ROLLOUTS.items():
        _store_rollout(loop.store, prefix + rollout_id, results, answer)
    attempts = [Attempt(prefix + rollout_id, TASK["id"], 0, TASK, 0) for rollout_id in ROLLOUTS]
    return loop.collect(attempts, {a.rollout_id: Outcome("ok") for a in attempts}, held_out=held_out)


def _loop(tmp_path, **settings) -> TrainingLoop:
    return TrainingLoop(TrainSettings(tasks=_tasks_file(tmp_path), model="unused-by-the-loop",
                                      store=str(tmp_path / "s.db"), assembly_wait_s=5.0, **settings))


def test_per_call_rewards_reach_the_calls_that_earned_them(tmp_path):
    # each search that first showed an entity of the two-entity chain earns 0.25; the answering call
    # is judged by its answer alone
    report = _collect(_loop(tmp_path, reward=f"{REWARDS}:search_step_rewards", advantage_level="transition"))
    returns = {item.attempt.rollout_id: [t.return_ for t in item.transitions] for item in report.scored}
    assert returns == {"right": [1.25, 1.25, 1.0], "reached the answer": [0.25, 0.25, 0.0],
                       "one hop": [0.25, 0.0], "no search": [0.0]}


def test_per_call_rewards_add_to_the_score_of_a_trained_rollout_never_to_a_held_out_one(tmp_path):
    loop = _loop(tmp_path, reward=f"{REWARDS}:search_step_rewards")
    trained = {item.attempt.rollout_id: item for item in _collect(loop).scored}
    held_out = {item.attempt.rollout_id: item for item in _collect(loop, held_out=True, prefix="v-").scored}
    assert {key: item.score for key, item in trained.items()} == {
        "right": 1.5, "reached the answer": 0.5, "one hop": 0.25, "no search": 0.0}
    assert {key: item.score for key, item in held_out.items()} == {
        "v-right": 1.0, "v-reached the answer": 0.0, "v-one hop": 0.0, "v-no search": 0.0}
    function = f"reward function {REWARDS}:search_step_rewards"
    assert trained["right"].reward_source == f"{function} + per-call rewards"
    assert trained["no search"].reward_source == held_out["v-right"].reward_source == function


def test_a_reward_function_whose_per_call_rewards_do_not_fit_the_calls_leaves_the_rollout_out(tmp_path, caplog):
    (tmp_path / "bad_rewards.py").write_text(
        "def one_too_many(task, variables, calls):\n"
        "    return {'outcome': 1.0, 'calls': [0.0] * (len(calls) + 1)}\n"
        "def unknown_key(task, variables):\n"
        "    return {'outcome': 1.0, 'bonus': 2}\n")
    for function, message in (("one_too_many", "per-call rewards for"), ("unknown_key", "needs the key 'outcome'")):
        caplog.clear()
        (tmp_path / function).mkdir()
        report = _collect(_loop(tmp_path / function, reward=f"bad_rewards:{function}", python_path=[str(tmp_path)]))
        assert not report.scored and report.left_out == {"reward_error": len(ROLLOUTS)}
        assert message in caplog.text
