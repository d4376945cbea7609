"""Reward of the retrieval QA agent: exact match of its answer with the gold answer (1.0 or 0.0).

Answers are compared after SQuAD's normalisation (lower case, punctuation and the articles a/an/the
removed, spaces collapsed). ``token_f1`` (SQuAD's token-level F1) is there for a softer reward
(``reward: spanrl.examples.retrieval_qa.reward:f1_reward``); the answers here are one word, so it
scores as exact match does. ``chain_reward`` is graded: an answer that names an entity on the
question's chain (the task's ``hops``, e.g. the city on the way to the country) earns part of the
reward, so rollouts that failed can still be told apart (train on it with ``val_reward_fn: ...:reward``,
so held-out accuracy stays exact match). Measured, it makes GRPO worse (docs/results.md, "a graded
reward on retrieval QA"): stopping a hop short is what the warm start already does wrong, and this
reward pays it. ``search_reward`` grades the way instead of the answer: a wrong answer earns part of
the reward for each entity of the chain the agent's searches reached (read from its calls' tool
results, ``reward(task, variables, calls)``); ``search_step_rewards`` gives that credit to the
search calls that earned it, as per-call rewards, and judges the answer by exact match alone. The
runner records the agent's return
value as the variable ``output``; ``reward(task, variables)`` is what ``train.yaml`` names.
"""

from __future__ import annotations

import re
import string
from collections import Counter

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize(text: str) -> str:
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def exact_match(answer: str, gold: str) -> float:
    return 1.0 if normalize(answer) == normalize(gold) and normalize(gold) else 0.0


def token_f1(answer: str, gold: str) -> float:
    predicted, expected = normalize(answer).split(), normalize(gold).split()
    common = sum((Counter(predicted) & Counter(expected)).values())
    if not common:
        return 0.0
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)


def reward(task: dict, variables: dict) -> float:
    return exact_match(str(variables.get("output", "")), task["answer"])


def f1_reward(task: dict, variables: dict) -> float:
    return token_f1(str(variables.get("output", "")), task["answer"])


CHAIN_CREDIT = 0.5  # what an answer one step short of the gold answer earns at most


def chain_credit(answer: str, gold: str, hops: list) -> float:
    """1.0 for the gold answer; ``CHAIN_CREDIT * k / len(hops)`` for an answer that names the k-th
    entity of the chain (``hops[0]`` is the question's own subject: 0); else 0."""
    if exact_match(answer, gold):
        return 1.0
    said = normalize(answer)
    reached = [k for k, entity in enumerate(hops) if said and said == normalize(str(entity))]
    return CHAIN_CREDIT * max(reached) / len(hops) if reached else 0.0


def chain_reward(task: dict, variables: dict) -> float:
    return chain_credit(str(variables.get("output", "")), task["answer"], list(task.get("hops", [])))


SEARCH_CREDIT = 0.5  # what a wrong answer earns at most, when the searches reached the whole chain


def tool_results(calls: list) -> str:
    """The text of every tool result the agent's calls were shown (their prompts' ``tool`` messages)."""
    return "\n".join(str(m.get("content") or "") for call in calls for m in call["messages"] if m.get("role") == "tool")


def chain_after_subject(task: dict) -> list[str]:
    """The task's chain after its subject, normalised: ``hops[1:]`` and the answer. Each entity is
    found only by a search on the one before it."""
    return [normalize(str(entity)) for entity in (*task.get("hops", [])[1:], task["answer"])]


def named_in(entities: list[str], calls: list) -> set[str]:
    """The (normalised) ``entities`` that the tool results of ``calls`` name as whole words."""
    seen = f" {normalize(tool_results(calls))} "
    return {entity for entity in entities if f" {entity} " in seen}


def chain_reached(task: dict, calls: list) -> float:
    """The share of the task's chain after its subject that the tool results named."""
    chain = chain_after_subject(task)
    return len(named_in(chain, calls)) / len(chain)


def search_reward(task: dict, variables: dict, calls: list) -> float:
    """1.0 for the gold answer; else ``SEARCH_CREDIT`` times the share of the chain the searches reached."""
    if reward(task, variables):
        return 1.0
    return SEARCH_CREDIT * chain_reached(task, calls)


def search_steps(task: dict, calls: list) -> list[float]:
    """Per call, ``SEARCH_CREDIT`` times the share of the chain first shown by the search it made
    (that search's result is a ``tool`` message of the next call's prompt); 0 for other calls."""
    chain = chain_after_subject(task)
    found: set[str] = set()
    credits = [0.0] * len(calls)
    for index, call in enumerate(calls):
        new = named_in(chain, [call]) - found
        if new and index > 0:
            credits[index - 1] += SEARCH_CREDIT * len(new) / len(chain)
        found |= new
    return credits


def search_step_rewards(task: dict, variables: dict, calls: list) -> dict:
    """The outcome (exact match) and, as the calls' own rewards, the credit of each search that
    reached a new entity of the chain (``search_steps``). With ``advantage_level: transition`` the
    answering call is judged by the answer alone; the searches by the answer and what they found."""
    return {"outcome": reward(task, variables), "calls": search_steps(task, calls)}
