"""The AutoGen calculator example's data and reward (no AutoGen needed: the trainer's side): the
word problems and their split, the calculator, the reward and the warm-start demonstrations."""

from __future__ import annotations

import json
import random
from pathlib import Path

from spanrl.examples.calc_autogen import demonstrations, problems
from spanrl.examples.calc_autogen.calculator import evaluate
from spanrl.examples.calc_autogen.reward import number_match, reward
from spanrl.examples.example_data import TOOL_ONLY_FRACTION

EXAMPLE_DIR = Path(__file__).resolve().parents[2] / "examples" / "calc_autogen"


def test_committed_task_files_are_what_the_generator_writes():
    train, validation = problems.make_tasks(seed=0)
    for name, tasks in (("train.jsonl", train), ("val.jsonl", validation)):
        lines = (EXAMPLE_DIR / name).read_text().splitlines()
        assert [json.loads(line) for line in lines] == tasks, f"regenerate {name} with problems.py"


def test_each_problems_steps_evaluate_to_its_answer_and_validation_is_new():
    train, validation = problems.make_tasks(seed=0)
    for task in train + validation:
        results = [evaluate(step) for step in task["steps"]]
        assert int(results[-1]) == task["answer"], task
        for result, following in zip(results, task["steps"][1:], strict=False):
            assert result in following  # each step uses the one before
        assert len(task["steps"]) >= 2
    assert {t["question"] for t in train}.isdisjoint({t["question"] for t in validation})
    assert {t["kind"] for t in validation} == set(problems.KINDS)


def test_the_calculator_evaluates_arithmetic_and_nothing_else():
    assert evaluate("37*24") == "888" and evaluate("(3+4)*2") == "14" and evaluate("7/2") == "3.50"
    assert evaluate("-5+2") == "-3"
    for bad in ("__import__('os')", "2**300", "1/0", "x+1", "", "9" * 14 + "*9" * 3):
        assert evaluate(bad).startswith("error: "), bad


def test_reward_compares_the_final_number():
    assert number_match("452", 452) == 1.0 and number_match("452.0", 452) == 1.0
    assert number_match("451", 452) == 0.0 and number_match("", 452) == 0.0
    assert reward({"answer": 730}, {"output": "730"}) == 1.0 and reward({"answer": 730}, {}) == 0.0


def test_demonstrations_show_the_calculators_replies_step_by_step():
    train, _ = problems.make_tasks(seed=0)
    rng = random.Random(0)
    full = early = 0
    for task in train:
        example = demonstrations.demonstration(task, rng)
        messages = example["messages"]
        assert example["tools"] == [demonstrations.TOOL_SCHEMA]
        expressions = [json.loads(m["tool_calls"][0]["function"]["arguments"])["expression"]
                       for m in messages if m.get("tool_calls")]
        assert 1 <= len(expressions) and expressions == task["steps"][:len(expressions)]
        replies = [m["content"] for m in messages if m["role"] == "tool"]
        assert replies == [evaluate(e) for e in expressions]
        # the reply is the calculator's last result: the answer when every step was evaluated
        assert messages[-1] == {"role": "assistant", "content": replies[-1]}
        full += len(expressions) == len(task["steps"]) and replies[-1] == str(task["answer"])
        early += len(expressions) < len(task["steps"]) and replies[-1] != str(task["answer"])
    assert full + early == len(train) and full and early


def test_demonstrations_are_on_fresh_problems_never_the_examples():
    """A demonstration on a training problem would let the model learn its answer by heart."""
    train, validation = problems.make_tasks(seed=0)
    example_questions = {task["question"] for task in train + validation}
    shown = [example["messages"][1]["content"] for batch in demonstrations.demonstration_batches(50, 16, seed=3)
             for example in batch]
    assert not example_questions & set(shown)
    assert len(set(shown)) > 0.95 * len(shown)
    assert shown != [example["messages"][1]["content"]
                     for batch in demonstrations.demonstration_batches(50, 16, seed=4) for example in batch]


def test_warm_start_shows_only_finished_runs_first():
    """The first part of a warm start shows only demonstrations that finish (example_data.weaker_share):
    there, a hasty demonstrator's batches are those of one who always finishes."""
    hasty = list(demonstrations.demonstration_batches(10, 32, seed=0, early_share=0.9))
    careful = list(demonstrations.demonstration_batches(10, 32, seed=0, early_share=0.0))
    full_only = int(10 * TOOL_ONLY_FRACTION)
    assert 0 < full_only < 10
    assert hasty[:full_only] == careful[:full_only]
    assert all(h != c for h, c in zip(hasty[full_only:], careful[full_only:], strict=True))
