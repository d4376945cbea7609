"""Warm start (``spanrl sft`` and the ``warm_start:`` block of ``spanrl train``): where the examples
come from (a chat JSONL file, the best rollouts of a real SQLite store), what is written (a new
model directory or the model in place), and the one-line errors of the command."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from spanrl import cli
from spanrl.errors import SettingError, UserError
from spanrl.otlp_receiver.store import SpanStore
from spanrl.schema.rollouts import AssembledRollout, Transition
from spanrl.trainer_bridge.backend import TokenExample
from spanrl.trainer_bridge.session import warm_start_before_training
from spanrl.trainer_bridge.train_settings import TrainSettings
from spanrl.trainer_bridge.warm_start import RECORD_FILE, WarmStartConfig, choose_rollouts

from .conftest import TEST_DEVICE


def _rollout(number: int, reward: float | None, status: str = "ok", output: str = "") -> AssembledRollout:
    transition = Transition(
        rollout_id=f"r{number}", index=0, span_id=f"s{number}", agent_name=None,
        prompt_token_ids=(10, 11, number), response_token_ids=(20 + number, 2), response_logprobs=None,
        choice_index=0, policy_version=0, reward=reward or 0.0, return_=reward or 0.0, retokenized=False)
    return AssembledRollout(rollout_id=f"r{number}", task_id=f"t{number}", attempt=0, status=status, error=None,
                   end_reason="rollout_span", total_reward=reward, rewards=(), variables={"output": output},
                   transitions=(transition,), problems=(), sequence=0)


@pytest.fixture
def store_path(tmp_path):
    path = tmp_path / "spanrl.db"
    with SpanStore(path) as store:
        for number, reward, status, output in ((1, 1.0, "ok", "7"), (2, 0.5, "ok", "8"), (3, 0.0, "ok", "9"),
                                               (4, None, "ok", "7"), (5, 3.0, "failed", "7")):
            store.save_assembled(_rollout(number, reward, status, output))
    return path


def test_the_best_rewarded_ok_rollouts_of_a_store_are_chosen(store_path):
    chosen = choose_rollouts(WarmStartConfig(store=str(store_path), top_k=2))
    assert chosen.examples == [TokenExample((10, 11, 1), (21, 2)), TokenExample((10, 11, 2), (22, 2))]
    assert (chosen.rollouts, chosen.scored, chosen.best, chosen.worst_chosen) == (2, 3, 1.0, 0.5)
    by_threshold = choose_rollouts(WarmStartConfig(store=str(store_path), min_reward=0.5))
    assert by_threshold.examples == chosen.examples
    everything = choose_rollouts(WarmStartConfig(store=str(store_path)))  # the failed one never
    assert [e.prompt_token_ids[2] for e in everything.examples] == [1, 2, 3]
    with pytest.raises(UserError, match=r"no rollout of .* 3 of 5 rollouts have a score \(events\); the best "
                                        r"scored 1, min_reward is 2"):
        choose_rollouts(WarmStartConfig(store=str(store_path), min_reward=2.0))


def test_a_reward_function_scores_the_stored_rollouts_with_their_tasks(store_path, tmp_path):
    (tmp_path / "wsreward.py").write_text("def score(task, variables):\n"
                                          "    return float(variables['output'] == str(task['answer']))\n")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"t{n}", "answer": 8}) + "\n" for n in range(1, 6)))
    chosen = choose_rollouts(WarmStartConfig(store=str(store_path), reward="wsreward:score", tasks=str(tasks),
                                             python_path=[str(tmp_path)], min_reward=1.0))
    assert [e.prompt_token_ids[2] for e in chosen.examples] == [2]  # output "8": rollout 2 only
    assert chosen.scored == 4  # the reward function scores rollout 4 too (no reward events)
    with pytest.raises(SettingError, match="give tasks"):
        WarmStartConfig(store=str(store_path), reward="wsreward:score")


def test_sft_from_a_store_writes_a_new_model_directory(tiny_model_dir, store_path, tmp_path):
    out = tmp_path / "warm"
    code = cli.main(["sft", str(tiny_model_dir), "--store", str(store_path), "--top-k", "2", "--output", str(out),
                     "--steps", "3", "--batch-size", "2", "--device", TEST_DEVICE, "--no-progress"])
    assert code == 0
    record = json.loads((out / RECORD_FILE).read_text())
    assert record["steps"] == 3 and record["store"]["rollouts"] == 2 and record["store"]["best_reward"] == 1.0
    assert sorted(p.name for p in out.iterdir() if p.name in ("optimizer.pt", "trainer_state.json")) == []
    before = load_file(str(tiny_model_dir / "model.safetensors"))
    after = load_file(str(out / "model.safetensors"))
    assert any(not (before[name] == after[name]).all() for name in before)


def test_sft_in_place_replaces_the_model(tiny_model_dir, calc_corpus, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    before = load_file(str(model / "model.safetensors"))
    code = cli.main(["sft", str(model), "--demonstrations", str(calc_corpus), "--in-place", "--steps", "2",
                     "--batch-size", "2", "--device", TEST_DEVICE, "--no-progress"])
    assert code == 0
    after = load_file(str(model / "model.safetensors"))
    assert any(not (before[name] == after[name]).all() for name in before)
    assert (model / "config.json").is_file() and (model / "tokenizer.json").is_file()
    assert json.loads((model / RECORD_FILE).read_text())["demonstrations"]["examples"] == 300


@pytest.mark.parametrize("args, message", [
    (["m", "--demonstrations", "d.jsonl"], "spanrl sft: say where the fine-tuned model goes: --output NEW_DIR, or "
                                           "--in-place to overwrite m"),
    (["m", "--output", "o"], "spanrl sft: nothing to learn from: give --demonstrations FILE (chat JSONL) and/or "
                             "--store FILE (a receiver store; --top-k / --min-reward pick its best rollouts)"),
    (["m", "--demonstrations", "d.jsonl", "--top-k", "3", "--output", "o"],
     "spanrl sft: top_k and min_reward choose rollouts of a store: give store (the receiver's SQLite file)"),
    (["m", "--demonstrations", "d.jsonl", "--output", "o"], "spanrl sft: model 'm' is not a Hugging Face model "
     "directory (no config.json); create one with `spanrl model init DIR`"),
    (["model", "--demonstrations", "missing.jsonl", "--output", "o"],
     "spanrl sft: demonstrations file not found: missing.jsonl"),
    (["model", "--demonstrations", "d.jsonl", "--output", "full"],
     "spanrl sft: --output full is not empty: choose a new directory, or pass --force to replace it"),
])
def test_sft_mistakes_are_one_line_and_exit_2(args, message, tmp_path, tiny_model_dir):
    shutil.copytree(tiny_model_dir, tmp_path / "model")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    (tmp_path / "d.jsonl").write_text('{"messages": [{"role": "assistant", "content": "hi"}]}\n')
    result = subprocess.run([sys.executable, "-m", "spanrl", "sft", *args], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == message


def test_train_runs_the_warm_start_block_once(tiny_model_dir, calc_corpus, tmp_path):
    config = tmp_path / "train.yaml"
    config.write_text(f"tasks: t.jsonl\nmodel: {tiny_model_dir}\noutput_dir: {tmp_path / 'run'}\ndevice: cpu\n"
                      f"warm_start:\n  demonstrations: {calc_corpus}\n  steps: 2\n  batch_size: 2\n")
    settings = cli.settings_from_args(["train", str(config)])
    assert settings.warm_start.steps == 2 and settings.warm_start.device == "cpu"
    warmed = warm_start_before_training(settings, progress=False)
    out = tmp_path / "run" / "warm-start"
    assert warmed.model == str(out) and (out / "config.json").is_file()
    assert json.loads((out / RECORD_FILE).read_text())["steps"] == 2
    # resuming: the finished warm start is used as it is, not redone
    stamp = (out / RECORD_FILE).stat().st_mtime_ns
    resumed = warm_start_before_training(cli.settings_from_args(["train", str(config), "--resume"]), progress=False)
    assert resumed.model == str(out) and (out / RECORD_FILE).stat().st_mtime_ns == stamp
    # without the block nothing happens
    plain = TrainSettings(tasks="t.jsonl", model=str(tiny_model_dir), output_dir=str(tmp_path / "run2"))
    assert warm_start_before_training(plain) is plain


def test_the_warm_start_block_takes_reward_and_tasks_from_the_top_level(tmp_path):
    config = tmp_path / "train.yaml"
    config.write_text("tasks: t.jsonl\nmodel: m\nreward: mod:fn\nwarm_start:\n  store: old.db\n  top_k: 5\n")
    settings = cli.settings_from_args(["train", str(config)])
    assert (settings.warm_start.reward, settings.warm_start.tasks, settings.warm_start.top_k) == ("mod:fn", "t.jsonl",
                                                                                                    5)
    config.write_text("tasks: t.jsonl\nmodel: m\nwarm_start:\n  reward: mod:fn\n")
    with pytest.raises(SettingError, match="warm_start.reward is set by the top-level key 'reward'"):
        cli.settings_from_args(["train", str(config)])


def test_init_scaffolds_a_project_and_refuses_a_non_empty_folder(tmp_path):
    result = subprocess.run([sys.executable, "-m", "spanrl", "init", "proj"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    project = tmp_path / "proj"
    tasks = [json.loads(line) for line in (project / "tasks.jsonl").read_text().splitlines()]
    assert len(tasks) == 500 and {"id", "question", "answer"} <= set(tasks[0])
    demonstration = json.loads((project / "demonstrations.jsonl").read_text().splitlines()[0])
    assert demonstration["messages"][0]["role"] == "system"
    settings = cli.settings_from_args(["train", str(project / "train.yaml")])
    assert settings.reward == "reward:score" and str(project) in settings.python_path
    again = subprocess.run([sys.executable, "-m", "spanrl", "init", "proj"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=120)
    assert again.returncode == 2
    assert again.stderr.strip() == ("spanrl init: proj is not empty: choose a new folder, or pass --force to "
                                    "write into it")
    forced = subprocess.run([sys.executable, "-m", "spanrl", "init", "proj", "--force", "--seed", "1"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert forced.returncode == 0, forced.stderr
    assert [json.loads(line) for line in (project / "tasks.jsonl").read_text().splitlines()] != tasks
