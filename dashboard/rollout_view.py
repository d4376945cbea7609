"""What the rollout page shows of one rollout: its span tree with rewards on the calls they
judged, and each transition's prompt and response as text with every token marked.

Called by ``pages.py`` with a ``run_queries.StoredRollout``. The tree is the receiver's own
(``otlp_receiver.span_tree.SpanTree``, the one ``spanrl inspect rollout`` prints). A response
token is *trained* when its call was in the update (the rollout was used and the trainer
recorded a return for that call); prompt tokens are context, never trained (masked).
"""

from __future__ import annotations

from dataclasses import dataclass

from spanrl.otlp_receiver.span_tree import SpanTree, records_from_bodies

from .run_queries import StoredRollout
from .token_view import TokenDecoder


@dataclass(frozen=True)
class RewardMark:
    """A reward (an event or an AIR rule's) as placed on the tree."""

    name: str
    value: float
    source: str
    emitted_on: str  # the span that carried the event or matched the rule


@dataclass(frozen=True)
class SpanLine:
    """One line of the span tree."""

    span_id: str
    name: str
    depth: int
    kind: str | None
    start_ms: float     # after the rollout's first span started
    duration_ms: float
    error: bool
    status_message: str
    transition: int | None     # the transition index when this span is an LLM call of it
    rewards: tuple[RewardMark, ...]


def span_lines(item: StoredRollout) -> tuple[list[SpanLine], list[str]]:
    """The tree in depth-first order, and the problems building it found."""
    tree = SpanTree(records_from_bodies(item.span_bodies))
    rollout = item.rollout
    calls = {} if rollout is None else {t.span_id: t.index for t in rollout.transitions}
    judged: dict[str, list[RewardMark]] = {}
    for reward in () if rollout is None else rollout.rewards:
        # placed on the call it judges; a reward with no call stays where it was emitted
        at = reward.call_span_id or reward.span_id
        judged.setdefault(at, []).append(RewardMark(reward.name, reward.value, reward.source, reward.span_id))
    origin = tree.root.start_ns if tree.order else 0
    lines = [
        SpanLine(
            span_id=record.key, name=record.name, depth=tree.depth(record), kind=record.span_kind,
            start_ms=(record.start_ns - origin) / 1e6, duration_ms=(record.end_ns - record.start_ns) / 1e6,
            error=record.status_error, status_message=record.status_message,
            transition=calls.get(record.key), rewards=tuple(judged.get(record.key, ())),
        )
        for record in tree.order
    ]
    return lines, list(tree.problems)


@dataclass(frozen=True)
class TokenMark:
    """One response token: its text, id, the engine's log-prob, whether it was trained on."""

    text: str
    token_id: int
    logprob: float | None
    trained: bool


@dataclass(frozen=True)
class TransitionView:
    index: int
    span_id: str
    agent: str | None
    policy_version: int | None
    reward: float                 # the reward events at this call
    trained_return: float | None  # the return the trainer used, else None
    receiver_return: float        # the receiver's credit-assigned return
    advantage: float | None       # the GRPO advantage it was trained with (None: not recorded)
    trained: bool
    why_not_trained: str | None
    prompt_text: str | None       # None without a tokenizer
    prompt_ids: tuple[int, ...]
    tokens: tuple[TokenMark, ...]
    retokenized: bool


def _why_not_trained(item: StoredRollout, index: int) -> str | None:
    trained = item.trained
    if trained is None:
        return "the trainer did not score this rollout (not trained)"
    if not trained.used:
        return f"scored at step {trained.step} but left out of the update (a group of one, or below sft_min_reward)"
    if index not in trained.returns:
        return "this call's agent was not selected for training (agents:)"
    return None


def transition_views(item: StoredRollout, decoder: TokenDecoder | None) -> list[TransitionView]:
    """Every transition of the rollout, decoded when a tokenizer is known."""
    if item.rollout is None:
        return []
    views = []
    for t in item.rollout.transitions:
        why = _why_not_trained(item, t.index)
        logprobs = t.response_logprobs or ()
        pieces = decoder.pieces(t.response_token_ids) if decoder else [f"[{i}]" for i in t.response_token_ids]
        tokens = tuple(
            TokenMark(piece, token_id, logprobs[n] if n < len(logprobs) else None, why is None)
            for n, (piece, token_id) in enumerate(zip(pieces, t.response_token_ids, strict=True))
        )
        trained = item.trained
        views.append(TransitionView(
            index=t.index, span_id=t.span_id, agent=t.agent_name, policy_version=t.policy_version,
            reward=t.reward, trained_return=None if trained is None else trained.returns.get(t.index),
            receiver_return=t.return_,
            advantage=None if trained is None or trained.advantages is None else trained.advantages.get(t.index),
            trained=why is None, why_not_trained=why,
            prompt_text=decoder.text(t.prompt_token_ids) if decoder else None,
            prompt_ids=t.prompt_token_ids, tokens=tokens, retokenized=t.retokenized,
        ))
    return views
