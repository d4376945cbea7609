"""Trajectory merging: the consecutive calls of one rollout as one training row.

A multi-turn agent sends, at each call, the whole conversation so far: the next call's prompt
is the previous prompt + the previous response + what came in between (tool results, a new
user turn). Trained per transition, every call repeats all earlier tokens; merged, a rollout
is one row ``prompt_1 + response_1 + between_1 + response_2 + ...`` in which only the calls'
own response tokens are trained on (``TrainingSample.response_loss_mask``) and each keeps the
advantage of its own call (``token_advantages``). Under ``token-mean`` the merged row's loss
equals the per-transition loss: the same tokens with the same prefixes and advantages.

A call whose prompt does not start exactly with the row so far (the agent rewrote its history,
another agent's call, a re-tokenised message) starts a new row; such prefix mismatches are
counted (``MergeStats.prefix_mismatches``). Called by ``training_loop`` with
``merge_trajectories: true``, on the samples of ``samples.training_samples``; both backends
train on the rows (the torch trainer through its loss mask, verl through ``response_mask``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from .backend import TrainingSample


@dataclass(frozen=True)
class MergeStats:
    """What merging did to one update's samples.

    ``transitions``: samples in; ``rows``: rows out; ``prefix_mismatches``: calls that could
    not extend their rollout's row (a new row started); ``tokens_per_transition`` and
    ``tokens_merged``: prompt + response tokens the update would process without and with
    merging.
    """

    transitions: int
    rows: int
    prefix_mismatches: int
    tokens_per_transition: int
    tokens_merged: int

    def as_metrics(self) -> dict[str, float]:
        """The statistics as a metrics row takes them."""
        return {
            "merged_rows": float(self.rows),
            "merge_prefix_mismatches": float(self.prefix_mismatches),
            "tokens_per_transition": float(self.tokens_per_transition),
            "tokens_merged": float(self.tokens_merged),
        }


@dataclass
class _Row:
    """A row being built: the first call's prompt, then everything after it."""

    first: TrainingSample
    response: list[int]
    loss_mask: list[int]
    advantages: list[float]
    old_logprobs: list[float] | None
    policy_version: int | None
    reward: float

    @classmethod
    def start(cls, sample: TrainingSample) -> _Row:
        old = sample.old_logprobs
        usable = old is not None and len(old) == len(sample.response_token_ids)
        return cls(sample, list(sample.response_token_ids), sample.loss_mask, sample.response_advantages,
                   [float(v) for v in old] if usable and old is not None else None,
                   sample.policy_version, float(sample.reward))

    def sequence_length(self) -> int:
        return len(self.first.prompt_token_ids) + len(self.response)

    def extends_to(self, sample: TrainingSample) -> bool:
        """True when ``sample``'s prompt is this row's tokens followed by (possibly no) more."""
        prompt = sample.prompt_token_ids
        length = self.sequence_length()
        if len(prompt) < length or sample.agent_name != self.first.agent_name:  # one agent per row
            return False
        head = len(self.first.prompt_token_ids)
        return (list(prompt[:head]) == list(self.first.prompt_token_ids)
                and list(prompt[head:length]) == self.response)

    def append(self, sample: TrainingSample) -> None:
        between = list(sample.prompt_token_ids[self.sequence_length():])
        response = list(sample.response_token_ids)
        self.response += between + response
        self.loss_mask += [0] * len(between) + sample.loss_mask
        self.advantages += [0.0] * len(between) + sample.response_advantages
        old = sample.old_logprobs
        if self.old_logprobs is None or old is None or len(old) != len(response):
            self.old_logprobs = None  # one call without engine logprobs: the row's are recomputed
        else:
            self.old_logprobs += [0.0] * len(between) + [float(v) for v in old]
        if sample.policy_version is not None:
            self.policy_version = (sample.policy_version if self.policy_version is None
                                   else min(self.policy_version, sample.policy_version))
        self.reward = float(sample.reward)

    def sample(self) -> TrainingSample:
        if self.response == list(self.first.response_token_ids):
            return self.first  # a row of one call stays that call's sample
        return dataclasses.replace(
            self.first, response_token_ids=self.response, response_loss_mask=self.loss_mask,
            token_advantages=self.advantages, old_logprobs=self.old_logprobs,
            policy_version=self.policy_version, reward=self.reward)


def merge_trajectories(samples: Sequence[TrainingSample]) -> tuple[list[TrainingSample], MergeStats]:
    """``samples`` with each rollout's consecutive calls merged into rows (module docstring).

    Calls are taken per rollout in ``turn_index`` order; a call extends its rollout's last row
    when its prompt starts exactly with that row's prompt + response, else it starts a new row
    (a prefix mismatch). Rows keep the order of their rollouts' first samples.
    """
    by_rollout: dict[str, list[TrainingSample]] = {}
    for sample in samples:
        by_rollout.setdefault(sample.rollout_id, []).append(sample)
    rows: list[_Row] = []
    mismatches = 0
    for calls in by_rollout.values():
        current: _Row | None = None
        for sample in sorted(calls, key=lambda s: s.turn_index):
            if current is not None and current.extends_to(sample):
                current.append(sample)
                continue
            if current is not None:
                mismatches += 1
            current = _Row.start(sample)
            rows.append(current)
    merged = [row.sample() for row in rows]
    stats = MergeStats(
        transitions=len(samples), rows=len(merged), prefix_mismatches=mismatches,
        tokens_per_transition=sum(len(s.prompt_token_ids) + len(s.response_token_ids) for s in samples),
        tokens_merged=sum(len(s.prompt_token_ids) + len(s.response_token_ids) for s in merged),
    )
    return merged, stats


def update_rows(samples: list[TrainingSample], merge: bool) -> tuple[list[TrainingSample], dict[str, float]]:
    """What one update trains on: ``samples`` as they are, or merged (``merge_trajectories``)
    with the merge's statistics for the metrics row (empty without merging)."""
    if not merge or not samples:
        return samples, {}
    rows, stats = merge_trajectories(samples)
    return rows, stats.as_metrics()
