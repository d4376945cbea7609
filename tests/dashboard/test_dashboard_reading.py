"""What the dashboard reads and how it answers bad input, over real HTTP (no browser).

Metrics in today's keys and in verl-style namespaced keys read the same; the rollouts list pages
and filters a store of many rollouts correctly; a store that is not spanrl's, a file that is not
SQLite, a missing store, a missing output folder and an empty run each give a page that says so
(never a traceback), bad filter values a 400 naming the field; the token is enforced; the
dashboard never writes to the store.
"""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
import subprocess
import sys

import httpx
import pytest

from spanrl.dashboard.run_metrics import read_metrics
from spanrl.dashboard.store_reader import RolloutFilter, open_store, rollout_page

from .synthetic_store import build_store

LEGACY_ROW = {"step": 1, "reward_mean": 0.5, "val_reward": 0.25, "loss": 0.1, "pg_loss": 0.09, "kl_loss": 0.01,
              "pg_clipfrac": 0.2, "rollouts_per_s": 3.0, "policy_version": 1,
              "rollouts_left_out": {"failed": 2, "no_reward": 1}}
# the same row as today's spanrl train writes it (spanrl.schema.metrics), with a spread
NAMESPACED_ROW = {"step": 1, "rollout/reward_mean": 0.5, "rollout/reward_std": 0.3, "val/reward": 0.25,
                  "actor/loss": 0.1, "actor/pg_loss": 0.09, "actor/kl_loss": 0.01, "actor/pg_clipfrac": 0.2,
                  "rollout/per_s": 3.0, "actor/policy_version": 1,
                  "rollout/left_out": {"failed": 2, "no_reward": 1}}


def write_metrics(folder, rows, tail: str = "") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)


def test_metrics_read_the_same_in_todays_keys_and_in_namespaced_keys(tmp_path):
    write_metrics(tmp_path / "old", [LEGACY_ROW])
    write_metrics(tmp_path / "new", [NAMESPACED_ROW])
    old, new = read_metrics(str(tmp_path / "old")).rows[0], read_metrics(str(tmp_path / "new")).rows[0]
    for name in ("reward_mean", "val_reward", "loss", "pg_loss", "kl_loss", "pg_clipfrac", "rollouts_per_s",
                 "policy_version"):
        assert old.get(name) == new.get(name) == pytest.approx(LEGACY_ROW[name]), name
    assert old.left_out == new.left_out == {"failed": 2, "no_reward": 1}
    assert new.get("reward_std") == 0.3 and old.get("reward_std") is None


def test_metrics_keep_good_rows_around_a_bad_line_and_a_line_being_written(tmp_path):
    rows = [dict(LEGACY_ROW, step=n, reward_mean=n / 10) for n in (1, 2, 3)]
    lines = [json.dumps(r) for r in rows]
    (tmp_path / "metrics.jsonl").write_text("\n".join([lines[0], "{not json", lines[1], lines[2], '{"step": 4, "rew']))
    metrics = read_metrics(str(tmp_path))
    assert [r.step for r in metrics.rows] == [1, 2, 3]
    assert [r.get("reward_mean") for r in metrics.rows] == [0.1, 0.2, 0.3]
    assert len(metrics.problems) == 1 and ":2: not JSON" in metrics.problems[0]  # the last line is not blamed


@pytest.fixture(scope="module")
def big_store(tmp_path_factory):
    path = tmp_path_factory.mktemp("store") / "spanrl.db"
    return path, build_store(path, 600, tasks_per_step=4, group_size=5)


def test_rollouts_pages_cover_every_rollout_once_newest_first(big_store):
    path, made = big_store
    seen = []
    with open_store(str(path)) as reader:
        page = 1
        while True:
            result = rollout_page(reader, RolloutFilter(), page, 50)
            seen.extend(r.rollout_id for r in result.rows)
            if not result.has_next:
                break
            page += 1
    assert seen == [r.rollout_id for r in reversed(made)]


def test_rollouts_filters_and_sorts_select_exactly_the_matching_rollouts(big_store):
    path, made = big_store
    with open_store(str(path)) as reader:
        def ids(**fields) -> list[str]:
            return [r.rollout_id for r in rollout_page(reader, RolloutFilter(**fields), 1, 1000).rows]

        assert set(ids(task="t2", step=3)) == {r.rollout_id for r in made if r.task_id == "t2"
                                                and r.rollout_id.startswith("s2-")}
        assert set(ids(status="failed")) == {r.rollout_id for r in made if r.status == "failed"}
        assert len(ids(status="failed")) > 0
        assert len(ids(agent="writer")) == len(made) and ids(agent="critic") == []
        low = {r.rollout_id for r in made if (r.total_reward or 0) >= 0.9}
        assert set(ids(reward_min=0.9)) == low
        rewards = [r.reward for r in rollout_page(reader, RolloutFilter(sort="reward_desc"), 1, 1000).rows]
        assert rewards == sorted(rewards, reverse=True)
        assert ids(kind="validation") == []


def test_bad_input_gets_a_page_that_says_what_is_wrong(serve, tmp_path):
    other = tmp_path / "other.db"
    db = sqlite3.connect(str(other))
    db.execute("CREATE TABLE customers (id INTEGER)")
    db.commit()
    db.close()
    text = tmp_path / "notes.txt"
    text.write_text("not a database at all " * 100)
    cases = [
        (dict(store=str(other), output_dir=str(tmp_path)), "/rollouts", "an SQLite file but not a spanrl span store"),
        (dict(store=str(text), output_dir=str(tmp_path)), "/rollouts", "is not a spanrl span store"),
        (dict(store=str(tmp_path / "none.db"), output_dir=str(tmp_path)), "/validation", "no span store at"),
        (dict(store=str(other), output_dir=str(tmp_path / "missing")), "/run", "no run output folder at"),
        (dict(store=str(other), output_dir=str(tmp_path)), "/run", "no step has finished yet"),
        (dict(store=str(other), output_dir=str(tmp_path)), "/compare", "not a spanrl span store"),
    ]
    for settings, path, said in cases:
        response = httpx.get(serve(**settings) + path)
        assert response.status_code == 200, (path, response.text[-2000:])
        assert said in response.text and "Traceback" not in response.text, (settings, path)
    assert other.read_bytes().startswith(b"SQLite format 3")  # left as it was: no table added
    assert {t for t, in sqlite3.connect(str(other)).execute("SELECT name FROM sqlite_master")} == {"customers"}


def test_bad_filter_values_and_unknown_rollouts_are_answered_with_their_reason(serve, big_store, tmp_path):
    path, _ = big_store
    url = serve(store=str(path), output_dir=str(tmp_path))
    for query, said in (("step=two", "step must be a whole number"), ("reward_min=lots", "reward_min must be a number"),
                        ("status=great", "status must be one of"), ("sort=random", "sort must be one of"),
                        ("page=0", "page must be 1 or more")):
        response = httpx.get(f"{url}/rollouts?{query}")
        assert response.status_code == 400 and said in response.text, query
    response = httpx.get(f"{url}/rollouts/no-such-rollout")
    assert response.status_code == 404 and "has no rollout &#39;no-such-rollout&#39;" in response.text


def test_the_dashboard_never_changes_the_store(serve, big_store, tmp_path):
    path, made = big_store
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    url = serve(store=str(path), output_dir=str(tmp_path))
    for route in ("/run", "/rollouts?sort=reward_desc&agent=writer", f"/rollouts/{made[0].rollout_id}",
                  "/validation", "/compare?task=t1"):
        assert httpx.get(url + route).status_code == 200, route
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before


def test_a_token_is_asked_for_once_then_carried_by_a_cookie(serve, big_store, tmp_path):
    path, _ = big_store
    url = serve(store=str(path), output_dir=str(tmp_path), token="s3cret")
    assert httpx.get(url + "/rollouts").status_code == 401
    assert httpx.get(url + "/rollouts?token=wrong").status_code == 401
    assert httpx.get(url + "/api/run", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    with httpx.Client(base_url=url, follow_redirects=True) as client:
        response = client.get("/rollouts?token=s3cret&task=t1")
        assert response.status_code == 200 and "token" not in str(response.url)  # not left in the address
        rows = re.findall(r'data-rollout="([^"]+)"', response.text)
        assert rows and all("-t1-" in r for r in rows)  # the query's other parameter was kept
        assert client.get("/run").status_code == 200  # the cookie carries it


def test_the_cli_prints_its_settings_with_the_token_masked(tmp_path):
    result = subprocess.run([sys.executable, "-m", "spanrl", "dashboard", "--print-settings", "--token", "abc",
                             "--port", "0", "--store", str(tmp_path / "x.db")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "token = ***" in result.stdout and "abc" not in result.stdout
    bad = subprocess.run([sys.executable, "-m", "spanrl", "dashboard", "--page-size", "0"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "page_size must be between 1 and 1000" in bad.stderr


def test_a_store_from_before_advantages_were_recorded_reads_and_then_gains_them(tmp_path, serve):
    from spanrl.otlp_receiver import trained_rewards

    path = tmp_path / "spanrl.db"
    made = build_store(path, 4, tasks_per_step=1, group_size=4)
    db = sqlite3.connect(str(path))  # the table as releases before the advantages column made it
    db.executescript("DROP TABLE trained_rollouts; CREATE TABLE trained_rollouts (rollout_id TEXT PRIMARY KEY,"
                     " step INTEGER NOT NULL, reward REAL NOT NULL, reward_source TEXT NOT NULL, returns TEXT NOT NULL,"
                     " used INTEGER NOT NULL, recorded_at REAL NOT NULL)")
    db.execute("INSERT INTO trained_rollouts VALUES (?, 1, 0.5, 'events', '{\"1\": 0.5}', 1, 0)", (made[0].rollout_id,))
    db.commit()
    db.close()
    assert trained_rewards.load(path)[made[0].rollout_id].advantages is None
    url = serve(store=str(path), output_dir=str(tmp_path))
    page = httpx.get(f"{url}/rollouts/{made[0].rollout_id}")
    assert page.status_code == 200 and 'data-advantage=""' in page.text
    trained_rewards.record(path, [trained_rewards.TrainedRollout(made[1].rollout_id, 1, 0.25, "events", {1: 0.25},
                                                                 True, {1: -0.5})])
    loaded = trained_rewards.load(path)
    assert loaded[made[0].rollout_id].advantages is None and loaded[made[1].rollout_id].advantages == {1: -0.5}
    page = httpx.get(f"{url}/rollouts/{made[1].rollout_id}")
    assert 'data-advantage="-0.5"' in page.text


def test_the_facet_index_gives_the_same_pages_while_catching_up_and_after_the_store_is_replaced(tmp_path):
    from spanrl.dashboard import facet_index
    from spanrl.dashboard.facet_index import FacetIndex

    path = tmp_path / "spanrl.db"
    made = build_store(path, 2500, tasks_per_step=5, group_size=5)
    index = FacetIndex(str(path), str(tmp_path))
    filters = [RolloutFilter(status="failed"), RolloutFilter(agent="planner", sort="reward_asc"),
               RolloutFilter(reward_min=0.5, reward_max=0.6), RolloutFilter(sort="reward_desc", task="t3")]

    def pages(with_index: bool) -> list[list[str]]:
        with open_store(str(path), index if with_index else None) as reader:
            return [[r.rollout_id for r in rollout_page(reader, f, 1, 3000).rows] for f in filters]

    expected = pages(False)
    assert all(expected)
    index.catch_up(max_batches=1)  # part of it indexed, the rest read from the bodies
    assert index.indexed_sequence == facet_index.BATCH < len(made)
    assert pages(True) == expected
    index.catch_up()
    assert index.indexed_sequence == len(made) and pages(True) == expected
    path.unlink()
    build_store(path, 30, tasks_per_step=2, group_size=3, seed=1)  # a new run in the same file
    index.catch_up()
    assert index.indexed_sequence == 30
    assert pages(True) == pages(False)


def test_the_dashboard_does_not_import_torch():
    code = ("import sys\nfrom spanrl.dashboard.app import create_app\nfrom spanrl.dashboard.settings import "
            "DashboardSettings\ncreate_app(DashboardSettings())\nprint(sorted(m for m in ('torch', 'transformers')"
            " if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_token_ids_are_decoded_with_the_newest_checkpoints_tokenizer(tmp_path, serve):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    path = tmp_path / "spanrl.db"
    made = build_store(path, 2, tasks_per_step=1, group_size=2)
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000001"
    checkpoint.mkdir(parents=True)
    tokenizer = Tokenizer(WordLevel({f"w{n}": n for n in range(300)}, unk_token="w0"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(checkpoint / "tokenizer.json"))
    url = serve(store=str(path), output_dir=str(tmp_path / "run"))
    transition = made[0].transitions[1]
    text = httpx.get(f"{url}/rollouts/{made[0].rollout_id}").text
    shown = re.findall(r'<span class="tok (trained|masked)" data-id="(\d+)"[^>]*>([^<]*)</span>',
                       text.split(f'id="transition-{transition.index}"')[1])
    assert [int(i) for _, i, _ in shown] == list(transition.response_token_ids)
    assert "".join(piece for _, _, piece in shown) == tokenizer.decode(list(transition.response_token_ids))
    assert {mark for mark, _, _ in shown} == {"trained"}  # the writer's call was trained (synthetic_store)
    assert "no tokenizer.json found" not in text
    url = serve(store=str(path), output_dir=str(tmp_path / "elsewhere"))
    assert "no tokenizer.json found" in httpx.get(f"{url}/rollouts/{made[0].rollout_id}").text
