"""The beam search of automatic prompt optimization, over one prompt resource's candidates.

As ProTeGi and agent-lightning's APO: the starting pool is scored on a batch of training tasks and
the best ``beam_width`` are kept; then, each round, the optimizer writes ``branch_factor`` edits of
every kept candidate from its lowest-reward rollouts (a critique, the "textual gradient", then an
edited prompt), the kept candidates and their edits are scored on a fresh batch (the same tasks
for all, so they compare fairly), and the best ``beam_width`` are kept again. Every kept candidate
is scored once on the held-out tasks; the best prompt is the one with the highest held-out score
ever seen (the history best: a round that makes the beam worse does not lose it; ties go to the
older candidate). Without held-out tasks it is the last round's best.

This module decides only: running rollouts, scoring them and calling the optimizer are the
callables ``ApoSearch`` is given (``apo/run.py`` gives the real ones), so the search reads as
the algorithm. Stdlib only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Candidate:
    """One prompt candidate: its name on the endpoint, its instructions, and what it was edited from."""

    name: str
    text: str
    parent: str | None = None


@dataclass
class Evaluation:
    """How one candidate did in one round: the reward of each of its rollouts that counts, and
    the rollouts themselves (whatever the evaluator keeps, for the optimizer to read)."""

    candidate: Candidate
    rewards: list[float] = field(default_factory=list)
    rollouts: list[Any] = field(default_factory=list)

    @property
    def score(self) -> float | None:
        return sum(self.rewards) / len(self.rewards) if self.rewards else None


@dataclass(frozen=True)
class RoundReport:
    """What one round did (round 0 scores the starting pool)."""

    round: int
    evaluations: list[Evaluation]
    proposed: int  # new candidates the optimizer wrote (usable ones)
    dropped: int  # optimizer answers that were unusable
    beam: list[Candidate]
    validation: dict[str, float | None]  # candidate name -> held-out score (those scored this round)
    best: Candidate
    best_score: float | None  # the best's held-out score, else its training score


@dataclass(frozen=True)
class Proposals:
    """The optimizer's usable edits of one candidate and how many answers were dropped."""

    candidates: list[Candidate]
    dropped: int = 0


Evaluate = Callable[[Sequence[Candidate], int], dict[str, Evaluation]]
Validate = Callable[[Sequence[Candidate], int], dict[str, float | None]]
Propose = Callable[[Evaluation, int, int], Proposals]  # (parent's evaluation, how many, round)


class ApoSearch:
    """Beam search over the candidates of one resource (module docstring)."""

    def __init__(self, evaluate: Evaluate, propose: Propose | None, validate: Validate | None,
                 beam_width: int, branch_factor: int, rounds: int) -> None:
        self.evaluate, self.propose, self.validate = evaluate, propose, validate
        self.beam_width, self.branch_factor, self.rounds = beam_width, branch_factor, rounds
        self.held_out: dict[str, float | None] = {}  # every validated candidate's score
        self.seen: list[Candidate] = []  # in the order they joined the search
        self.last_evaluations: dict[str, Evaluation] = {}  # the latest round's, by candidate name

    def run(self, pool: Sequence[Candidate], on_round: Callable[[RoundReport], None] | None = None) -> Candidate:
        """Search from ``pool``; the best candidate found. ``on_round`` hears every round."""
        if not pool:
            raise ValueError("the search needs at least one starting candidate")
        self.seen = list(pool)
        beam = self._round(0, list(pool), Proposals([]), on_round)
        for number in range(1, self.rounds + 1):
            proposals = self._proposals(beam, number)
            self.seen.extend(proposals.candidates)
            beam = self._round(number, beam + proposals.candidates, proposals, on_round)
        return self.best(beam)[0]

    def _proposals(self, beam: list[Candidate], number: int) -> Proposals:
        if self.propose is None or self.branch_factor < 1:
            return Proposals([])
        written: list[Candidate] = []
        dropped = 0
        for parent in beam:
            evaluation = self.last_evaluations.get(parent.name)
            if evaluation is None:
                continue
            proposals = self.propose(evaluation, self.branch_factor, number)
            written.extend(proposals.candidates)
            dropped += proposals.dropped
        return Proposals(written, dropped)

    def _round(self, number: int, candidates: list[Candidate], proposals: Proposals,
               on_round: Callable[[RoundReport], None] | None) -> list[Candidate]:
        evaluations = self.evaluate(candidates, number)
        self.last_evaluations = evaluations
        order = {c.name: i for i, c in enumerate(candidates)}
        # unscored candidates (every rollout left out) rank last; ties keep the older candidate
        ranked = sorted(candidates, key=lambda c: (-_or_minus_inf(evaluations[c.name].score), order[c.name]))
        beam = ranked[: self.beam_width]
        new_scores: dict[str, float | None] = {}
        if self.validate is not None:
            due = [c for c in beam if c.name not in self.held_out]
            if due:
                new_scores = self.validate(due, number)
                self.held_out.update(new_scores)
        best, best_score = self.best(beam)
        report = RoundReport(number, [evaluations[c.name] for c in candidates], len(proposals.candidates),
                             proposals.dropped, beam, new_scores, best, best_score)
        logger.info("apo round %d: %s; beam %s; best %s (%s)", number,
                    ", ".join(f"{e.candidate.name} {_shown(e.score)}" for e in report.evaluations),
                    [c.name for c in beam], best.name, _shown(best_score))
        if on_round is not None:
            on_round(report)
        return beam

    def best(self, beam: list[Candidate]) -> tuple[Candidate, float | None]:
        """The history best by held-out score (ties: the older), else the beam's first."""
        validated = [c for c in self.seen if self.held_out.get(c.name) is not None]
        if validated:
            chosen = max(validated, key=lambda c: (self.held_out[c.name], -self.seen.index(c)))
            return chosen, self.held_out[chosen.name]
        evaluation = self.last_evaluations.get(beam[0].name)
        return beam[0], evaluation.score if evaluation else None


def _or_minus_inf(score: float | None) -> float:
    return float("-inf") if score is None else score


def _shown(score: float | None) -> str:
    return "unscored" if score is None else f"{score:.3f}"
