"""The reward judge's answer read back (``judge/answer.py``) and its settings (``judge:`` block).

An answer the judge gives is usable only as the JSON asked for, with one score in [0, 1] per run:
anything else raises ``JudgeAnswerError`` naming what was wrong (the group is then left out).
``reward: judge`` without a judge, or with what it cannot run with, is a clear setting error.
"""

from __future__ import annotations

import json

import pytest

from spanrl.errors import SettingError
from spanrl.trainer_bridge.judge.answer import JudgeAnswerError, group_prompt, parse_answer
from spanrl.trainer_bridge.judge.config import JudgeConfig
from spanrl.trainer_bridge.train_settings import TrainSettings


def scores(*values, runs=None) -> str:
    runs = runs or range(1, len(values) + 1)
    entries = [{"run": r, "score": v, "explanation": f"why {r}"} for r, v in zip(runs, values, strict=True)]
    return json.dumps({"scores": entries})


def test_a_usable_answer_gives_one_verdict_per_run_in_run_order():
    assert [(v.score, v.explanation) for v in parse_answer(scores(0.2, 1, 0), 3)] == [
        (0.2, "why 1"), (1.0, "why 2"), (0.0, "why 3")]
    # runs listed out of order are put back in order; a code fence or a sentence around the JSON is read
    shuffled = parse_answer("Here you go:\n```json\n" + scores(0.5, 0.9, runs=[2, 1]) + "\n```", 2)
    assert [(v.score, v.explanation) for v in shuffled] == [(0.9, "why 1"), (0.5, "why 2")]
    long = parse_answer(json.dumps({"scores": [{"score": 1, "explanation": "x" * 5000}]}), 1)
    assert len(long[0].explanation) == 500


@pytest.mark.parametrize(("answer", "count", "reason"), [
    ("these runs look fine", 2, "the answer is not JSON ('these runs look fine')"),
    ("   \n ", 1, "the answer is not JSON (only whitespace"),
    ('{"verdicts": []}', 1, 'the answer has no "scores" list'),
    (scores(0.1, 0.2), 3, "the answer has 2 scores for a group of 3 runs"),
    (scores(0.1, 1.5), 2, "run 2's score 1.5 is outside [0, 1]"),
    (scores(0.1, "high"), 2, "run 2's score is not a number: 'high'"),
    (scores(True), 1, "run 1's score is not a number: True"),
])
def test_an_unusable_answer_says_why(answer, count, reason):
    with pytest.raises(JudgeAnswerError) as raised:
        parse_answer(answer, count)
    assert reason in str(raised.value)


def test_the_prompt_holds_the_rubric_the_task_and_each_run():
    prompt = group_prompt("Be strict.", '{"q": 1}', ["run one text", "run two text"])
    assert "Be strict." in prompt and '{"q": 1}' in prompt
    assert "<run 1>\nrun one text\n</run 1>" in prompt and "<run 2>\nrun two text\n</run 2>" in prompt
    assert "each of the 2 runs" in prompt


def test_combine_with_weighs_the_judge_against_the_function():
    config = JudgeConfig(url="http://127.0.0.1:9/v1", model="j", combine_with="m:f", weight=0.25)
    assert config.combined(1.0, 0.0) == 0.25 and config.combined(0.0, 1.0) == 0.75
    assert JudgeConfig(url="http://127.0.0.1:9/v1", model="j").combined(0.4, None) == 0.4


@pytest.mark.parametrize(("settings", "message"), [
    ({}, "reward: judge needs the judge's endpoint and model"),
    ({"judge": JudgeConfig(url="127.0.0.1:9", model="j")}, "judge.url must be an http(s) URL"),
    ({"judge": JudgeConfig(url="http://h/v1", model="j", api_key_env="sk-123 456")}, "judge.api_key_env must name"),
    ({"judge": JudgeConfig(url="http://h/v1", model="j", weight=1.5)}, "judge.weight must be in [0, 1]"),
    ({"judge": JudgeConfig(url="http://h/v1", model="j", combine_with="nocolon")}, "judge.combine_with must be"),
])
def test_reward_judge_settings_are_checked(settings, message):
    with pytest.raises(SettingError) as raised:
        TrainSettings(tasks="t.jsonl", model="m", reward="judge", **settings)
    assert message in str(raised.value)
