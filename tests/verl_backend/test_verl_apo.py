"""``algorithm: apo`` on the verl backend, for real on CPU: vLLM serves the agents behind the verl
gateway, which gives each rollout of the search its assigned prompt candidate; verl's workers
hold the weights frozen during the search, and ``apo.then_grpo`` then takes one verl update
under the best candidate. The search here selects from a user-given pool (no optimizer model).
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import yaml

from spanrl.child_processes import free_port
from spanrl.examples.reply_format.demonstrations import STYLES, write_tasks
from spanrl.otlp_receiver.store import SpanStore
from spanrl.schema.metrics import read_metrics

from ..trainer_bridge.apo_support import (
    AGENT,
    BRACKETS,
    REWARD,
    SpanrlProcesses,
    format_model,
    run_story,
    served_candidates,
    wait_for_text,
)


@pytest.mark.timeout(1500)
def test_apo_on_verl_selects_from_the_pool_then_one_grpo_update_under_the_best(tmp_path):
    (tmp_path / "format-model").mkdir()
    model = format_model(tmp_path / "format-model")
    tasks, val_tasks = write_tasks(str(tmp_path / "tasks.jsonl"), str(tmp_path / "val.jsonl"))
    pool = tmp_path / "prompts.yaml"
    styles = dict(zip(("brackets", "quotes", "plain"), STYLES, strict=True))
    pool.write_text(yaml.safe_dump({"policy": {"active": "original", "candidates": {
        "original": "Reply to the user.", "quotes": styles["quotes"], "brackets": styles["brackets"]}}}))
    db, run_dir = tmp_path / "spanrl.db", tmp_path / "run"
    grpc_port, bridge_port, policy_port = free_port(), free_port(), free_port()
    config = tmp_path / "train.yaml"
    config.write_text(json.dumps({
        "algorithm": "apo", "backend": "verl", "tasks": tasks, "val_tasks": val_tasks, "val_attempts": 1,
        "val_temperature": 0, "model": model, "output_dir": str(run_dir), "store": str(db), "reward": REWARD,
        "bridge_port": bridge_port, "policy_port": policy_port, "rollout_timeout_s": 120, "checkpoint_every": 0,
        "group_size": 2, "tasks_per_step": 2, "steps": 1,
        "apo": {"prompts": str(pool), "rounds": 0, "batch_tasks": 8, "then_grpo": True},
    }))  # JSON is YAML
    spanrl = SpanrlProcesses(tmp_path)
    start, logs = spanrl.start, spanrl.logs
    try:
        receiver = start("receiver", "receive", "--db", str(db), "--grpc-port", str(grpc_port), "--http-port", "0",
                         "--grace-s", "2")
        wait_for_text(logs["receiver"], "spanrl receive: ready", receiver, 60)
        train = start("train", "train", str(config), env={"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{grpc_port}"})
        # verl's workers and vLLM take minutes to start before the bridge is up
        start("runner", "run", "--agent", AGENT, "--bridge-url", f"http://127.0.0.1:{bridge_port}",
              "--otlp-endpoint", f"http://127.0.0.1:{grpc_port}", "--concurrency", "8", "--bridge-wait-s", "1200")
        assert train.wait(1300) == 0, logs["train"].read_text()[-4000:]
    finally:
        spanrl.stop_all()

    # what the run did, for any assertion below that fails (a message string, which pytest does not
    # shorten): the trainer's and runner's own account, and each round's metrics row (its rollouts
    # left out, by reason)
    rows = read_metrics(run_dir)
    story = f"{run_story(logs)}\nmetrics rows: {rows}"

    # the gateway's spans: each rollout was served one candidate: round 0 the whole pool on the same
    # 8 tasks, the held-out round the best and the starting prompt on 10 tasks each, and the GRPO
    # step's 4 rollouts the best (the counts tell: 8 + 4 of "brackets")
    served = served_candidates(str(db))
    assert all(len(candidates) == 1 for candidates in served.values()), f"{served}\n{story}"
    counts = Counter((rid[0], next(iter(candidates))) for rid, candidates in served.items())
    assert counts == {("s", "original"): 8, ("s", "quotes"): 8, ("s", "brackets"): 8 + 4,
                      ("v", "brackets"): 10, ("v", "original"): 10}, f"{counts}\n{story}"

    record = json.loads((run_dir / "apo.json").read_text())[0]
    scores = {c["name"]: c["scores"][0] for c in record["candidates"]}
    assert set(scores) == {"original", "quotes", "brackets"}, f"{record}\n{story}"
    assert record["best"] == "brackets" and scores["brackets"] > max(scores["original"], scores["quotes"]), \
        f"{record}\n{story}"
    assert yaml.safe_load((run_dir / "prompts.yaml").read_text()) == {
        "policy": {"active": "brackets", "candidates": {"brackets": BRACKETS}}}

    assert [r.get("apo/round") for r in rows] == [0, None], rows
    assert rows[0]["actor/policy_version"] == 0  # frozen during the search
    assert rows[1]["actor/policy_version"] == 1 and rows[1]["actor/update_s"] > 0  # then one verl update

    store = SpanStore(str(db))
    rollouts, _ = store.completed_rollouts(since=0)
    store.close()
    for rollout in rollouts:
        for transition in rollout.transitions:
            assert transition.response_token_ids and not transition.retokenized
