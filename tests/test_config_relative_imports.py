"""Module paths in config files: the config file's folder is importable, and ``python_path``
entries written in the file are relative to it, whatever the working directory."""

from __future__ import annotations

import subprocess
import sys

import pytest

from spanrl import cli
from spanrl.errors import UserError
from spanrl.import_path import load_callable


def _project(tmp_path, name: str):
    project = tmp_path / "project"
    (project / "lib").mkdir(parents=True)
    (project / f"{name}_reward.py").write_text("def score(task, variables):\n    return 0.5\n")
    (project / "lib" / f"{name}_agent.py").write_text("def solve(task):\n    return 'answer'\n")
    return project


def test_reward_and_agent_beside_the_config_file_load_from_another_directory(tmp_path, monkeypatch):
    project = _project(tmp_path, "relcfg")
    (project / "train.yaml").write_text("tasks: tasks.jsonl\nmodel: m\nreward: relcfg_reward:score\n")
    (project / "run.yaml").write_text("agent: relcfg_agent:solve\npython_path: [lib]\n")
    monkeypatch.chdir(tmp_path)  # not the project folder
    monkeypatch.setattr(sys, "path", list(sys.path))
    train = cli.settings_from_args(["train", str(project / "train.yaml")])
    assert train.python_path == [str(project)]
    assert load_callable(train.reward, train.python_path)({}, {}) == 0.5
    run = cli.settings_from_args(["run", "project/run.yaml"])
    assert run.python_path == [str(project / "lib"), str(project)]
    assert load_callable(run.agent, run.python_path)({}) == "answer"


def test_python_path_flags_stay_relative_to_the_working_directory(tmp_path, monkeypatch):
    project = _project(tmp_path, "relflag")
    (project / "run.yaml").write_text("agent: relflag_agent:solve\n")
    monkeypatch.chdir(project)
    run = cli.settings_from_args(["run", "run.yaml", "--python-path", "lib"])
    assert run.python_path == ["lib", str(project)]


def test_a_module_not_found_names_where_it_was_searched(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(UserError, match=r"cannot import module 'no_such_reward_mod'.*searched .*python_path"):
        load_callable("no_such_reward_mod:score", [str(tmp_path / "x")])


def test_the_working_directory_is_importable_from_the_console_script(tmp_path):
    (tmp_path / "cwd_agent_mod.py").write_text("def solve(task):\n    return 'x'\n")
    probe = ("import sys; sys.path.remove('') if '' in sys.path else None; "
             "from spanrl.import_path import load_callable; print(load_callable('cwd_agent_mod:solve')({}))")
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "x"
