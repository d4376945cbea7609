"""Experiment tracking (``report_to``): what each library wrote, read back with its own reader.

The trackers write real TensorBoard event files, a real offline W&B run and a real MLflow
store; the tests read them with TensorBoard's ``EventAccumulator``, W&B's own protobuf records
(the run file is a log of ``wandb_internal_pb2.Record``) and ``MlflowClient``. A missing
library is a ``UserError`` naming the pip install.
"""

from __future__ import annotations

import glob
import os
import struct
import sys
import time

import pytest

from spanrl.errors import SettingError
from spanrl.trainer_bridge.trackers import TrackerMissing, open_trackers, scalar_metrics

ROWS = [
    {"step": 1, "reward_mean": 0.25, "policy_version": 1, "rollouts_left_out": {"failed": 2}, "loss": 0.5},
    {"step": 2, "reward_mean": 0.75, "policy_version": 2, "rollouts_left_out": {}, "loss": 0.25},
]
CONFIG = {"learning_rate": 0.0002, "group_size": 4, "trainer.kl_estimator": "k3"}


def write_rows(tmp_path, names: list[str]) -> dict[str, str]:
    trackers = open_trackers(names, str(tmp_path), CONFIG, project="spanrl-test")
    for row in ROWS:
        trackers.log(row)
    locations = trackers.locations
    trackers.close()
    return locations


def test_a_metrics_row_becomes_flat_numbers():
    assert scalar_metrics({**ROWS[0], "note": "text", "done": True}) == {
        "reward_mean": 0.25, "policy_version": 1.0, "rollouts_left_out/failed": 2.0, "loss": 0.5}


def test_tensorboard_event_files_read_by_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    locations = write_rows(tmp_path, ["tensorboard"])
    assert locations == {"tensorboard": str(tmp_path / "tensorboard")}
    events = EventAccumulator(locations["tensorboard"])
    events.Reload()
    assert {"reward_mean", "loss", "rollouts_left_out/failed"} <= set(events.Tags()["scalars"])
    assert [(e.step, e.value) for e in events.Scalars("reward_mean")] == [(1, 0.25), (2, 0.75)]
    assert [(e.step, e.value) for e in events.Scalars("rollouts_left_out/failed")] == [(1, 2.0)]


def wandb_records(run_file: str) -> list:
    """The records of a W&B run file: a LevelDB-style log (32 KiB blocks, 7-byte record headers)
    of ``wandb_internal_pb2.Record`` messages after a 7-byte file header."""
    from wandb.proto import wandb_internal_pb2

    data = open(run_file, "rb").read()
    assert data[:4] == b":W&B"
    block, position, pending, records = 32768, 7, b"", []
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        position += 7
        if kind == 0:
            break
        pending += data[position:position + length]
        position += length
        if kind in (1, 4):  # FULL, or LAST of a split record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_an_offline_wandb_run_read_with_wandbs_records(tmp_path, monkeypatch):
    import wandb  # noqa: F401 - CI installs it (.ci/requirements-ci.txt): a missing one fails here
    monkeypatch.setenv("WANDB_MODE", "offline")  # no network, no account
    monkeypatch.setenv("WANDB_SILENT", "true")
    locations = write_rows(tmp_path, ["wandb"])
    run_dir = locations["wandb"]
    assert run_dir.startswith(str(tmp_path / "wandb" / "offline-run-"))
    (run_file,) = glob.glob(f"{run_dir}/run-*.wandb")
    # wandb's own service process writes the run file; `finish()` may return before its last write
    deadline = time.monotonic() + 60
    records = wandb_records(run_file)
    while not any(r.WhichOneof("record_type") == "exit" for r in records) and time.monotonic() < deadline:
        time.sleep(0.2)
        records = wandb_records(run_file)
    history = [{item.key or "/".join(item.nested_key): item.value_json for item in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    assert [(h["_step"], float(h["reward_mean"]), float(h["loss"])) for h in history] == [
        ("1", 0.25, 0.5), ("2", 0.75, 0.25)]
    assert float(history[0]["rollouts_left_out/failed"]) == 2.0
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.project == "spanrl-test"
    config = {item.key: item.value_json for item in run.config.update}
    assert config["learning_rate"] == "0.0002" and config["trainer.kl_estimator"] == '"k3"'
    assert any(r.WhichOneof("record_type") == "exit" for r in records)  # the run was finished


def test_mlflow_metrics_read_back_with_mlflows_client(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    locations = write_rows(tmp_path, ["mlflow"])
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert locations["mlflow"].startswith(f"{uri} (experiment 'spanrl-test', run ")
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("spanrl-test")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "reward_mean")] == [
        (1, 0.25), (2, 0.75)]
    assert run.data.params["group_size"] == "4" and run.data.params["trainer.kl_estimator"] == "k3"


def test_mlflow_without_sqlalchemy_names_the_pip_install(tmp_path):
    """mlflow-skinny alone has no SQLite store; in a fresh process where SQLAlchemy cannot be imported."""
    import subprocess

    import mlflow  # noqa: F401 - CI installs it (.ci/requirements-ci.txt)

    script = (
        "import sys; sys.modules['sqlalchemy'] = None\n"
        "from spanrl.trainer_bridge.trackers import open_trackers, TrackerMissing\n"
        "try:\n"
        f"    open_trackers(['mlflow'], {str(tmp_path)!r}, {{}})\n"
        "except TrackerMissing as exc:\n"
        "    print(exc)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert "`pip install mlflow-skinny sqlalchemy alembic`" in result.stdout, result.stdout + result.stderr[-2000:]


@pytest.mark.parametrize("name, pip", [("wandb", "pip install wandb"), ("mlflow", "pip install mlflow-skinny"),
                                       ("tensorboard", "pip install tensorboard")])
def test_a_missing_tracker_library_names_the_pip_install(tmp_path, monkeypatch, name, pip):
    module = {"tensorboard": "torch.utils.tensorboard", "mlflow": "mlflow.tracking"}.get(name, name)
    monkeypatch.setitem(sys.modules, module, None)  # `import` of it now raises ImportError
    with pytest.raises(TrackerMissing, match=f"report_to lists '{name}' but it is not installed .*`{pip}"):
        open_trackers([name], str(tmp_path), CONFIG)


def test_an_unknown_tracker_is_a_setting_error(tmp_path):
    from spanrl.trainer_bridge.train_settings import TrainSettings

    with pytest.raises(SettingError, match=r"report_to: unknown tracker\(s\) \['neptune'\]"):
        TrainSettings(tasks="t.jsonl", model="m", report_to=["tensorboard", "neptune"])
