"""Training from served traffic: a rolling window of rollouts whose feedback has arrived.

The core of ``spanrl train --from-traffic`` (``traffic_loop.py`` runs the steps; docs/algorithms.md
"Training from traffic"). There is no task list and no runner: agents serve
real requests through the policy endpoint, the receiver assembles each conversation into a
rollout, and feedback arrives later (``otlp_receiver/feedback_store.py``). ``TrafficWindow``
reads both from the store: a rollout waits in the window (at most ``window_size``, at most
``max_age_s`` old; what falls out unjudged is counted) until its score is known (its own reward
events, or joined late feedback: ``feedback_join.with_feedback``), then ``take`` hands it out
once. ``traffic_samples`` turns a batch into training samples through the loop's own GRPO code
(``samples.training_samples``): rollouts whose first prompt is the same (a hash of its first
``prefix_tokens`` prompt token ids) form a group and are scored against the group mean; a rollout
alone in its group is scored against its agent's running mean of rewards (``AgentBaselines``)
instead of being dropped.

Trade-offs (docs/algorithms.md): the data are off-policy (served by older policy versions; the
engine's logprobs let the update's ratio correct for it, within its clip), feedback may judge a
call many versions ago (``max_age_s`` bounds it), and a per-agent baseline has more variance
than a group of answers to the same prompt.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from spanrl.bridge_protocol import Attempt
from spanrl.schema.rollouts import AssembledRollout
from spanrl.schema.scored import ScoredRollout

from .backend import TrainingSample

LEFT_OUT_TOO_OLD = "aged_out_without_feedback"
LEFT_OUT_WINDOW_FULL = "window_full_without_feedback"
LEFT_OUT_NO_TRANSITION = "no_transition"
SOURCE = "traffic"


@dataclass(frozen=True)
class TrafficSettings:
    window_size: int = 1024  # rollouts kept waiting for their feedback
    max_age_s: float = 3600.0  # a rollout older than this (since it was read) leaves the window
    prefix_tokens: int = 0  # group by the first N prompt tokens of the first call (0: the whole prompt)
    baseline_decay: float = 0.9  # the per-agent running mean: b <- decay * b + (1 - decay) * score

    def __post_init__(self) -> None:
        if self.window_size < 1 or self.max_age_s <= 0 or self.prefix_tokens < 0:
            raise ValueError("window_size >= 1, max_age_s > 0 and prefix_tokens >= 0 are required, got "
                             f"{self.window_size}, {self.max_age_s}, {self.prefix_tokens}")
        if not 0.0 <= self.baseline_decay < 1.0:
            raise ValueError(f"baseline_decay must lie in [0, 1), got {self.baseline_decay}")


@dataclass
class _Waiting:
    rollout: AssembledRollout
    read_at: float


class TrafficWindow:
    """Assembled rollouts and their late feedback, read from the store, handed out once judged."""

    def __init__(self, store_path: str, settings: TrafficSettings, credit: str = "identical",
                 gamma: float = 1.0) -> None:
        from spanrl.otlp_receiver.feedback_store import FeedbackStore
        from spanrl.otlp_receiver.store import SpanStore

        self.settings = settings
        self.credit, self.gamma = credit, gamma
        self.spans = SpanStore(store_path)
        self.feedback = FeedbackStore(store_path)
        self.rollout_cursor = 0
        self.feedback_cursor = 0
        self.waiting: OrderedDict[str, _Waiting] = OrderedDict()
        self.left_out: Counter = Counter()
        self.trained: set[str] = set()  # rollouts trained on already (a resumed run skips them)

    def close(self) -> None:
        self.spans.close()
        self.feedback.close()

    def poll(self, now: float | None = None) -> None:
        """Read what the store assembled and joined since the last poll; drop what is too old."""
        now = time.time() if now is None else now
        rollouts, self.rollout_cursor = self.spans.completed_rollouts(since=self.rollout_cursor)
        for rollout in rollouts:
            if rollout.rollout_id in self.trained:
                continue
            if not rollout.transitions:
                self.left_out[LEFT_OUT_NO_TRANSITION] += 1
                continue
            self.waiting[rollout.rollout_id] = _Waiting(rollout, now)
        while len(self.waiting) > self.settings.window_size:
            self.waiting.popitem(last=False)
            self.left_out[LEFT_OUT_WINDOW_FULL] += 1
        for rollout_id in [r for r, w in self.waiting.items() if now - w.read_at > self.settings.max_age_s]:
            del self.waiting[rollout_id]
            self.left_out[LEFT_OUT_TOO_OLD] += 1
        joined, self.feedback_cursor = self.feedback.joined_since(self.feedback_cursor)
        from spanrl.otlp_receiver.feedback_join import with_feedback

        for stored in joined:  # feedback for a rollout no longer (or never) in the window is not trained on
            item = self.waiting.get(stored.rollout_id or "")
            if item is not None:
                item.rollout = with_feedback(item.rollout, [stored], self.credit, self.gamma)

    def judged(self) -> list[AssembledRollout]:
        """The rollouts in the window whose score is known, oldest first."""
        return [w.rollout for w in self.waiting.values() if w.rollout.total_reward is not None]

    def take(self, limit: int) -> list[AssembledRollout]:
        """Up to ``limit`` judged rollouts, oldest first, removed from the window (trained once)."""
        taken = self.judged()[:limit]
        for rollout in taken:
            del self.waiting[rollout.rollout_id]
            self.trained.add(rollout.rollout_id)
        return taken


def group_key(rollout: AssembledRollout, prefix_tokens: int = 0) -> str:
    """The rollout's group: a hash of its first call's prompt token ids (the first ``prefix_tokens``)."""
    prompt = rollout.transitions[0].prompt_token_ids
    if prefix_tokens:
        prompt = prompt[:prefix_tokens]
    return hashlib.sha256(",".join(map(str, prompt)).encode()).hexdigest()[:16]


@dataclass
class AgentBaselines:
    """Each agent's running mean of rewards: the baseline of a rollout alone in its group."""

    decay: float = 0.9
    means: dict[str, float] = field(default_factory=dict)

    def advantage(self, agent: str, score: float) -> float:
        """``score`` minus the agent's baseline (0 for its first rollout), then the baseline moves."""
        mean = self.means.get(agent)
        self.means[agent] = score if mean is None else self.decay * mean + (1.0 - self.decay) * score
        return 0.0 if mean is None else score - mean


def scored_traffic(rollouts: Sequence[AssembledRollout], step: int, prefix_tokens: int = 0) -> list[ScoredRollout]:
    """Judged ``rollouts`` as the loop's scored rollouts: the task id is the prompt group."""
    return [ScoredRollout(Attempt(r.rollout_id, group_key(r, prefix_tokens), 0, {}, step),
                          float(r.total_reward or 0.0), r.transitions, SOURCE) for r in rollouts]


def traffic_samples(rollouts: Sequence[AssembledRollout], baselines: AgentBaselines, step: int,
                    prefix_tokens: int = 0, norm_adv_by_std: bool = True,
                    ) -> tuple[list[TrainingSample], dict[str, int]]:
    """Samples of judged ``rollouts``: grouped rollouts by GRPO, the others by their agent's
    baseline. Returns the samples and how many rollouts went each way."""
    from .samples import training_samples

    scored = scored_traffic(rollouts, step, prefix_tokens)
    sizes = Counter(item.attempt.task_id for item in scored)
    grouped = [item for item in scored if sizes[item.attempt.task_id] > 1]
    alone = [item for item in scored if sizes[item.attempt.task_id] == 1]
    samples, _ = training_samples(grouped, "rollout", norm_adv_by_std) if grouped else ([], set())
    for item in grouped:  # the grouped rollouts' scores move their agents' baselines too
        baselines.advantage(_agent(item), item.score)
    for item in alone:
        advantage = baselines.advantage(_agent(item), item.score)
        samples += [TrainingSample(
            prompt_token_ids=list(t.prompt_token_ids), response_token_ids=list(t.response_token_ids),
            advantage=advantage, old_logprobs=None if t.response_logprobs is None else list(t.response_logprobs),
            group_id=f"agent:{_agent(item)}", rollout_id=item.attempt.rollout_id, turn_index=t.index,
            reward=item.score, policy_version=t.policy_version, agent_name=t.agent_name)
            for t in item.transitions if t.response_token_ids and advantage != 0.0]
    return samples, {"grouped": len(grouped), "by_agent_baseline": len(alone)}


def _agent(item: ScoredRollout) -> str:
    return item.transitions[0].agent_name or ""
