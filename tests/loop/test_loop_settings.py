"""Settings precedence for spanrl train / run: flag > environment > YAML > default."""

from __future__ import annotations

import argparse

import pytest

from spanrl.env_settings import SettingError
from spanrl.errors import UserError
from spanrl.runner.settings import RunnerSettings
from spanrl.settings_loader import add_settings_flags, load_settings
from spanrl.trainer_bridge.train_settings import TrainSettings


def _parse(cls, prefix, argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("config", nargs="?")
    add_settings_flags(parser, cls, prefix)
    return parser.parse_args(argv)


def test_flag_beats_environment_beats_yaml_beats_default(tmp_path, monkeypatch):
    config = tmp_path / "train.yaml"
    config.write_text("tasks: t.jsonl\nmodel: m\ngroup_size: 4\nsteps: 7\nlearning_rate: 0.5\n")
    monkeypatch.setenv("OTEL_SPANRL_TRAIN_STEPS", "9")
    monkeypatch.setenv("OTEL_SPANRL_TRAIN_LEARNING_RATE", "0.25")
    args = _parse(TrainSettings, "TRAIN", [str(config), "--learning-rate", "0.125",
                                           "--no-norm-adv-by-std"])
    settings = load_settings(TrainSettings, "TRAIN", args.config, args)
    assert settings.learning_rate == 0.125  # flag
    assert settings.steps == 9  # environment over YAML
    assert settings.group_size == 4  # YAML over default
    assert settings.tasks_per_step == 16  # default
    assert settings.norm_adv_by_std is False


def test_unknown_yaml_key_and_bad_values_are_named(tmp_path, monkeypatch):
    config = tmp_path / "train.yaml"
    config.write_text("tasks: t.jsonl\nmodel: m\ngroup_sise: 4\n")
    with pytest.raises(SettingError, match="group_sise"):
        load_settings(TrainSettings, "TRAIN", str(config), None)
    config.write_text("tasks: t.jsonl\nmodel: m\n")
    monkeypatch.setenv("OTEL_SPANRL_TRAIN_GROUP_SIZE", "eight")
    with pytest.raises(SettingError, match="OTEL_SPANRL_TRAIN_GROUP_SIZE"):
        load_settings(TrainSettings, "TRAIN", str(config), None)
    monkeypatch.setenv("OTEL_SPANRL_TRAIN_GROUP_SIZE", "1")
    with pytest.raises(SettingError, match="group_size"):
        load_settings(TrainSettings, "TRAIN", str(config), None)


def test_runner_needs_exactly_one_way_to_run_the_agent(monkeypatch):
    with pytest.raises(SettingError, match="exactly one"):
        RunnerSettings()
    with pytest.raises(SettingError, match="module:function"):
        RunnerSettings(agent="not_a_callable_spec")
    args = _parse(RunnerSettings, "RUN", ["--command", '["python", "a.py"]', "--concurrency", "3"])
    settings = load_settings(RunnerSettings, "RUN", None, args)
    assert settings.command == ["python", "a.py"] and settings.concurrency == 3


def test_a_new_run_refuses_an_output_dir_holding_an_old_run(tmp_path):
    from spanrl.trainer_bridge.session import prepare_output

    out = tmp_path / "run"
    out.mkdir()
    settings = TrainSettings(tasks="t.jsonl", model="m", output_dir=str(out))
    (out / "checkpoints").mkdir()
    prepare_output(settings)  # an empty checkpoints folder: fine
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(UserError, match="--resume"):
        prepare_output(settings)
    settings.resume = True
    prepare_output(settings)  # resuming continues it


def test_resume_drops_metrics_rows_after_the_checkpoint(tmp_path):
    from spanrl.trainer_bridge.metrics import MetricsLog

    log = MetricsLog(str(tmp_path))
    for version in (1, 2, 3, 4):
        log.append({"step": version, "reward_mean": 0.5, "policy_version": version})
    log.keep_up_to_version(2)
    assert [r["step"] for r in MetricsLog(str(tmp_path)).rows] == [1, 2]
