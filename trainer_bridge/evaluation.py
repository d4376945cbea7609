"""``spanrl eval``: a model directory or a serving endpoint scored on a task file, nothing trained.

Started as ``spanrl train`` starts (``session.check_start``, ``wait_for_receiver``,
``session.start_session``: the embedded torch backend on ``--model DIR``, the bridge's task API for
``spanrl run``), then two rounds of held-out attempts, each through ``validation.score_round``, the
function training's validation rounds run (the loop's dispatcher, the store, ``RolloutScorer`` and,
with ``reward: judge``, the group judge):

- the greedy round: one attempt per task under validation rollout ids, which the policy endpoint
  samples at temperature 0: greedy accuracy is the fraction of tasks whose reward reaches
  ``success_threshold``;
- the sampled round: ``samples`` attempts per task under eval rollout ids, at the temperature the agent
  asks for (as training samples): pass@k (``pass_at_k.py``, the unbiased estimator).

``--endpoint URL`` evaluates an OpenAI-compatible endpoint that spanrl neither starts nor trains: the
agents call it through a relay in this process (``relay/``, spans off) that pins the greedy round's
temperature to 0 as the embedded server does; its replies need no token ids, since eval scores
rollouts, not transitions (a rollout without any still counts). The summary goes to ``--out`` as JSON
(per-task results) and a one-screen table to stdout. Called by ``eval_cli``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from contextlib import ExitStack
from typing import Any

from spanrl.bridge_protocol import EVAL_ROLLOUT_PREFIX, VALIDATION_ROLLOUT_PREFIX
from spanrl.errors import UserError

from .endpoint_backend.backend import EndpointBackend
from .eval_settings import GREEDY_TEMPERATURE, EvalSettings
from .pass_at_k import EvalSummary, TaskResult, greedy_accuracy, mean_pass_at_k, pass_at_k
from .session import check_start, start_session
from .start_checks import wait_for_receiver
from .training_loop import TrainingLoop
from .validation import ScoredRound, score_round

logger = logging.getLogger(__name__)

GREEDY_STEP, SAMPLED_STEP = 0, 1  # the rounds' numbers in their rollout ids (v0-..., e1-...)


def run_eval(settings: EvalSettings) -> EvalSummary:
    """Score ``settings.target`` on ``settings.tasks`` (module docstring); writes ``settings.out_path``."""
    check_start(settings)
    loop = TrainingLoop(settings)
    # scored as outcomes: a text-only rollout counts too
    loop.scorer.require_transitions = loop.held_out_scorer.require_transitions = False
    wait_for_receiver(settings.store, settings.receiver_wait_s)
    started = time.monotonic()
    greedy = sampled = None
    with ExitStack() as cleanup:
        backend = served_endpoint(settings, cleanup) if settings.endpoint_url else None
        session = start_session(settings, loop, cleanup, backend)
        idle, wait_s = session.waiting_for_runners, settings.runner_wait_warn_s
        if settings.greedy:
            greedy = score_round(loop, GREEDY_STEP, loop.tasks, 1, VALIDATION_ROLLOUT_PREFIX, idle, wait_s)
        if settings.samples:
            sampled = score_round(loop, SAMPLED_STEP, loop.tasks, int(settings.samples), EVAL_ROLLOUT_PREFIX,
                                  idle, wait_s)
    summary = summarize(settings, [task_id for task_id, _ in loop.tasks], greedy, sampled,
                        time.monotonic() - started)
    write_summary(summary, settings.out_path)
    return summary


def served_endpoint(settings: EvalSettings, cleanup: ExitStack) -> EndpointBackend:
    """``--endpoint``: a relay in this process in front of the endpoint (greedy round pinned to
    temperature 0), once the endpoint answers ``GET /models``; ``cleanup`` stops the relay."""
    from .relay.app import create_relay_app
    from .relay.config import RelayConfig
    from .relay.server_thread import RelayServer
    from .relay.state import RelayState

    url = settings.endpoint_url.rstrip("/")
    check_endpoint(url, settings.policy_token)
    config = RelayConfig(name="eval relay", ask_token_ids=False, validation_temperature=GREEDY_TEMPERATURE,
                         rotate_out_on_failure=False, pass_agent_key=True, stamp_policy_version=False,
                         spans_endpoint="off", upstream_api_key=settings.policy_token)
    relay = RelayServer("eval relay", "127.0.0.1", 0, lambda: RelayState(config, [url], base_urls=True),
                        create_relay_app, config)
    relay.start()
    cleanup.callback(relay.stop)
    logger.info("eval: agents call %s through the relay %s (greedy round at temperature 0)", url, relay.url)
    return EndpointBackend(relay.url, None)


def check_endpoint(url: str, token: str | None) -> None:
    """The endpoint answers ``GET {url}/models`` (said before any runner waits)."""
    import httpx

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        reply = httpx.get(url + "/models", headers=headers, timeout=10.0)
    except httpx.HTTPError as exc:
        raise UserError(f"the endpoint {url} cannot be reached ({type(exc).__name__}): start it, or fix "
                        "--endpoint (an OpenAI base URL ending in /v1)") from exc
    if reply.status_code in (401, 403):
        raise UserError(f"the endpoint {url} refused the request ({reply.status_code}): set policy_token to its key")
    if reply.status_code != 200:
        raise UserError(f"the endpoint {url} answered GET /models with {reply.status_code}: is it an OpenAI "
                        "base URL ending in /v1?")


def task_result(task_id: str, settings: EvalSettings, greedy: ScoredRound | None,
                sampled: ScoredRound | None) -> TaskResult:
    """One task's results from the two rounds."""
    threshold = settings.success_threshold
    greedy_id = next((a.rollout_id for a in greedy.attempts if a.task_id == task_id), None) if greedy else None
    greedy_score = greedy.scores.get(greedy_id) if greedy and greedy_id else None
    ids = [a.rollout_id for a in sampled.attempts if a.task_id == task_id] if sampled else []
    scores = [sampled.scores[i] for i in ids if sampled and i in sampled.scores]
    successes = sum(score >= threshold for score in scores)
    left = Counter(sampled.reasons[i] for i in ids if sampled and i in sampled.reasons)
    return TaskResult(
        task_id=task_id, greedy_score=greedy_score,
        greedy_success=greedy_score is not None and greedy_score >= threshold, sample_scores=scores,
        samples=len(ids), successes=successes, pass_at_k=pass_at_k(len(ids), successes, settings.k) if ids else None,
        greedy_left_out=greedy.reasons.get(greedy_id) if greedy and greedy_id else None,
        samples_left_out=dict(left), greedy_rollout=greedy_id)


def summarize(settings: EvalSettings, task_ids: list[str], greedy: ScoredRound | None, sampled: ScoredRound | None,
              seconds: float) -> EvalSummary:
    """The summary of both rounds: totals and one ``TaskResult`` per task."""
    results = [task_result(task_id, settings, greedy, sampled) for task_id in task_ids]
    greedy_scores = list(greedy.scores.values()) if greedy else []
    sample_scores = list(sampled.scores.values()) if sampled else []
    left_out: Counter = Counter()
    for scored_round in (greedy, sampled):
        if scored_round is not None:
            left_out.update(scored_round.left_out)
    return EvalSummary(
        target=settings.target, tasks_file=settings.tasks, tasks=len(task_ids), k=settings.k,
        samples_per_task=int(settings.samples or 0), success_threshold=settings.success_threshold,
        greedy_accuracy=greedy_accuracy(results) if greedy else None, pass_at_k=mean_pass_at_k(results),
        mean_greedy_reward=_mean(greedy_scores), mean_sample_reward=_mean(sample_scores), left_out=dict(left_out),
        seconds=seconds, results=results)


def write_summary(summary: EvalSummary, path: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(summary.to_json(), f, indent=2)
    logger.info("eval: summary written to %s", path)


def _mean(values: list[float]) -> Any:
    return sum(values) / len(values) if values else None
