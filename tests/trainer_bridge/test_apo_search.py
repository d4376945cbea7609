"""The APO beam search's decisions, the optimizer answer's parsing and the apo: block's checks.

The search is given plain functions as its evaluator, validator and optimizer (its seams: the
real ones run rollouts, tests/trainer_bridge/test_apo_training.py runs those), so what it keeps,
what it asks the optimizer for and which prompt it returns can be checked exactly.
"""

from __future__ import annotations

import pytest

from spanrl.errors import SettingError
from spanrl.trainer_bridge.apo.config import ApoConfig
from spanrl.trainer_bridge.apo.optimizer import UnusableAnswer, edited_prompt
from spanrl.trainer_bridge.apo.search import ApoSearch, Candidate, Evaluation, Proposals


def scored_by(score_of):
    """An evaluator scoring each candidate by ``score_of(text)`` over two 'rollouts'."""
    calls = []

    def evaluate(candidates, number):
        calls.append((number, [c.name for c in candidates]))
        return {c.name: Evaluation(c, [score_of(c.text)] * 2, [f"{c.name}-a0", f"{c.name}-a1"]) for c in candidates}

    return evaluate, calls


def test_selection_from_a_pool_keeps_the_best_and_validates_the_beam():
    evaluate, calls = scored_by(lambda text: text.count("!") / 3)
    validated = []

    def validate(candidates, number):
        validated.append([c.name for c in candidates])
        return {c.name: c.text.count("!") / 3 for c in candidates}

    pool = [Candidate("plain", "Reply."), Candidate("loud", "Reply!!!"), Candidate("some", "Reply!")]
    search = ApoSearch(evaluate, None, validate, beam_width=2, branch_factor=2, rounds=2)
    best = search.run(pool)
    assert best.name == "loud"
    # round 0 scores the pool; later rounds score the beam again on fresh batches
    assert calls == [(0, ["plain", "loud", "some"]), (1, ["loud", "some"]), (2, ["loud", "some"])]
    assert validated == [["loud", "some"]]  # a candidate is validated once
    assert search.held_out == {"loud": 1.0, "some": pytest.approx(1 / 3)}


def test_edits_join_the_beam_when_they_score_better_and_the_history_best_wins():
    evaluate, calls = scored_by(lambda text: len(text) / 100)
    asked = []

    def propose(evaluation, count, number):
        asked.append((evaluation.candidate.name, count, number, list(evaluation.rollouts)))
        parent = evaluation.candidate
        return Proposals([Candidate(f"{parent.name}+{number}.{k}", parent.text + "x" * (k + 1), parent.name)
                          for k in range(count)], dropped=1)

    # held-out scores: the first edit generalizes best, later (longer) ones do worse
    held_out = {"start": 0.2, "start+1.0": 0.9, "start+1.1": 0.5}

    def validate(candidates, number):
        return {c.name: held_out.get(c.name, 0.1) for c in candidates}

    reports = []
    search = ApoSearch(evaluate, propose, validate, beam_width=2, branch_factor=2, rounds=2)
    best = search.run([Candidate("start", "Reply.")], on_round=reports.append)
    assert [r.round for r in reports] == [0, 1, 2]
    assert asked[0] == ("start", 2, 1, ["start-a0", "start-a1"])  # the parent's rollouts, for the critique
    assert [r.proposed for r in reports] == [0, 2, 4] and [r.dropped for r in reports] == [0, 1, 2]
    assert [c.name for c in reports[1].beam] == ["start+1.1", "start+1.0"]  # the longer text scores higher
    # round 2's edits train better but hold out worse: the history best stays
    assert best.name == "start+1.0" and reports[-1].best_score == 0.9
    assert best.parent == "start"


def test_without_validation_the_last_rounds_best_wins_and_ties_keep_the_older():
    evaluate, _ = scored_by(lambda text: 0.5)
    search = ApoSearch(evaluate, None, None, beam_width=1, branch_factor=0, rounds=1)
    assert search.run([Candidate("first", "A"), Candidate("second", "B")]).name == "first"


def test_a_candidate_whose_rollouts_all_left_out_ranks_last():
    def evaluate(candidates, number):
        return {c.name: Evaluation(c, [] if c.name == "broken" else [0.0]) for c in candidates}

    search = ApoSearch(evaluate, None, None, beam_width=1, branch_factor=0, rounds=0)
    assert search.run([Candidate("broken", "A"), Candidate("weak", "B")]).name == "weak"


@pytest.mark.parametrize(("answer", "reason"), [
    ("I would say: be concise.", "no <prompt>...</prompt> block"),
    ("<prompt>   </prompt>", "the edited prompt was empty"),
    ("<prompt>" + "x" * 50 + "</prompt>", "50 characters, over apo.max_prompt_chars (40)"),
    ("<prompt>Reply.</prompt>", "unchanged"),
])
def test_an_unusable_edit_answer_says_why(answer, reason):
    with pytest.raises(UnusableAnswer, match=reason.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        edited_prompt(answer, "Reply.", max_chars=40)


def test_the_edit_is_the_last_prompt_block():
    answer = "Format: <prompt>...</prompt>\nHere it is: <PROMPT>\n Reply in brackets.\n</PROMPT>"
    assert edited_prompt(answer, "Reply.", max_chars=100) == "Reply in brackets."


@pytest.mark.parametrize(("fields", "message"), [
    ({"beam_width": 0}, "apo.beam_width must be at least 1"),
    ({"rounds": -1}, "apo.rounds must be 0 or more"),
    ({"optimizer_url": "http://127.0.0.1:9/v1"}, "name the optimizer model too"),
    ({"optimizer_key_env": "sk-abc123 secret"}, "must name an environment variable"),
])
def test_the_apo_block_refuses_bad_settings(fields, message):
    with pytest.raises(SettingError, match=message):
        ApoConfig(**fields)


def test_algorithm_apo_needs_starting_prompts_and_refuses_resume(tmp_path):
    from spanrl.trainer_bridge.loop_settings import LoopSettings

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "a"}\n')
    with pytest.raises(SettingError, match="apo.prompts"):
        LoopSettings(tasks=str(tasks), model="m", algorithm="apo")
    with pytest.raises(SettingError, match="--resume continues GRPO and SFT runs only"):
        LoopSettings(tasks=str(tasks), model="m", algorithm="apo", resume=True, apo=ApoConfig(prompts="p.yaml"))
    # apo alone needs no group; apo then GRPO does
    assert LoopSettings(tasks=str(tasks), model="m", algorithm="apo", group_size=1,
                        apo=ApoConfig(prompts="p.yaml")).runs_grpo is False
    with pytest.raises(SettingError, match="group_size must be at least 2"):
        LoopSettings(tasks=str(tasks), model="m", algorithm="apo", group_size=1,
                     apo=ApoConfig(prompts="p.yaml", then_grpo=True))


def test_backend_endpoint_runs_apo_only_and_needs_its_url(tmp_path):
    from spanrl.trainer_bridge.backend import check_backend, make_backend
    from spanrl.trainer_bridge.train_settings import TrainSettings

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"id": "a"}\n')
    apo = ApoConfig(prompts="p.yaml")
    with pytest.raises(SettingError, match="backend endpoint trains no weights"):
        TrainSettings(tasks=str(tasks), backend="endpoint", endpoint_url="http://127.0.0.1:1/v1")
    with pytest.raises(SettingError, match="backend endpoint trains no weights"):
        TrainSettings(tasks=str(tasks), backend="endpoint", endpoint_url="http://127.0.0.1:1/v1", algorithm="apo",
                      apo=ApoConfig(prompts="p.yaml", then_grpo=True))
    with pytest.raises(SettingError, match="needs endpoint_url"):
        TrainSettings(tasks=str(tasks), backend="endpoint", algorithm="apo", apo=apo)
    with pytest.raises(SettingError, match="'model' is required"):  # the other backends still need one
        TrainSettings(tasks=str(tasks), algorithm="apo", apo=apo)
    # no model needed; an endpoint that is not there is said at start, naming it
    settings = TrainSettings(tasks=str(tasks), backend="endpoint", endpoint_url="ftp://x/v1", algorithm="apo", apo=apo)
    with pytest.raises(SettingError, match="must be an http"):
        check_backend("endpoint", settings.backend_run())
    from spanrl.child_processes import free_port
    from spanrl.errors import UserError

    url = f"http://127.0.0.1:{free_port()}/v1"
    settings = TrainSettings(tasks=str(tasks), backend="endpoint", endpoint_url=url, algorithm="apo", apo=apo)
    with pytest.raises(UserError, match=f"the endpoint {url} cannot be reached"):
        make_backend("endpoint", settings.backend_run())
