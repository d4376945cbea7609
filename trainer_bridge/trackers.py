"""Experiment tracking: every metrics row also goes to TensorBoard, Weights & Biases or MLflow.

``run_training`` opens the trackers named by ``report_to`` in ``train.yaml`` with
``open_trackers`` and hands each step's metrics row (the line it appends to ``metrics.jsonl``)
to ``TrackerSet.log``; ``close`` ends the runs. Each tracker writes through the library itself:

- ``tensorboard``: ``torch.utils.tensorboard.SummaryWriter`` event files in ``<output_dir>/tensorboard``;
- ``wandb``: ``wandb.init`` with ``dir=<output_dir>``; ``WANDB_MODE=offline`` works without network
  (``wandb sync`` uploads the run later), other ``WANDB_*`` variables apply as usual;
- ``mlflow``: ``MlflowClient`` to ``MLFLOW_TRACKING_URI`` when set, else a SQLite store at
  ``<output_dir>/mlflow.db`` (``mlflow ui --backend-store-uri sqlite:///...`` shows it).

A tracker whose library is missing is a ``TrackerMissing`` (a ``UserError``) naming the pip
install, raised before training starts. The libraries are imported only when asked for.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import time
from collections.abc import Mapping
from typing import Any, Protocol

from spanrl.errors import SettingError, UserError

logger = logging.getLogger(__name__)

TRACKERS = ("tensorboard", "wandb", "mlflow")
# what `pip install` needs for each (also the `trackers` extra of pyproject.toml)
PIP_NAMES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow-skinny sqlalchemy alembic"}


class TrackerMissing(UserError):
    """``report_to`` names a tracker whose library is not installed."""


class Tracker(Protocol):
    """One experiment tracker: ``log`` a metrics row at its step, ``close`` at the end."""

    name: str
    location: str  # where its run lives, for the end-of-training summary

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


def scalar_metrics(row: Mapping[str, Any]) -> dict[str, float]:
    """The numbers of a metrics row, flat: ``{"rollouts_left_out": {"failed": 2}}`` becomes
    ``rollouts_left_out/failed``; ``step`` (the x axis) and non-numbers are left out."""
    flat: dict[str, float] = {}
    for key, value in row.items():
        if key == "step":
            continue
        if isinstance(value, Mapping):
            for inner, number in value.items():
                if isinstance(number, (int, float)) and not isinstance(number, bool):
                    flat[f"{key}/{inner}"] = float(number)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[key] = float(value)
    return flat


def _missing(name: str, exc: ImportError) -> TrackerMissing:
    return TrackerMissing(f"report_to lists {name!r} but it is not installed ({exc}); install it with "
                          f"`pip install {PIP_NAMES[name]}` (or `pip install 'spanrl[trackers]'`), "
                          f"or remove {name!r} from report_to")


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, output_dir: str, config: Mapping[str, Any]) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise _missing(self.name, exc) from exc
        self.location = os.path.join(output_dir, "tensorboard")
        self._writer = SummaryWriter(log_dir=self.location)
        self._writer.add_text("config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```", 0)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    name = "wandb"

    def __init__(self, output_dir: str, config: Mapping[str, Any], project: str) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise _missing(self.name, exc) from exc
        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", project), dir=output_dir,
                               config=dict(config), reinit="create_new")
        self.location = os.path.dirname(str(self._run.dir))  # the run folder (its files/ is run.dir)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


class MlflowTracker:
    name = "mlflow"

    def __init__(self, output_dir: str, config: Mapping[str, Any], project: str) -> None:
        try:
            from mlflow.entities import Param
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise _missing(self.name, exc) from exc
        from mlflow.entities import Metric

        self._metric = Metric
        uri = os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///" + os.path.abspath(
            os.path.join(output_dir, "mlflow.db"))
        if not os.environ.get("MLFLOW_TRACKING_URI"):  # the SQLite store needs what mlflow-skinny leaves out
            for module in ("sqlalchemy", "alembic"):
                try:
                    importlib.import_module(module)
                except ImportError as exc:
                    raise _missing(self.name, exc) from exc
        self._client = MlflowClient(tracking_uri=uri)
        experiment = self._client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(project)
        self._run_id = self._client.create_run(experiment_id).info.run_id
        params = [Param(key, (value if isinstance(value, str) else json.dumps(value, default=str))[:6000])
                  for key, value in config.items()]
        self._client.log_batch(self._run_id, params=params)
        self.location = f"{uri} (experiment {project!r}, run {self._run_id})"

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        now_ms = int(time.time() * 1000)
        self._client.log_batch(self._run_id, metrics=[
            self._metric(key, value, now_ms, step) for key, value in metrics.items()])

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


class TrackerSet:
    """The trackers of one training run; a tracker that fails while logging is logged and
    dropped, so tracking never stops training."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers

    def log(self, row: Mapping[str, Any]) -> None:
        metrics = scalar_metrics(row)
        for tracker in list(self.trackers):
            try:
                tracker.log(int(row["step"]), metrics)
            except Exception:
                logger.exception("tracker %s failed to log step %s; it is turned off for this run",
                                 tracker.name, row.get("step"))
                self.trackers.remove(tracker)

    def close(self) -> None:
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception:
                logger.exception("tracker %s failed to close", tracker.name)

    @property
    def locations(self) -> dict[str, str]:
        return {t.name: t.location for t in self.trackers}


def check_report_to(report_to: list | tuple) -> None:
    """Raise ``SettingError`` for a name that is not a tracker (called from the settings)."""
    unknown = [name for name in report_to if name not in TRACKERS]
    if unknown:
        raise SettingError(f"report_to: unknown tracker(s) {unknown}; choose from {list(TRACKERS)}")


def flat_config(settings: Any) -> dict:
    """A settings dataclass as a tracker's run config: nested blocks flattened to ``trainer.x``."""

    flat: dict = {}
    for key, value in dataclasses.asdict(settings).items():
        if isinstance(value, dict) and dataclasses.is_dataclass(getattr(settings, key)):
            flat.update({f"{key}.{inner}": v for inner, v in value.items()})
        else:
            flat[key] = value
    return flat


def open_trackers(report_to: list | tuple, output_dir: str, config: Mapping[str, Any],
                  project: str = "spanrl") -> TrackerSet:
    """Start one run in each tracker of ``report_to``; ``config`` is recorded with it."""
    check_report_to(report_to)
    opened: list[Tracker] = []
    try:
        for name in dict.fromkeys(report_to):  # each once, in the order given
            if name == "tensorboard":
                opened.append(TensorBoardTracker(output_dir, config))
            elif name == "wandb":
                opened.append(WandbTracker(output_dir, config, project))
            else:
                opened.append(MlflowTracker(output_dir, config, project))
    except BaseException:
        TrackerSet(opened).close()
        raise
    return TrackerSet(opened)
