"""The keys of a training run's metrics rows (``metrics.jsonl``), namespaced as verl's, and the
one reader of such files, old ones included.

``spanrl train`` appends one row per step (``trainer_bridge/metrics.py``) and hands it to the
experiment trackers. Keys are grouped the way verl names its own: ``rollout/...`` (what the
step's rollouts scored and why some were left out), ``actor/...`` (what the update reported:
the policy version it published, losses, clip fractions, tokens), ``timing/...`` (seconds) and
``val/...`` (the held-out validation round), ``apo/...`` (a round of prompt optimization); ``step``
is the x axis. Runs of earlier versions
wrote flat keys (``reward_mean``, ``loss``, ...): ``LEGACY_KEYS`` maps each to its namespaced
name, and ``read_metrics`` / ``namespaced`` give every consumer (``spanrl inspect metrics``, the
reward plot, a resumed run, dashboards) rows in today's keys whatever wrote them. Stdlib only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

STEP = "step"
REWARD_MEAN = "rollout/reward_mean"
ROLLOUTS = "rollout/count"
ROLLOUTS_USED = "rollout/used"
ROLLOUTS_LEFT_OUT = "rollout/left_out"  # {reason: count}
ROLLOUTS_RELAUNCHED = "rollout/relaunched"  # {infrastructure fault: attempts relaunched}
RECEIVER_COUNTERS = "rollout/receiver_counters"  # {AssembledRollout.counters name: count}, summed over the step
GROUPS_OF_ONE_DROPPED = "rollout/groups_of_one_dropped"
UNIFORM_GROUPS_DROPPED = "rollout/uniform_groups_dropped"  # drop_uniform_groups: groups whose rewards were all equal
GROUPS = "rollout/groups"  # task groups of the step with two or more scored rollouts
# of them, those whose rollouts all scored the same, as {that score: groups}: GRPO's advantages are 0 there
# (all solved, or a task no rollout solves: nothing to learn from it until one does)
GROUPS_WITHOUT_SIGNAL = "rollout/groups_without_signal"
# from_traffic (trainer_bridge/traffic_loop.py): rollouts of the step scored within their prompt group, and
# against their agent's running mean of rewards; rollouts in the window still waiting for feedback
TRAFFIC_GROUPED = "rollout/traffic_grouped"
TRAFFIC_BY_AGENT_BASELINE = "rollout/traffic_by_agent_baseline"
TRAFFIC_WAITING = "rollout/traffic_waiting"
ROLLOUTS_PER_S = "rollout/per_s"
BELOW_SFT_MIN_REWARD = "rollout/below_sft_min_reward"
ROLLOUTS_OFF_POLICY = "rollout/off_policy"
POLICY_LAG_MEAN = "rollout/policy_lag_mean"
GROUPS_IN_FLIGHT = "rollout/groups_in_flight"
POLICY_VERSION = "actor/policy_version"
TRANSITIONS = "actor/transitions"  # samples the update trained on
ACTOR_PREFIX = "actor/"  # + every statistic the backend's update reports (loss, grad_norm, pg_loss, ...)
ROLLOUT_SECONDS = "timing/rollout_s"  # waiting for the step's rollouts
STEP_SECONDS = "timing/step_s"
UPDATE_SECONDS = "timing/update_s"
VAL_REWARD = "val/reward"
VAL_ROLLOUTS = "val/count"
VAL_ROLLOUTS_SCORED = "val/scored"
VAL_LEFT_OUT = "val/left_out"
VAL_SECONDS = "timing/val_s"
# a round of automatic prompt optimization (algorithm: apo; trainer_bridge/apo/run.py)
APO_RESOURCE = "apo/resource"  # the prompt resource (agent or model name) being optimized
APO_ROUND = "apo/round"  # 0: the starting candidates; then 1..apo.rounds
APO_CANDIDATES = "apo/candidates"  # candidates scored in the round
APO_PROPOSED = "apo/proposed"  # new candidates the optimizer wrote for it
APO_DROPPED = "apo/dropped"  # optimizer answers that could not be used
APO_BEAM_BEST_REWARD = "apo/beam_best_reward"  # the training reward of the round's best candidate
NAMESPACES = ("rollout/", "actor/", "timing/", "val/", "apo/")

# the flat keys of metrics.jsonl files written before the namespaces, and their names today
LEGACY_KEYS: dict[str, str] = {
    "reward_mean": REWARD_MEAN,
    "rollouts": ROLLOUTS,
    "rollouts_used": ROLLOUTS_USED,
    "rollouts_left_out": ROLLOUTS_LEFT_OUT,
    "receiver_counters": RECEIVER_COUNTERS,
    "groups_of_one_dropped": GROUPS_OF_ONE_DROPPED,
    "rollouts_per_s": ROLLOUTS_PER_S,
    "rollouts_below_sft_min_reward": BELOW_SFT_MIN_REWARD,
    "rollouts_off_policy": ROLLOUTS_OFF_POLICY,
    "policy_lag_mean": POLICY_LAG_MEAN,
    "groups_in_flight": GROUPS_IN_FLIGHT,
    "policy_version": POLICY_VERSION,
    "transitions": TRANSITIONS,
    "rollout_seconds": ROLLOUT_SECONDS,
    "seconds": STEP_SECONDS,
    "update_seconds": UPDATE_SECONDS,
    "val_reward": VAL_REWARD,
    "val_rollouts": VAL_ROLLOUTS,
    "val_rollouts_scored": VAL_ROLLOUTS_SCORED,
    "val_rollouts_left_out": VAL_LEFT_OUT,
    "val_seconds": VAL_SECONDS,
}


def actor_key(statistic: str) -> str:
    """The row key of a statistic the backend's update reported (``loss`` -> ``actor/loss``)."""
    return statistic if statistic.startswith(ACTOR_PREFIX) else ACTOR_PREFIX + statistic


def namespaced(row: Mapping[str, Any]) -> dict[str, Any]:
    """``row`` in today's keys: a flat key of an old run becomes its namespaced name (an update
    statistic not in ``LEGACY_KEYS`` goes under ``actor/``); namespaced keys stay as they are."""
    out: dict[str, Any] = {}
    for key, value in row.items():
        if key == STEP or key.startswith(NAMESPACES):
            out[key] = value
        else:
            out[LEGACY_KEYS.get(key) or actor_key(key)] = value
    return out


def metrics_file(path: str | Path) -> str:
    """``path`` itself, or its ``metrics.jsonl`` when it is a run's output folder."""
    path = str(path)
    return os.path.join(path, "metrics.jsonl") if os.path.isdir(path) else path


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Every row of a ``metrics.jsonl`` file (or of the one in output folder ``path``), in today's
    keys (``namespaced``); ``FileNotFoundError`` when there is none."""
    with open(metrics_file(path), encoding="utf-8") as f:
        return [namespaced(json.loads(line)) for line in f if line.strip()]
