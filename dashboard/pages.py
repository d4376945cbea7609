"""What each dashboard page shows, as plain data: built from the run's output folder and its store.

Called by ``app.py`` (one function per page; the run page's numbers also as JSON for its live
refresh). Nothing here knows HTTP: a store that cannot be read or an output folder that is not
there becomes a line in ``problems``, which the page shows instead of the part it could not
build. The rest of the page is still shown.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any

from . import run_queries
from .facet_index import FacetIndex
from .rollout_view import span_lines, transition_views
from .run_metrics import RunMetrics, read_metrics
from .settings import DashboardSettings
from .store_reader import RolloutFilter, StoreProblem, StoreReader, open_store, rollout_page, step_of_rollout
from .token_view import decoder_for, find_tokenizer

CHART_SERIES = ("reward_mean", "reward_std", "val_reward", "loss", "pg_loss", "kl_loss", "ppo_kl", "pg_clipfrac",
                "rollouts_per_s")


def output_problems(settings: DashboardSettings, metrics: RunMetrics) -> list[str]:
    """What is missing on the run's side, said so the user knows what to do."""
    if not os.path.exists(settings.output_dir):
        return [f"no run output folder at {settings.output_dir}: give the training run's output_dir with "
                "--output-dir (it appears when `spanrl train` starts)"]
    if not os.path.isdir(settings.output_dir):
        return [f"{settings.output_dir} is a file, not a run's output folder: give the training's output_dir"]
    if not metrics.exists:
        return [f"no step has finished yet: {metrics.path} is not there (this page updates when it is)"]
    if not metrics.rows:
        return [f"no step has finished yet: {metrics.path} holds no step (this page updates when it does)",
                *metrics.problems]
    return list(metrics.problems)


def _with_store(settings: DashboardSettings, problems: list[str],
                index: FacetIndex | None = None) -> StoreReader | None:
    try:
        return open_store(settings.store, index)
    except StoreProblem as exc:
        problems.append(str(exc))
        return None


def run_data(settings: DashboardSettings, agents_step: int | None = None) -> dict[str, Any]:
    """The run page's numbers (its first render and every refresh)."""
    metrics = read_metrics(settings.output_dir)
    problems = output_problems(settings, metrics)
    rows = metrics.rows
    data: dict[str, Any] = {
        "steps": [r.step for r in rows],
        "series": {name: [r.get(name) for r in rows] for name in CHART_SERIES},
        "left_out": _left_out(rows),
        "spread": [], "agents": [], "agents_step": None, "store": {}, "problems": problems,
    }
    reader = _with_store(settings, problems)
    if reader is not None:
        with reader:
            data["store"] = run_queries.store_counts(reader)
            data.update(_trained_aggregates(reader, agents_step))
    data["version"] = [len(rows), rows[-1].step if rows else None, data["store"].get("all"), len(problems)]
    return data


# The run page's aggregates over trained_rollouts, by store: they change only when the trainer
# records a step, so a page polling every refresh_s recomputes them once per step.
_aggregates: dict[str, tuple[tuple, dict[str, Any]]] = {}


def _trained_aggregates(reader: StoreReader, agents_step: int | None) -> dict[str, Any]:
    """Per-step reward spread, the trained steps, and the agents of ``agents_step`` (default: the
    last step)."""
    key = (run_queries.trained_version(reader), agents_step)
    cached = _aggregates.get(reader.path)
    if cached is not None and cached[0] == key:
        return cached[1]
    steps = run_queries.training_steps(reader)
    chosen = agents_step if agents_step in steps else (steps[-1] if steps else None)
    agents = [] if chosen is None else [
        {"agent": a.agent, "calls": a.calls, "trained_calls": a.trained_calls, "rollouts": len(a.rollouts),
         "mean_reward": a.mean_reward}
        for a in run_queries.agent_breakdown(reader, chosen)]
    result = {"spread": [asdict(s) for s in run_queries.step_rewards(reader)], "agent_steps": steps,
              "agents_step": chosen, "agents": agents}
    _aggregates[reader.path] = (key, result)
    return result


def _left_out(rows) -> dict[str, list[int]]:
    reasons = sorted({reason for r in rows for reason in r.left_out})
    return {reason: [r.left_out.get(reason, 0) for r in rows] for reason in reasons}


def rollouts_data(settings: DashboardSettings, filters: RolloutFilter, page: int,
                  index: FacetIndex | None = None) -> dict[str, Any]:
    """One page of the rollouts list, and what the filters can offer."""
    problems: list[str] = []
    data: dict[str, Any] = {"rows": [], "has_next": False, "page": page, "tasks": [], "steps": [],
                            "counts": {}, "problems": problems}
    reader = _with_store(settings, problems, index)
    if reader is None:
        return data
    with reader:
        result = rollout_page(reader, filters, page, settings.page_size)
        data.update(rows=list(result.rows), has_next=result.has_next, tasks=run_queries.task_ids(reader),
                    steps=run_queries.step_suggestions(reader), counts=run_queries.store_counts(reader))
    if not data["counts"].get("all"):
        problems.append(f"the store {settings.store} holds no rollout yet (it fills as agents send spans)")
    return data


def rollout_data(settings: DashboardSettings, rollout_id: str) -> dict[str, Any] | None:
    """One rollout's page; None when the store has no such rollout."""
    problems: list[str] = []
    reader = _with_store(settings, problems)
    if reader is None:
        return {"problems": problems, "item": None, "rollout_id": rollout_id}
    with reader:
        item = run_queries.stored_rollout(reader, rollout_id)
    if item is None:
        return None
    tokenizer = find_tokenizer(settings.tokenizer, settings.output_dir)
    if tokenizer is None:
        problems.append("no tokenizer.json found (--tokenizer, or a checkpoint under the output folder): "
                        "token ids are shown instead of text")
    lines, tree_problems = span_lines(item)
    if item.rollout is None:
        problems.append(f"not assembled yet (the receiver's state: {item.row.state}"
                        f"{'; ' + item.broken_reason if item.broken_reason else ''})")
    return {"item": item, "rollout_id": rollout_id, "spans": lines, "tree_problems": tree_problems,
            "transitions": transition_views(item, decoder_for(tokenizer)), "step": step_of_rollout(rollout_id),
            "problems": problems}


def validation_data(settings: DashboardSettings) -> dict[str, Any]:
    """Every validation round: its score from metrics.jsonl and its rollouts in the store."""
    metrics = read_metrics(settings.output_dir)
    problems = output_problems(settings, metrics)
    rounds: dict[int, dict[str, Any]] = {}
    for row in metrics.rows:
        if row.get("val_rollouts") is not None or row.get("val_reward") is not None:
            rounds[row.step] = {"step": row.step, "val_reward": row.get("val_reward"),
                                "val_rollouts": row.get("val_rollouts"),
                                "val_rollouts_scored": row.get("val_rollouts_scored"),
                                "left_out": row.val_left_out, "store": None}
    reader = _with_store(settings, problems)
    if reader is not None:
        with reader:
            for stored in run_queries.validation_rounds(reader):
                rounds.setdefault(stored.step, {"step": stored.step, "val_reward": None, "val_rollouts": None,
                                                "val_rollouts_scored": None, "left_out": {}})["store"] = stored
    if not rounds and not problems:
        problems.append("no validation round yet: give `spanrl train` val_tasks (rounds run every val_every steps)")
    return {"rounds": [rounds[s] for s in sorted(rounds)], "problems": problems}


def compare_data(settings: DashboardSettings, task: str | None, step_a: int | None,
                 step_b: int | None, index: FacetIndex | None = None) -> dict[str, Any]:
    """One task's training rollouts at two steps, side by side, with their responses as text."""
    problems: list[str] = []
    data: dict[str, Any] = {"task": task, "step_a": step_a, "step_b": step_b, "tasks": [], "task_steps": [],
                            "sides": [], "problems": problems}
    reader = _with_store(settings, problems, index)
    if reader is None:
        return data
    decoder = decoder_for(find_tokenizer(settings.tokenizer, settings.output_dir))
    with reader:
        data["tasks"] = run_queries.task_ids(reader)
        if task is None and data["tasks"]:
            task = data["task"] = data["tasks"][0]
        if task is None:
            problems.append("the store holds no task yet")
            return data
        steps = run_queries.steps_of_task(reader, task)
        data["task_steps"] = steps
        if not steps:
            problems.append(f"task {task!r} has no training rollout in the store")
            return data
        step_a = data["step_a"] = step_a if step_a is not None else steps[0]
        step_b = data["step_b"] = step_b if step_b is not None else steps[-1]
        for step in (step_a, step_b):
            items = run_queries.rollouts_of_step(reader, step, "training", task)
            data["sides"].append({"step": step, "rollouts": [
                {"item": item, "transitions": transition_views(item, decoder)} for item in items]})
    return data
