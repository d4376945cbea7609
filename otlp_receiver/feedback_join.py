"""An assembled rollout with the feedback that arrived after it: its rewards, total and returns.

Called by the trainer side (``spanrl inspect rollout``, and whoever trains on late feedback)
with what ``FeedbackStore.feedback_of`` returned. Pure: the stored rollout never changes (a
trainer that read it keeps what it read); this builds the rollout as it reads now. Each joined
feedback becomes a ``Reward`` (``source`` ``feedback:<how it came>``: ``feedback:http``,
``feedback:gen_ai.evaluation.result``, ``feedback:spanrl.reward``) on the call it judges, or on
the rollout; the total and each transition's reward and return are computed again with the
receiver's credit assignment (``credit.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from spanrl.otlp_receiver.credit import credit_function
from spanrl.otlp_receiver.feedback_store import JOINED, StoredFeedback
from spanrl.schema.rollouts import AssembledRollout, Reward

FEEDBACK_SOURCE_PREFIX = "feedback:"


def feedback_reward(stored: StoredFeedback) -> Reward:
    """The reward a joined feedback adds to its rollout."""
    f = stored.feedback
    return Reward(name=f.name, value=f.value, source=FEEDBACK_SOURCE_PREFIX + f.source,
                  span_id=f.carrier_span_id or "", call_span_id=stored.call_span_id)


def with_feedback(rollout: AssembledRollout, joined: Sequence[StoredFeedback], credit: str = "identical",
                  gamma: float = 1.0) -> AssembledRollout:
    """``rollout`` with the rewards of ``joined`` (feedback of this rollout) added."""
    added = [feedback_reward(s) for s in joined if s.state == JOINED and s.rollout_id == rollout.rollout_id]
    if not added:
        return rollout
    rewards = (*rollout.rewards, *added)
    per_call: dict[str, float] = {}
    for reward in added:
        if reward.call_span_id is not None:
            per_call[reward.call_span_id] = per_call.get(reward.call_span_id, 0.0) + reward.value
    total = sum(r.value for r in rewards)
    steps = [t.reward + per_call.get(t.span_id, 0.0) for t in rollout.transitions]
    returns = credit_function(credit)(steps, total, gamma)
    transitions = tuple(replace(t, reward=steps[i], return_=returns[i]) for i, t in enumerate(rollout.transitions))
    return replace(rollout, rewards=rewards, total_reward=total, transitions=transitions)
