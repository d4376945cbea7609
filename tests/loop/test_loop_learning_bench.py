"""bench/learning.py's bookkeeping, on results made up here (the runs themselves are the examples'
training tests): the mean and spread over seeds, which arms each task runs, and the table written
between the markers of docs/results.md, leaving the hand-written rest of the file alone."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return _load("learning")


@pytest.fixture(scope="module")
def report():
    return _load("learning_report")


def _seeds() -> dict:
    return {0: {"warm": {"accuracy": {0: 0.2}, "seconds": 5.0},
                "grpo": {"accuracy": {0: 0.2, 2: 0.4, 4: 0.6}, "seconds": 10.0, "rollouts": 64}},
            1: {"warm": {"accuracy": {0: 0.4}, "seconds": 7.0},
                "grpo": {"accuracy": {"0": 0.4, "2": 0.4, "4": 0.8}, "seconds": 30.0, "rollouts": 64}}}


def test_summary_is_the_mean_and_spread_over_seeds_at_each_step(bench, report):
    summary = report.summarise(_seeds())
    assert summary["grpo"]["steps"] == [0, 2, 4]
    assert summary["grpo"]["mean"] == pytest.approx([0.3, 0.4, 0.7])
    assert summary["grpo"]["std"] == pytest.approx([0.1, 0.0, 0.1])
    assert summary["grpo"]["final"] == [0.6, 0.8] and summary["warm"]["mean"] == pytest.approx([0.3])


def test_the_sql_ablations_change_one_thing_each(bench):
    from spanrl.examples.task_pipeline import TrainingRun

    base = TrainingRun(output_dir="", model_dir="m", settings={"kl_coef": 0.01})
    assert bench.arm_run("grpo", base, "sql_agent") == base
    assert bench.arm_run("sft", base, "sql_agent").algorithm == "sft"
    assert bench.arm_run("grpo_no_air", base, "sql_agent").air is False
    identical = bench.arm_run("grpo_identical", base, "sql_agent")
    assert identical.credit == "identical" and identical.settings == {"kl_coef": 0.01, "advantage_level": "rollout"}
    assert bench.arm_run("grpo_all_agents", base, "sql_agent").agents == ()
    assert bench.arm_run("reinforce_plus_plus", base, "calc_autogen").settings == {
        "kl_coef": 0.01, "advantage_estimator": "reinforce_plus_plus"}
    graded = bench.arm_run("grpo_graded", base, "retrieval_qa")
    assert graded.settings == {"kl_coef": 0.01, "reward": "spanrl.examples.retrieval_qa.reward:search_reward",
                               "val_reward_fn": "spanrl.examples.retrieval_qa.reward:reward"}
    per_call = bench.arm_run("grpo_graded_calls", base, "retrieval_qa")
    assert per_call.settings == {"kl_coef": 0.01, "reward": "spanrl.examples.retrieval_qa.reward:search_step_rewards",
                                 "val_reward_fn": "spanrl.examples.retrieval_qa.reward:reward",
                                 "advantage_level": "transition"}


def test_each_ablation_runs_only_on_the_tasks_that_have_what_it_changes(bench):
    runs = {name: {arm for arm in bench.ARMS if bench.arm_applies(arm, bench.load_task(name))}
            for name in ("sql_agent", "retrieval_qa")}
    assert runs["sql_agent"] == set(bench.ARMS) - {"grpo_graded", "grpo_graded_calls"}
    assert runs["retrieval_qa"] == {"grpo", "sft", "reinforce_plus_plus", "grpo_graded", "grpo_graded_calls"}


def test_repeats_are_averaged_and_every_arm_is_compared_with_sft_and_grpo_run_by_run(bench, report):
    def run(*curve: float) -> dict:
        return {"accuracy": dict(zip((0, 2, 4), curve, strict=True)), "seconds": 10.0, "rollouts": 64,
                "by_kind": {"a": curve[-1]}}

    seed = {"warm": {"accuracy": {0: 0.2}, "seconds": 5.0},
            "grpo": report.over_repeats([run(0.2, 0.5, 0.6), run(0.2, 0.3, 0.8)]),
            "sft": report.over_repeats([run(0.2, 0.5, 0.7), run(0.2, 0.4, 0.7)]),
            "reinforce_plus_plus": report.over_repeats([run(0.2, 0.6, 0.9), run(0.2, 0.6, 0.7)])}
    assert seed["grpo"]["accuracy"] == pytest.approx({0: 0.2, 2: 0.4, 4: 0.7})
    assert seed["grpo"]["by_kind"] == pytest.approx({"a": 0.7}) and len(seed["grpo"]["runs"]) == 2
    assert report.final_accuracies(seed["grpo"]) == [0.6, 0.8]
    assert report.summarise({0: seed})["grpo"]["final"] == pytest.approx([0.7])  # the seed's mean
    rows = report.paired_rows({0: seed, 1: seed})
    # differences -0.1, +0.1 on each seed: sd 0.1155, t(0.975, 3 df) = 3.182, so +-0.184 around the mean
    assert "| grpo | sft | 4 | 2 / 0 / 2 | +0.000 | [-0.184, +0.184] | 1.00 |" in rows
    assert "| reinforce_plus_plus | sft | 4 | 2 / 2 / 0 | +0.100 | [-0.084, +0.284] | 0.50 |" in rows
    assert "| reinforce_plus_plus | grpo | 4 | 2 / 0 / 2 | +0.100 | [-0.267, +0.467] | 1.00 |" in rows
    assert not any("| sft | grpo |" in row for row in rows)  # each pair of arms once
    assert report.paired_rows({0: {**seed, "grpo": run(0.2, 0.3, 0.5), "sft": run(0.2, 0.3, 0.4)}}) == []  # one pair
    assert report.sign_test(7, 0) == pytest.approx(2 / 128) and report.sign_test(0, 0) == 1.0
    assert report.sign_test(6, 3) == pytest.approx(report.sign_test(3, 6)) == pytest.approx(2 * 130 / 512)


def test_the_interval_of_a_mean_difference_is_students_t(report):
    # quantiles from the t table: 12.706 (1 df), 3.182 (3), 2.201 (11), 2.042 (30)
    for degrees, quantile in ((1, 12.706), (3, 3.182), (11, 2.201), (30, 2.042)):
        assert report.student_t_quantile(0.975, degrees) == pytest.approx(quantile, abs=2e-3)
    assert report.student_t_quantile(0.95, 11) == pytest.approx(1.796, abs=2e-3)
    low, high = report.mean_interval([0.1, 0.3])  # mean 0.2, sd 0.1414, se 0.1
    assert (low, high) == pytest.approx((0.2 - 1.2706, 0.2 + 1.2706), abs=1e-3)
    assert report.interval_text([0.05]) == "-"  # no interval from one pair


def _stored(warm: float, grpo: list[float], sft: list[float]) -> dict:
    """A results.json of one retrieval QA seed as bench/learning.py writes it (keys are strings)."""
    def arm(finals: list[float]) -> dict:
        runs = [{"accuracy": {"0": warm, "5": final - 0.1, "10": final}, "seconds": 9.0} for final in finals]
        return {**runs[0], "runs": runs}

    return {"tasks": {"retrieval_qa": {"seeds": {"1": {"warm": {"accuracy": {"0": warm}, "seconds": 3.0},
                                                       "grpo": arm(grpo), "sft": arm(sft)}}}}}


def _write(folder: Path, content: dict, training: dict | None = None) -> Path:
    """``content`` as ``folder/results.json``; ``training``, when given, recorded on every GRPO run."""
    for run in content["tasks"]["retrieval_qa"]["seeds"]["1"]["grpo"]["runs"]:
        if training is not None:
            run["training"] = training
    folder.mkdir(exist_ok=True)
    (folder / "results.json").write_text(json.dumps(content))
    return folder


def test_runs_from_several_folders_pool_when_their_warm_starts_match(report, tmp_path, capsys):
    first = _write(tmp_path / "a", _stored(0.2, [0.6, 0.7], [0.5, 0.7]))
    second = _write(tmp_path / "b", _stored(0.2, [0.9], [0.6]))
    other_warm = _write(tmp_path / "c", _stored(0.3, [0.9], [0.6]))
    assert report.main([str(first), str(second / "results.json")]) == 0
    printed = capsys.readouterr().out
    assert "| grpo | 3 | 0.200 | 0.633 | 0.733 | 0.683 |" in printed  # three runs, each counted once
    assert "| grpo | sft | 3 | 2 / 1 / 0 | +0.133 |" in printed  # 0.6-0.5, 0.7-0.7, 0.9-0.6
    with pytest.raises(SystemExit, match="seed 1: the warm start differs between .* and .*c"):
        report.main([str(first), str(other_warm)])
    with pytest.raises(SystemExit, match="no results.json"):
        report.main([str(tmp_path / "missing")])


def test_runs_of_one_arm_pool_only_when_they_trained_alike(bench, report, tmp_path):
    from spanrl.examples.task_pipeline import TrainingRun

    base = TrainingRun(output_dir="", model_dir="m")
    plain, graded = (bench.what_trained(bench.arm_run(arm, base, "retrieval_qa")) for arm in ("grpo", "grpo_graded"))
    assert graded["settings"]["reward"].endswith("retrieval_qa.reward:search_reward")
    assert "reward" not in plain["settings"]
    alike = _write(tmp_path / "a", _stored(0.2, [0.6], [0.5]), plain)
    assert report.main([str(alike), str(_write(tmp_path / "b", _stored(0.2, [0.7], [0.5]), plain))]) == 0
    assert report.main([str(alike), str(_write(tmp_path / "old", _stored(0.2, [0.7], [0.5])))]) == 0  # unrecorded
    renamed = _write(tmp_path / "c", _stored(0.2, [0.9], [0.6]), graded)  # the same arm name, another reward
    with pytest.raises(SystemExit, match=r"seed 1 arm grpo: .*a and .*c trained it differently \(settings\)"):
        report.main([str(alike), str(renamed)])


def test_the_results_file_takes_each_measured_task_and_keeps_the_others(bench, tmp_path, report):
    args = bench.parse_args(["--quick", "--tasks", "retrieval_qa"])
    seeds = _seeds()
    seeds[0]["warm"]["sft"] = "800 SFT steps of 64"
    sections = report.table({"tasks": {"retrieval_qa": {"summary": report.summarise(seeds), "seeds": seeds}}}, args,
                           "python x")
    section = sections["retrieval_qa"]
    assert "| grpo | 0.300 | 0.700 ± 0.100 | +0.400 | 0.60 0.80 | 64 | 20 s |" in section
    assert "Warm start: 800 SFT steps of 64." in section  # each task says how its warm start was built
    assert "`python x`" in section  # and which command measured it
    sql_begin, sql_end = report.task_markers("sql_agent")
    qa_begin, qa_end = report.task_markers("retrieval_qa")
    results = tmp_path / "results.md"
    results.write_text(f"# Results\n\nbefore\n\n{report.BEGIN}\n{sql_begin}\nthe SQL table\n{sql_end}\n\n"
                       f"{qa_begin}\nold QA table\n{qa_end}\n{report.END}\n\nafter: the log\n")
    report.write_results(results, sections)
    text = results.read_text()
    assert "old QA table" not in text and section in text
    assert "the SQL table" in text  # a task this run did not measure keeps its section
    assert text.startswith("# Results\n\nbefore\n\n") and text.endswith("\n\nafter: the log\n")
    report.write_results(results, {"calc_autogen": "<!-- calc -->"})  # a task new to the file goes last
    text = results.read_text()
    assert text.index("the SQL table") < text.index(section) < text.index("<!-- calc -->") < text.index(report.END)


def test_a_results_file_without_markers_gets_the_block_appended(bench, tmp_path, report):
    results = tmp_path / "results.md"
    results.write_text("# Results\n\nthe log\n")
    report.write_results(results, {"sql_agent": "SQL section"})
    text = results.read_text()
    assert text.startswith("# Results\n\nthe log\n") and text.index(report.BEGIN) < text.index("SQL section")
    assert text.rstrip().endswith(report.END)


def test_trainer_settings_given_as_json_reach_the_trainer(bench, tmp_path):
    """``--settings '{"trainer": {"ppo_epochs": 4}}'``: the trainer block is merged into the run's
    trainer (which keeps one checkpoint), the other keys stay top-level settings."""
    from spanrl.examples.sql_agent.pipeline import TASK
    from spanrl.examples.task_pipeline import TrainingRun, _services
    from spanrl.trainer_bridge.torch_backend.config import TrainerConfig

    run = TrainingRun(output_dir=str(tmp_path), model_dir="m",
                      settings={"trainer": {"ppo_epochs": 4}, "kl_coef": 0.01})
    settings = _services(TASK, run)._settings(str(tmp_path), str(tmp_path / "db"), 1, 2)
    assert settings.trainer.ppo_epochs == 4 and settings.trainer.keep_checkpoints == 1
    assert settings.algorithm_config.ppo_epochs == 4 and settings.algorithm_config.kl_coef == 0.01
    assert run.settings == {"trainer": {"ppo_epochs": 4}, "kl_coef": 0.01}  # the run is left as it was
    given = TrainerConfig(keep_checkpoints=2, ppo_epochs=3)  # a whole TrainerConfig is taken as it is
    run = TrainingRun(output_dir=str(tmp_path), model_dir="m", settings={"trainer": given})
    trainer = _services(TASK, run)._settings(str(tmp_path), str(tmp_path / "db"), 1, 2).trainer
    assert (trainer.keep_checkpoints, trainer.ppo_epochs) == (2, 3)


@pytest.mark.parametrize("task_name", ["sql_agent", "retrieval_qa", "calc_autogen"])
def test_each_examples_train_yaml_warm_starts_as_its_pipeline_does(task_name):
    """By hand (`spanrl train examples/<task>/train.yaml`) or by the pipeline and bench/learning.py,
    a task's warm start takes the same steps, batch size and learning rate."""
    import importlib

    import yaml

    task = importlib.import_module(f"spanrl.examples.{task_name}.pipeline").TASK
    block = yaml.safe_load((REPO / "examples" / task_name / "train.yaml").read_text())["warm_start"]
    assert (block["steps"], block["batch_size"], block["learning_rate"]) == (
        task.warm_start.steps, task.warm_start.batch_size, task.warm_start.learning_rate), task_name


def test_held_out_accuracy_by_kind_reads_the_last_validation_round(tmp_path):
    """A run's last round (``validation.jsonl``'s last line, or ``--val-only``'s ``validation.json``),
    each task's score summed by kind; a task the round did not score counts 0."""
    import json

    from spanrl.examples.calc_autogen.pipeline import TASK as CALC
    from spanrl.examples.sql_agent.pipeline import TASK as SQL
    from spanrl.examples.task_pipeline import held_out_by_kind

    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps({"id": f"t{n}", "kind": kind}) + "\n"
                           for n, kind in enumerate(["weeks", "weeks", "orchard", "orchard"])))
    run = tmp_path / "arm" / "run"
    run.mkdir(parents=True)
    (run / "validation.jsonl").write_text(
        json.dumps({"step": 2, "task_scores": {"t0": 0.0, "t1": 0.0, "t2": 1.0, "t3": 1.0}}) + "\n"
        + json.dumps({"step": 4, "task_scores": {"t0": 1.0, "t1": 0.5, "t2": 1.0}}) + "\n")
    assert held_out_by_kind(CALC, str(tmp_path / "arm"), str(val)) == {"orchard": 0.5, "weeks": 0.75}
    warm = tmp_path / "warm" / "run"
    warm.mkdir(parents=True)
    (warm / "validation.json").write_text(json.dumps({"task_scores": {"t2": 1.0, "t3": 1.0}}))
    assert held_out_by_kind(CALC, str(tmp_path / "warm"), str(val)) == {"orchard": 1.0, "weeks": 0.0}
    assert held_out_by_kind(SQL, str(tmp_path / "arm"), str(val)) == {}  # its accuracy is a reward event
    val.write_text(json.dumps({"id": "t0"}) + "\n")
    assert held_out_by_kind(CALC, str(tmp_path / "arm"), str(val)) == {}  # tasks without a kind


def test_the_section_has_a_table_by_kind_when_the_tasks_have_kinds(bench, report):
    args = bench.parse_args(["--quick", "--tasks", "calc_autogen"])
    seeds = _seeds()
    seeds[0]["warm"]["by_kind"], seeds[1]["warm"]["by_kind"] = {"orchard": 0.0, "weeks": 1.0}, {"orchard": 0.5,
                                                                                                "weeks": 1.0}
    seeds[0]["grpo"]["by_kind"], seeds[1]["grpo"]["by_kind"] = {"orchard": 1.0, "weeks": 1.0}, {"orchard": 0.5,
                                                                                                "weeks": 0.5}
    section = report.table({"tasks": {"calc_autogen": {"summary": report.summarise(seeds), "seeds": seeds}}}, args,
                          "python x")["calc_autogen"]
    assert "| kind | warm | grpo |" in section
    assert "| orchard | 0.25 | 0.75 |" in section and "| weeks | 1.00 | 0.75 |" in section
    del seeds[1]["grpo"]["by_kind"]  # an arm is in the table only when every seed has its kinds
    section = report.table({"tasks": {"calc_autogen": {"summary": report.summarise(seeds), "seeds": seeds}}}, args,
                          "python x")["calc_autogen"]
    assert "| kind | warm |" in section and "| kind | warm | grpo |" not in section


def test_every_arm_runs_all_its_steps_even_while_it_has_nothing_to_learn(bench):
    """A weak warm start gives SFT from rollouts no success for steps on end; at the trainer's default
    (``max_empty_steps: 3``) its ``NothingToTrain`` ended the whole benchmark, every later arm and seed
    with it. The arms share ``max_empty_steps: 0`` unless ``--settings`` says otherwise."""
    import dataclasses

    from spanrl.trainer_bridge.train_settings import TrainSettings

    default = {f.name: f.default for f in dataclasses.fields(TrainSettings)}["max_empty_steps"]
    assert default > 0  # the trainer's own default stops, which is why the bench sets it
    assert bench.arm_settings(bench.parse_args([])) == {"max_empty_steps": 0}
    given = bench.parse_args(["--settings", '{"max_empty_steps": 5, "kl_coef": 0.01}',
                              "--sft-arm-learning-rate", "1e-4"])
    assert bench.arm_settings(given) == {"max_empty_steps": 5, "kl_coef": 0.01, "sft_learning_rate": 1e-4}
