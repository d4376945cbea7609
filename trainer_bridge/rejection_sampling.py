"""SFT from rollouts (``algorithm: sft``): rejection-sampling fine-tuning, live in ``spanrl train``.

Each step the runners play a round as for GRPO; instead of group advantages, the transitions
of every scored rollout whose reward is at least ``sft_min_reward`` become samples of a plain
supervised update: the mean negative log-likelihood of their response tokens (no ratio, no
clipping, no advantage). Rollouts below the threshold are not trained on and are counted.

``sft_samples`` picks the samples (torch-free); ``sft_update`` hands them to the backend's
``sft_update`` (``TorchBackend``: ``torch_backend/sft_update.py``; ``VerlBackend``: verl's
own ``sft_loss`` on the actor worker group, ``verl_backend/sft_update.py``). Called by
``training_loop.TrainingLoop.update``. Offline, over a store's rollouts, the same learning
is ``spanrl sft MODEL --store DB --min-reward R`` (``warm_start.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

from spanrl.errors import UserError
from spanrl.schema.scored import ScoredRollout

from .backend import PolicyBackend, TrainingSample


class SftNotSupported(UserError):
    """The configured backend has no supervised update (``algorithm: sft``)."""


def sft_samples(scored: Sequence[ScoredRollout], min_reward: float) -> tuple[list[TrainingSample], set[str]]:
    """The transitions of rollouts scored at least ``min_reward``, as samples (advantage 1.0:
    the update ignores it), and the ids of the rollouts left below the threshold."""
    samples: list[TrainingSample] = []
    rejected: set[str] = set()
    for item in scored:
        if item.score < min_reward:
            rejected.add(item.attempt.rollout_id)
            continue
        samples += [
            TrainingSample(
                prompt_token_ids=list(t.prompt_token_ids), response_token_ids=list(t.response_token_ids),
                advantage=1.0, group_id=item.attempt.task_id, rollout_id=item.attempt.rollout_id,
                turn_index=t.index, reward=float(item.score), agent_name=t.agent_name,
            )
            for t in item.transitions if t.response_token_ids
        ]
    return samples, rejected


def sft_update(backend: PolicyBackend, samples: Sequence[TrainingSample]) -> dict[str, float]:
    """One supervised update of ``backend`` on ``samples`` (published like a GRPO update); its
    statistics as a metrics dict."""
    update = getattr(backend, "sft_update", None)
    if update is None:
        raise SftNotSupported(f"algorithm 'sft' needs a backend with a supervised update; "
                              f"{type(backend).__name__} has none: use backend torch or verl")
    return dict(update(samples).as_metrics())
