"""Reward of the retrieval QA agent: exact match of its answer with the gold answer (1.0 or 0.0).

Answers are compared after SQuAD's normalisation (lower case, punctuation and the articles a/an/the
removed, spaces collapsed). ``token_f1`` (SQuAD's token-level F1) is there for a softer reward
(``reward: spanrl.examples.retrieval_qa.reward:f1_reward``). The runner records the agent's return
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
