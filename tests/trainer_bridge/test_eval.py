"""``spanrl eval`` through real processes, and its numbers.

A tiny calculator model is created here (no training), served by the embedded backend
(``--model``) and then by ``spanrl serve`` (``--endpoint``); ``spanrl receive`` and ``spanrl run``
with the calculator agent run as for training. The reward (a module beside the config) rewards
even-numbered tasks 1 and the others 0.25, so with ``success_threshold`` 0.5 the expected greedy
accuracy and pass@k are known. Checked: the JSON summary has a result per task; greedy accuracy is
the fraction of tasks whose greedy reward reached the threshold; pass@k agrees with the estimator
on each task's counts; the rounds' rollouts are in the store under their own ids; bad input (a
missing task file, both or neither of --model/--endpoint) is one clear line. ``pass_at_k`` is
checked against counting every draw.
"""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys

import pytest

from spanrl.child_processes import free_port
from spanrl.demo import CALC_AGENT
from spanrl.trainer_bridge.pass_at_k import pass_at_k

from .apo_support import REPO, TEST_DEVICE, SpanrlProcesses, wait_for_text

TASKS = 6
REWARD_MODULE = '''
def reward(task, variables):
    return 1.0 if int(task["id"].split("-")[1]) % 2 == 0 else 0.25
'''


@pytest.mark.parametrize(("n", "c", "k"), [(1, 0, 1), (1, 1, 1), (5, 2, 1), (5, 2, 3), (6, 3, 4), (4, 4, 2),
                                           (10, 1, 10), (7, 0, 3)])
def test_pass_at_k_is_the_chance_that_k_draws_hold_a_success(n, c, k):
    draws = list(itertools.combinations([True] * c + [False] * (n - c), k))
    assert pass_at_k(n, c, k) == pytest.approx(sum(any(d) for d in draws) / len(draws))
    assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))


def test_pass_at_k_refuses_impossible_counts():
    for n, c, k in ((3, 4, 1), (3, 1, 4), (3, 1, 0)):
        with pytest.raises(ValueError, match="pass@k needs"):
            pass_at_k(n, c, k)


def write_config(tmp_path, bridge_port: int, **extra) -> tuple:
    from spanrl.examples.calc_agent.tasks import make_tasks

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({**t, "id": f"t-{n}"}) + "\n"
                             for n, t in enumerate(make_tasks(TASKS, seed=3))))
    (tmp_path / "eval_reward.py").write_text(REWARD_MODULE)
    config = tmp_path / "train.yaml"
    config.write_text(json.dumps({
        "tasks": str(tmp_path / "no-such-training-tasks.jsonl"), "model": str(tmp_path / "not-this-model"),
        "output_dir": str(tmp_path / "run"), "store": str(tmp_path / "spanrl.db"), "reward": "eval_reward:reward",
        "policy_port": 0, "bridge_port": bridge_port, "device": TEST_DEVICE, "rollout_timeout_s": 60, **extra}))
    return config, tasks


def eval_cli(*argv: str, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spanrl", "eval", *argv], capture_output=True, text=True,
                          cwd=cwd, timeout=120)


def test_bad_input_is_one_clear_line(tmp_path):
    config, tasks = write_config(tmp_path, free_port())
    neither = eval_cli(str(config), "--tasks", str(tasks))
    assert neither.returncode == 2 and "needs exactly one of --model DIR" in neither.stderr
    assert "got neither" in neither.stderr
    both = eval_cli(str(config), "--tasks", str(tasks), "--model", str(tmp_path), "--endpoint", "http://127.0.0.1:9/v1")
    assert both.returncode == 2 and "got --model and --endpoint" in both.stderr, both.stderr
    missing = eval_cli(str(config), "--tasks", str(tmp_path / "missing.jsonl"), "--endpoint", "http://127.0.0.1:9/v1")
    assert missing.returncode == 2, missing.stderr
    assert f"task file not found: {tmp_path / 'missing.jsonl'}" in missing.stderr
    no_model = eval_cli(str(config), "--tasks", str(tasks), "--model", str(tmp_path / "nothing-here"))
    assert no_model.returncode == 2 and "nothing-here" in no_model.stderr, no_model.stderr
    few = eval_cli(str(config), "--tasks", str(tasks), "--model", str(tmp_path), "--k", "3", "--samples", "2")
    assert few.returncode == 2 and "samples (2) must be at least k (3)" in few.stderr, few.stderr


def tiny_calc_model(root) -> str:
    from spanrl.examples.calc_agent.demonstrations import write_demonstrations
    from spanrl.trainer_bridge.torch_backend.model_init import create_model_dir

    corpus = root / "demonstrations.jsonl"
    write_demonstrations(str(corpus), count=300, seed=0)
    return str(create_model_dir(root / "model", preset="tiny", corpus_files=[str(corpus)], seed=0))


def check_summary(path, target: str, k: int, samples: int) -> dict:
    summary = json.loads(path.read_text())
    assert summary["target"] == target and summary["k"] == k and summary["samples_per_task"] == samples
    results = summary["results"]
    assert [r["task_id"] for r in results] == [f"t-{n}" for n in range(TASKS)]
    threshold = summary["success_threshold"]
    assert threshold == 0.5
    for r in results:
        assert r["greedy_left_out"] is None and r["samples_left_out"] == {}, r  # every rollout was scored
        even = int(r["task_id"].split("-")[1]) % 2 == 0
        assert r["greedy_score"] == (1.0 if even else 0.25) and r["greedy_success"] == even, r
        assert r["samples"] == samples and len(r["sample_scores"]) == samples, r
        assert r["successes"] == sum(s >= threshold for s in r["sample_scores"]), r
        assert r["pass_at_k"] == pytest.approx(pass_at_k(samples, r["successes"], k)), r
    # greedy accuracy: the fraction of tasks whose greedy reward reached the threshold
    assert summary["greedy_accuracy"] == pytest.approx(
        sum(r["greedy_score"] >= threshold for r in results) / TASKS) == pytest.approx(0.5)
    assert summary["pass_at_k"] == pytest.approx(sum(r["pass_at_k"] for r in results) / TASKS) == pytest.approx(0.5)
    return summary


@pytest.mark.timeout(600)
def test_eval_scores_a_model_and_a_serving_endpoint_end_to_end(tmp_path):
    from spanrl.otlp_receiver.store import SpanStore

    model = tiny_calc_model(tmp_path)
    grpc_port, bridge_port, serve_port = free_port(), free_port(), free_port()
    config, tasks = write_config(tmp_path, bridge_port)
    spanrl = SpanrlProcesses(tmp_path)
    start, logs = spanrl.start, spanrl.logs

    def runner(name: str) -> None:
        start(name, "run", "--agent", CALC_AGENT, "--bridge-url", f"http://127.0.0.1:{bridge_port}",
              "--otlp-endpoint", f"http://127.0.0.1:{grpc_port}", "--concurrency", "6", "--bridge-wait-s", "120")

    try:
        receiver = start("receiver", "receive", "--db", str(tmp_path / "spanrl.db"), "--grpc-port", str(grpc_port),
                         "--http-port", "0", "--grace-s", "0.3")
        wait_for_text(logs["receiver"], "spanrl receive: ready", receiver, 60)
        evaluation = start("eval-model", "eval", str(config), "--model", model, "--tasks", str(tasks), "--k", "2",
                           "--samples", "3", "--out", str(tmp_path / "model.json"), "--success-threshold", "0.5")
        runner("runner-model")
        assert evaluation.wait(300) == 0, logs["eval-model"].read_text()[-3000:]
        serve = start("serve", "serve", model, "--port", str(serve_port), "--device", TEST_DEVICE,
                      "--served-model-name", "policy")
        wait_for_text(logs["serve"], f"127.0.0.1:{serve_port}", serve, 120)
        endpoint = f"http://127.0.0.1:{serve_port}/v1"
        evaluation = start("eval-endpoint", "eval", str(config), "--endpoint", endpoint, "--tasks", str(tasks),
                           "--k", "1", "--samples", "2", "--out", str(tmp_path / "endpoint.json"),
                           "--success-threshold", "0.5")
        runner("runner-endpoint")
        assert evaluation.wait(300) == 0, logs["eval-endpoint"].read_text()[-3000:]
    finally:
        spanrl.stop_all()

    check_summary(tmp_path / "model.json", model, k=2, samples=3)
    check_summary(tmp_path / "endpoint.json", endpoint, k=1, samples=2)
    said = logs["eval-model"].read_text()
    assert "greedy accuracy 0.500   pass@2 0.500 (3 samples per task)" in said, said[-2000:]
    assert f"summary: {tmp_path / 'model.json'}" in said

    # the greedy round under validation ids, the sampled one under eval ids: held out from training
    with SpanStore(str(tmp_path / "spanrl.db")) as store:
        ids = [r.rollout_id for r in store.completed_rollouts(since=0)[0]]
    assert sum(i.startswith("v0-t-") for i in ids) == 2 * TASKS, ids
    assert sum(i.startswith("e1-t-") for i in ids) == TASKS * (3 + 2), ids
