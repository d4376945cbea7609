"""``algorithm: apo``: automatic prompt optimization of the selected agents' instructions, weights frozen.

Run by ``session.run_training`` once the backend (torch or verl: its weights are never updated
here) and the task API are up. For each resource of ``apo.resources`` (default: every resource of
the ``apo.prompts`` file), one after the other: the beam search (``search.ApoSearch``) from the
resource's starting candidates, its rounds run through the loop's runners and rewards
(``rounds.CandidateRounds``), the optimizer model's edits (``optimizer.PromptOptimizer``, when
``apo.optimizer_url`` is set) written from the text of the lowest-reward rollouts
(``rollout_text.RolloutText``). After a resource's search its best candidate is the endpoint's
active prompt for it (so the next resource is optimized with it, and agents keep being served it
after training); ``prompts.yaml`` in the output folder (the format of ``spanrl prompts export``)
and ``apo.json`` (every candidate, its parent and scores) record the result.

Every round prints one progress line and appends one metrics row (``spanrl.schema.metrics``:
``apo/...`` keys, ``rollout/reward_mean`` of the round, ``val/reward`` of the best so far).
Torch-free.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from spanrl.schema import metrics as keys
from spanrl.schema.tasks import load_tasks

from .config import ApoConfig
from .optimizer import PromptOptimizer, UnusableAnswer
from .rollout_text import RolloutText
from .rounds import CandidateRounds, RolloutResult
from .search import ApoSearch, Candidate, Evaluation, Proposals, RoundReport

if TYPE_CHECKING:  # the loop's modules import the settings, which hold the apo: block (no circle)
    from ..loop_settings import LoopSettings
    from ..training_loop import TrainingLoop

logger = logging.getLogger(__name__)

PROMPTS_FILE = "prompts.yaml"  # <output_dir>/prompts.yaml: the best prompts, as `spanrl prompts export` writes
RECORD_FILE = "apo.json"  # <output_dir>/apo.json: every candidate of the search and its scores


@dataclass
class ResourceResult:
    """The search of one resource: its best candidate and every candidate it saw."""

    resource: str
    best: Candidate
    best_score: float | None
    start: str | None  # the starting active candidate (None: the agent's own instructions)
    candidates: list[Candidate] = field(default_factory=list)
    scores: dict[str, list[float | None]] = field(default_factory=dict)  # name -> training score per round
    held_out: dict[str, float | None] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)  # why each unusable optimizer answer was dropped


def starting_pool(config: ApoConfig) -> dict[str, tuple[dict[str, str], str | None]]:
    """Each resource to optimize: its starting candidates and its active one, from ``apo.prompts``."""
    from spanrl.errors import SettingError
    from spanrl.settings_loader import read_settings_file
    from spanrl.trainer_bridge.prompt_resources import PromptResourceError, parse_resource

    if not os.path.isfile(config.prompts):
        raise SettingError(f"apo.prompts {config.prompts!r} not found (a prompts file: resource -> instructions)")
    raw = read_settings_file(config.prompts)
    names = list(config.resources) or list(raw)
    missing = [name for name in names if name not in raw]
    if missing or not names:
        raise SettingError(f"apo.prompts {config.prompts} has no candidates for {missing or 'any resource'} "
                           f"(its resources: {', '.join(raw) or 'none'})")
    try:
        return {name: parse_resource(name, raw[name]) for name in names}
    except PromptResourceError as exc:
        raise SettingError(f"apo.prompts {config.prompts}: {exc}") from exc


class ApoRun:
    """One APO run: every selected resource's search, its rows and its result (module docstring)."""

    def __init__(self, settings: LoopSettings, loop: TrainingLoop, endpoint: Any, policy_version: Callable[[], int],
                 log_row: Callable[[dict], None], on_idle: Callable[[float, int], None] | None = None) -> None:
        self.settings, self.config, self.loop, self.endpoint = settings, settings.apo, loop, endpoint
        self.policy_version, self.log_row, self.on_idle = policy_version, log_row, on_idle
        self.val_tasks = load_tasks(settings.val_tasks) if settings.val_tasks else []
        self.optimizer = PromptOptimizer(self.config) if self.config.proposes else None
        self.texts = RolloutText(settings.model, self.config.rollout_chars, loop.store)
        self.rows_written = 0
        self.rounds_run = 0  # rollout-id rounds opened so far, over every resource

    def run(self, pool: dict[str, tuple[dict[str, str], str | None]], first_row: int = 0) -> list[ResourceResult]:
        """Search every resource of ``pool`` in turn; the best of each is served and saved."""
        self.rows_written = first_row
        results = []
        for resource, (candidates, active) in pool.items():
            result = self.search(resource, [Candidate(name, text) for name, text in candidates.items()], active)
            results.append(result)
            self.write(results)
        return results

    def search(self, resource: str, pool: list[Candidate], active: str | None) -> ResourceResult:
        rounds = CandidateRounds(self.loop, self.endpoint, resource, self.config, self.val_tasks,
                                 self.settings.val_attempts, self.rounds_run, self.on_idle)
        rounds.serve(pool, active)
        result = ResourceResult(resource, pool[0], None, active)
        search = ApoSearch(rounds.evaluate, self._proposer(resource, result) if self.optimizer else None,
                           rounds.validate if self.val_tasks else None, self.config.beam_width,
                           self.config.branch_factor, self.config.rounds)
        print(f"apo: {resource}: {len(pool)} starting candidates, {self.config.rounds} rounds, beam "
              f"{self.config.beam_width}, " + (f"optimizer {self.config.optimizer_model} at {self.config.optimizer_url}"
                                               if self.optimizer else "no optimizer (selection from the pool)"),
              flush=True)
        best = search.run(pool, on_round=lambda report: self._round_done(resource, report, rounds, result))
        self.rounds_run = rounds.round_id
        result.best, result.candidates = best, list(search.seen)
        result.held_out = dict(search.held_out)
        result.best_score = search.held_out.get(best.name) if search.held_out.get(best.name) is not None else \
            _last(result.scores.get(best.name, []))
        rounds.serve([best], best.name)  # agents are served the best from now on
        print(f"apo: {resource}: best {best.name} ({_score(result.best_score)}): {best.text!r}", flush=True)
        return result

    def _proposer(self, resource: str, result: ResourceResult) -> Callable[[Evaluation, int, int], Proposals]:
        optimizer = self.optimizer
        assert optimizer is not None
        made = [0]

        def propose(evaluation: Evaluation, count: int, number: int) -> Proposals:
            parent = evaluation.candidate
            worst = sorted(evaluation.rollouts, key=_reward_or_zero)[: self.config.gradient_batch]
            texts = [self.texts.text(r.attempt.task, r.reward, r.rollout, r.status) for r in worst]
            written: list[Candidate] = []
            dropped = 0
            for _ in range(count):
                try:
                    text = optimizer.edit(parent.text, texts)
                except UnusableAnswer as exc:
                    reason = str(exc)
                else:
                    if text not in {c.text for c in written}:
                        made[0] += 1
                        written.append(Candidate(f"r{number}-{made[0]}", text, parent.name))
                        continue
                    reason = "the same prompt as another edit of this round"
                dropped += 1
                result.dropped.append(reason)
                logger.warning("apo: %s round %d: an edit of %s was dropped: %s", resource, number, parent.name,
                               reason)
            return Proposals(written, dropped)

        return propose

    def _round_done(self, resource: str, report: RoundReport, rounds: CandidateRounds, result: ResourceResult) -> None:
        counts, rewards, seconds = rounds.take_counts()
        for evaluation in report.evaluations:
            result.scores.setdefault(evaluation.candidate.name, []).append(evaluation.score)
        beam_best = report.evaluations[[e.candidate for e in report.evaluations].index(report.beam[0])]
        self.rows_written += 1
        row: dict[str, Any] = {
            keys.STEP: self.rows_written,
            keys.REWARD_MEAN: sum(rewards) / len(rewards) if rewards else 0.0,
            keys.POLICY_VERSION: self.policy_version(),
            keys.ROLLOUTS: counts.pop("rollouts", 0),
            keys.ROLLOUTS_LEFT_OUT: dict(counts),
            keys.STEP_SECONDS: seconds,
            keys.APO_ROUND: report.round,
            keys.APO_CANDIDATES: len(report.evaluations),
            keys.APO_PROPOSED: report.proposed,
            keys.APO_DROPPED: report.dropped,
            keys.APO_BEAM_BEST_REWARD: beam_best.score if beam_best.score is not None else 0.0,
        }
        if self.val_tasks and report.best_score is not None:
            row[keys.VAL_REWARD] = report.best_score
        self.log_row({**row, keys.APO_RESOURCE: resource})
        print(f"apo: {resource} round {report.round}/{self.config.rounds}: {len(report.evaluations)} candidates "
              f"(+{report.proposed} new, {report.dropped} dropped), reward {row[keys.REWARD_MEAN]:.3f}, beam "
              f"{[c.name for c in report.beam]}, best {report.best.name} ({_score(report.best_score)})", flush=True)

    def write(self, results: list[ResourceResult]) -> None:
        """``prompts.yaml`` (the best of each resource active, the final candidates) and ``apo.json``."""
        import yaml

        os.makedirs(self.settings.output_dir, exist_ok=True)
        prompts = {r.resource: {"active": r.best.name, "candidates": {r.best.name: r.best.text}} for r in results}
        with open(os.path.join(self.settings.output_dir, PROMPTS_FILE), "w", encoding="utf-8") as f:
            yaml.safe_dump(prompts, f, sort_keys=True, allow_unicode=True, default_flow_style=False, width=100)
        record = [{"resource": r.resource, "best": r.best.name, "best_score": r.best_score, "start": r.start,
                   "candidates": [{"name": c.name, "text": c.text, "parent": c.parent,
                                   "scores": r.scores.get(c.name, []), "held_out": r.held_out.get(c.name)}
                                  for c in r.candidates],
                   "dropped": r.dropped} for r in results]
        with open(os.path.join(self.settings.output_dir, RECORD_FILE), "w", encoding="utf-8") as f:
            json.dump(record, f, indent=2)


def run_apo(settings: LoopSettings, loop: TrainingLoop, endpoint_url: str, policy_version: Callable[[], int],
            log_row: Callable[[dict], None], on_idle: Callable[[float, int], None] | None = None,
            first_row: int = 0) -> list[ResourceResult]:
    """The whole search against the endpoint at ``endpoint_url`` (session.run_training calls it)."""
    from spanrl.trainer_bridge.endpoint_prompts import PromptResourcesClient

    started = time.monotonic()
    endpoint = PromptResourcesClient(endpoint_url, settings.policy_token)
    run = ApoRun(settings, loop, endpoint, policy_version, log_row, on_idle)
    results = run.run(starting_pool(settings.apo), first_row)
    logger.info("apo: done in %.0f s; %s", time.monotonic() - started, os.path.join(settings.output_dir, PROMPTS_FILE))
    return results


def _reward_or_zero(result: RolloutResult) -> float:
    return 0.0 if result.reward is None else result.reward


def _last(scores: list[float | None]) -> float | None:
    return scores[-1] if scores else None


def _score(score: float | None) -> str:
    return "unscored" if score is None else f"{score:.3f}"
