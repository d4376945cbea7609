"""From scored rollouts to training samples: GRPO group advantages for every usable transition.

``training_samples`` is what every backend trains on (so both backends get the same numbers);
``without_uniform_groups`` leaves out the groups whose rewards were all equal
(``drop_uniform_groups``); ``trained_rollout`` is what ``spanrl inspect`` later shows a rollout
was trained with.
Called by ``training_loop.TrainingLoop.update``.
"""

from __future__ import annotations

from spanrl.otlp_receiver.trained_rewards import TrainedRollout
from spanrl.schema.rollouts import Transition
from spanrl.schema.scored import ScoredRollout

from .algorithm import LOSS_WEIGHTINGS
from .backend import TrainingSample


def trained_rollout(step: int, item: ScoredRollout, transition_returns: bool, used: bool,
                    advantages: dict[tuple[str, int], float] | None = None) -> TrainedRollout:
    """What ``training_samples`` trained ``item`` with, as recorded for ``spanrl inspect`` and
    ``spanrl dashboard``; ``advantages``: ``(rollout id, turn index) -> group advantage`` of the
    samples (None: the update had none, e.g. rejection-sampling SFT)."""
    rollout_id = item.attempt.rollout_id
    return TrainedRollout(
        rollout_id=rollout_id, step=step, reward=item.score, reward_source=item.reward_source,
        returns={t.index: (t.return_ if transition_returns else item.score) for t in item.transitions},
        used=used,
        advantages=None if advantages is None else {
            t.index: advantages[(rollout_id, t.index)]
            for t in item.transitions if (rollout_id, t.index) in advantages},
    )


def sample_advantages(samples: list[TrainingSample]) -> dict[tuple[str, int], float]:
    """``(rollout id, turn index) -> group advantage`` (before any loss weight) of ``samples``."""
    return {(s.rollout_id, s.turn_index): s.group_advantage for s in samples}


def training_samples(scored: list[ScoredRollout], level: str, norm_adv_by_std: bool,
                     transition_returns: bool = False, loss_weighting: str = "token",
                     negative_advantage_scale: float = 1.0, positive_advantage_scale: float = 1.0,
                     estimator: str = "grpo") -> tuple[list[TrainingSample], set[str]]:
    """GRPO samples of all usable transitions, with their group advantages.

    ``estimator``: ``grpo`` (Dr.GRPO when ``norm_adv_by_std`` is False) or ``reinforce_plus_plus``
    (the batch as baseline: ``advantages.reinforce_plus_plus_outcome_advantage``).
    ``transition_returns``: score each transition by its own credit-assigned return (reward
    events with ``level="transition"``) instead of its rollout's score.
    ``negative_advantage_scale`` / ``positive_advantage_scale``: negative / positive advantages are
    multiplied by it (1: GRPO as is).
    ``loss_weighting="rollout"``: fold ``advantages.weigh_rollouts_equally`` into the advantages.
    Returns ``(samples, dropped_rollout_ids)``: rollouts of a group of one are dropped.
    """
    from .advantages import group_advantages, weigh_rollouts_equally  # torch: only when training

    if loss_weighting not in LOSS_WEIGHTINGS:
        raise ValueError(f"loss_weighting must be one of {LOSS_WEIGHTINGS}, got {loss_weighting!r}")

    returns: list[float] = []
    groups: list[str] = []
    rollout_ids: list[str] = []
    transitions: list[Transition] = []
    for item in scored:
        for transition in item.transitions:
            returns.append(transition.return_ if transition_returns else item.score)
            groups.append(item.attempt.task_id)
            rollout_ids.append(item.attempt.rollout_id)
            transitions.append(transition)
    if not transitions:
        return [], set()
    advantages, keep = group_advantages(
        returns, groups, rollout_ids, level=level,
        estimator="drgrpo" if estimator == "grpo" and not norm_adv_by_std else estimator,
    )
    if negative_advantage_scale != 1.0 or positive_advantage_scale != 1.0:
        advantages = [a * (negative_advantage_scale if a < 0 else positive_advantage_scale) for a in advantages]
    samples = [
        TrainingSample(
            prompt_token_ids=list(t.prompt_token_ids),
            response_token_ids=list(t.response_token_ids),
            advantage=float(a),
            old_logprobs=None if t.response_logprobs is None else list(t.response_logprobs),
            group_id=g, rollout_id=r, turn_index=t.index, reward=float(ret), policy_version=t.policy_version,
            agent_name=t.agent_name,
        )
        for t, a, k, g, r, ret in zip(transitions, advantages, keep, groups, rollout_ids, returns, strict=True)
        if k and t.response_token_ids
    ]
    if loss_weighting == "rollout" and samples:
        samples = weigh_rollouts_equally(samples)
    dropped = {r for r, k in zip(rollout_ids, keep, strict=True) if not k}
    return samples, dropped


# rewards closer than this count as equal: a group's mean of equal floats can differ from them
# by rounding, which the std normalisation would blow up into a small non-zero advantage
UNIFORM_REWARD_TOLERANCE = 1e-9


def groups_without_signal(scored: list[ScoredRollout]) -> tuple[int, dict[str, int]]:
    """How many task groups of ``scored`` have two or more rollouts, and of those, the ones whose
    rollouts all scored the same, counted by that score (``"0"``: a task no rollout solved). GRPO
    learns nothing from such a group; a task that stays in it step after step is out of reach."""
    step = TaskScores()
    step.add(scored)
    return step.groups(), {score: len(tasks) for score, tasks in step.without_signal().items()}


class TaskScores:
    """The lowest and highest score each task's rollouts got over a run, and how many there were:
    ``without_signal`` names the tasks whose rollouts all scored the same, which no update could
    learn from (GRPO's advantage is 0 there; SFT from rollouts has nothing to imitate in a task
    that always failed). ``spanrl train`` prints them at the end."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[int, float, float]] = {}  # task id -> (rollouts, lowest, highest)

    def add(self, scored: list[ScoredRollout]) -> None:
        for item in scored:
            count, low, high = self._seen.get(item.attempt.task_id, (0, item.score, item.score))
            self._seen[item.attempt.task_id] = (count + 1, min(low, item.score), max(high, item.score))

    def groups(self) -> int:
        """How many tasks have two or more rollouts."""
        return sum(1 for count, _, _ in self._seen.values() if count >= 2)

    def without_signal(self) -> dict[str, list[str]]:
        """``{score: task ids}`` of the tasks with two or more rollouts that all scored ``score``."""
        flat: dict[str, list[str]] = {}
        for task_id, (count, low, high) in sorted(self._seen.items()):
            if count >= 2 and high - low <= UNIFORM_REWARD_TOLERANCE:
                flat.setdefault(f"{low:g}", []).append(task_id)
        return flat


def without_uniform_groups(samples: list[TrainingSample]) -> tuple[list[TrainingSample], set[str], int]:
    """``samples`` less the groups whose samples all carry the same reward (all solved or all
    failed: GRPO's advantages are 0 there). They add nothing to the gradient, but their tokens
    count in ``token-mean``'s denominator, so dropping them is DAPO's group filter without its
    resampling. Per-rollout loss weights are recomputed over what is kept.

    Returns ``(kept samples, rollout ids left out, number of groups left out)``.
    """
    from .advantages import weigh_rollouts_equally  # torch: only when training

    rewards: dict[str, list[float]] = {}
    for sample in samples:
        rewards.setdefault(sample.group_id, []).append(sample.reward)
    uniform = {group for group, values in rewards.items()
               if max(values) - min(values) <= UNIFORM_REWARD_TOLERANCE}
    kept = [s for s in samples if s.group_id not in uniform]
    left_out = {s.rollout_id for s in samples if s.group_id in uniform}
    if kept and any(s.loss_weight is not None for s in kept):
        kept = weigh_rollouts_equally(kept)
    return kept, left_out, len(uniform)
