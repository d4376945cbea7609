"""``algorithm: apo`` through real processes: ``spanrl receive``, ``spanrl train`` (embedded torch
backend, weights frozen during the search), ``spanrl run`` with the reply-format agent (the
instructions decide its reward), and ``spanrl serve`` as the optimizer model behind a token.

The model is created here and warm-started on demonstrations where the system prompt decides the
reply's format (``examples/reply_format``): it follows "square brackets" when told, and its
agent's own prompt names no format. Checked: the search picks the candidate of a user-given pool
that the reward favours; every rollout of the search was served its assigned candidate (the
endpoint's spans say which); the optimizer (a tiny local model, whose answers cannot be used) gets
its edits dropped with a logged reason, and the search goes on; the best prompt is saved as
``prompts.yaml`` and served afterwards (the GRPO step of ``apo.then_grpo`` runs under it); the
optimizer's key is never in a log or a stored span.
"""

from __future__ import annotations

import json

import pytest
import yaml

from spanrl.child_processes import free_port
from spanrl.examples.reply_format.demonstrations import STYLES, write_tasks

from .apo_support import (
    AGENT,
    BRACKETS,
    KEY,
    REWARD,
    TEST_DEVICE,
    SpanrlProcesses,
    format_model,
    run_story,
    served_candidates,
    wait_for_text,
)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return format_model(tmp_path_factory.mktemp("format-model"))


@pytest.mark.timeout(900)
def test_apo_picks_the_pools_best_drops_unusable_edits_serves_and_saves_the_best(tmp_path, model):
    tasks, val_tasks = write_tasks(str(tmp_path / "tasks.jsonl"), str(tmp_path / "val.jsonl"))
    pool = tmp_path / "prompts.yaml"
    names = dict(zip(("brackets", "quotes", "plain"), STYLES, strict=True))
    pool.write_text(yaml.safe_dump({"policy": {"active": "original", "candidates": {
        "original": "Reply to the user.", "quotes": names["quotes"], "brackets": names["brackets"]}}}))
    db, run_dir = tmp_path / "spanrl.db", tmp_path / "run"
    grpc_port, bridge_port, optimizer_port = free_port(), free_port(), free_port()
    config = tmp_path / "train.yaml"
    config.write_text(json.dumps({
        "algorithm": "apo", "tasks": tasks, "val_tasks": val_tasks, "val_attempts": 1, "val_temperature": 0,
        "model": model, "output_dir": str(run_dir), "store": str(db), "reward": REWARD, "device": TEST_DEVICE,
        "policy_port": 0, "bridge_port": bridge_port, "rollout_timeout_s": 60, "checkpoint_every": 0,
        "group_size": 2, "tasks_per_step": 2, "steps": 1,
        "apo": {"prompts": str(pool), "rounds": 1, "beam_width": 1, "branch_factor": 2, "batch_tasks": 8,
                "gradient_batch": 2, "optimizer_url": f"http://127.0.0.1:{optimizer_port}/v1",
                "optimizer_model": "optimizer", "optimizer_key_env": "APO_TEST_OPTIMIZER_KEY",
                "optimizer_max_tokens": 24, "then_grpo": True},
    }))  # JSON is YAML
    spanrl = SpanrlProcesses(tmp_path)
    start, logs = spanrl.start, spanrl.logs

    try:
        receiver = start("receiver", "receive", "--db", str(db), "--grpc-port", str(grpc_port), "--http-port", "0",
                         "--grace-s", "2")  # the endpoint's span of the last call must arrive in time
        wait_for_text(logs["receiver"], "spanrl receive: ready", receiver, 60)
        optimizer = start("optimizer", "serve", model, "--port", str(optimizer_port), "--device", TEST_DEVICE,
                          "--served-model-name", "optimizer", env={"OTEL_SPANRL_SERVE_TOKEN": KEY})
        wait_for_text(logs["optimizer"], f"127.0.0.1:{optimizer_port}", optimizer, 120)
        train = start("train", "train", str(config), env={
            "APO_TEST_OPTIMIZER_KEY": KEY, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{grpc_port}"})
        start("runner", "run", "--agent", AGENT, "--bridge-url", f"http://127.0.0.1:{bridge_port}",
              "--otlp-endpoint", f"http://127.0.0.1:{grpc_port}", "--concurrency", "8", "--bridge-wait-s", "300")
        assert train.wait(600) == 0, logs["train"].read_text()[-4000:]
    finally:
        spanrl.stop_all()

    said = logs["train"].read_text()
    record = json.loads((run_dir / "apo.json").read_text())[0]
    candidates = {c["name"]: c for c in record["candidates"]}
    # round 0 scored the whole pool on the same tasks; the reward's format won
    assert set(candidates) == {"original", "quotes", "brackets"}, candidates
    round0 = {name: c["scores"][0] for name, c in candidates.items()}
    assert round0["brackets"] > max(round0["original"], round0["quotes"]), round0
    assert record["best"] == "brackets" and candidates["brackets"]["held_out"] >= 0.7, record
    # the optimizer's answers (a tiny model's) were unusable: each dropped, with its reason logged
    assert len(record["dropped"]) == 2, record["dropped"]
    for reason in record["dropped"]:
        assert "no <prompt>...</prompt> block" in reason or "empty" in reason or "cut at 24 tokens" in reason, reason
        assert f"an edit of brackets was dropped: {reason}" in said
    assert "apo: policy round 1/1: 1 candidates (+0 new, 2 dropped)" in said, said[-3000:]

    # saved: the best, active, in the format of `spanrl prompts export`
    assert yaml.safe_load((run_dir / "prompts.yaml").read_text()) == {
        "policy": {"active": "brackets", "candidates": {"brackets": BRACKETS}}}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("apo/round") for r in rows] == [0, 1, None], rows
    assert rows[0]["apo/candidates"] == 3 and rows[0]["rollout/count"] == 3 * 8 + 1 * 10, rows[0]
    assert rows[1]["apo/dropped"] == 2 and rows[0]["val/reward"] == candidates["brackets"]["held_out"]
    assert rows[2]["step"] == 3 and rows[2]["actor/policy_version"] == 1  # then GRPO: one update
    assert rows[0]["actor/policy_version"] == rows[1]["actor/policy_version"] == 0  # frozen during the search

    # each rollout of the search got its candidate; afterwards (the GRPO step) the best was served
    served = served_candidates(str(db))
    grpo = [served[rid] for rid in served if rid.startswith("s2-")]  # the step after the search's 2 rows
    search_ids = {rid for rid in served if not rid.startswith("s2-")}
    assert len(search_ids) == 3 * 8 + 10 + 8, sorted(served)[:5]  # round 0 (+ validation), round 1
    assert all(len(served[rid]) == 1 for rid in search_ids)
    assert {c for rid in search_ids if rid.startswith("v") for c in served[rid]} == {"brackets"}
    assert len(grpo) == 4 and all(c == {"brackets"} for c in grpo), grpo

    # the optimizer's key: sent (no 401 among the reasons) but never logged or stored
    assert not any("401" in reason for reason in record["dropped"])
    for log in logs.values():
        assert KEY not in log.read_text(), log
    for path in tmp_path.glob("spanrl.db*"):
        assert KEY.encode() not in path.read_bytes(), path


@pytest.mark.timeout(900)
def test_apo_on_an_endpoint_spanrl_does_not_train_through_spanrl_proxy(tmp_path, model):
    """``backend: endpoint``: the agents call ``spanrl proxy`` in front of a model spanrl does not
    train (here a ``spanrl serve``, standing in for a hosted API); ``spanrl train`` starts no
    backend, sets the proxy's prompt candidates per rollout, and leaves the best one active there."""
    import httpx

    tasks, val_tasks = write_tasks(str(tmp_path / "tasks.jsonl"), str(tmp_path / "val.jsonl"))
    pool = tmp_path / "prompts.yaml"
    pool.write_text(yaml.safe_dump({"policy": {"active": "original", "candidates": {
        "original": "Reply to the user.", "brackets": BRACKETS}}}))
    db, run_dir = tmp_path / "spanrl.db", tmp_path / "run"
    grpc_port, bridge_port, upstream_port, proxy_port = free_port(), free_port(), free_port(), free_port()
    token, proxy_url = "proxy-token-5e2a", f"http://127.0.0.1:{proxy_port}/v1"
    config = tmp_path / "train.yaml"
    config.write_text(json.dumps({
        "algorithm": "apo", "backend": "endpoint", "endpoint_url": proxy_url, "policy_token": token,
        "tasks": tasks, "val_tasks": val_tasks, "val_attempts": 1, "output_dir": str(run_dir), "store": str(db),
        "reward": REWARD, "bridge_port": bridge_port, "rollout_timeout_s": 60, "group_size": 2,
        "apo": {"prompts": str(pool), "rounds": 0, "batch_tasks": 8},
    }))
    spanrl = SpanrlProcesses(tmp_path)
    start, logs = spanrl.start, spanrl.logs

    try:
        receiver = start("receiver", "receive", "--db", str(db), "--grpc-port", str(grpc_port), "--http-port", "0")
        wait_for_text(logs["receiver"], "spanrl receive: ready", receiver, 60)
        upstream = start("upstream", "serve", model, "--port", str(upstream_port), "--device", TEST_DEVICE,
                         "--served-model-name", "policy", "--spans-endpoint", "off")
        wait_for_text(logs["upstream"], f"127.0.0.1:{upstream_port}", upstream, 120)
        proxy = start("proxy", "proxy", "--upstream", f"http://127.0.0.1:{upstream_port}/v1", "--port",
                      str(proxy_port), "--token", token, "--spans-endpoint", f"http://127.0.0.1:{grpc_port}")
        wait_for_text(logs["proxy"], str(proxy_port), proxy, 60)
        train = start("train", "train", str(config))
        start("runner", "run", "--agent", AGENT, "--bridge-url", f"http://127.0.0.1:{bridge_port}",
              "--otlp-endpoint", f"http://127.0.0.1:{grpc_port}", "--concurrency", "8", "--bridge-wait-s", "300",
              "--policy-token", token)
        assert train.wait(600) == 0, logs["train"].read_text()[-4000:]
        # the proxy serves the best candidate from now on
        shown = httpx.get(f"http://127.0.0.1:{proxy_port}/spanrl/v1/prompts",
                          headers={"Authorization": f"Bearer {token}"}).json()
        upstream_models = httpx.get(f"http://127.0.0.1:{upstream_port}/v1/models").json()
    finally:
        spanrl.stop_all()

    record = json.loads((run_dir / "apo.json").read_text())[0]
    scores = {c["name"]: c["scores"][0] for c in record["candidates"]}
    assert record["best"] == "brackets" and scores["brackets"] > scores["original"], f"{record}\n{run_story(logs)}"
    assert yaml.safe_load((run_dir / "prompts.yaml").read_text()) == {
        "policy": {"active": "brackets", "candidates": {"brackets": BRACKETS}}}
    assert shown["resources"]["policy"]["active"] == "brackets", shown
    # every search rollout went through the proxy with its assigned candidate (the proxy's spans)
    served = served_candidates(str(db))
    # round 0: both candidates on the same 8 tasks; each then scored once on the 10 held-out tasks
    assert len(served) == 2 * 8 + 2 * 10 and all(len(c) == 1 for c in served.values()), served
    held_out = [c for rid, cs in served.items() if rid.startswith("v") for c in cs]
    assert sorted(held_out) == ["brackets"] * 10 + ["original"] * 10, held_out
    # nothing was trained: no checkpoint, the upstream's weights never changed
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())
    assert upstream_models["data"][0].get("policy_version", 0) == 0, upstream_models
