"""The judge's request and answer: the prompt for one group, and its JSON answer read back.

``group_prompt`` writes one request for a whole GRPO group: the rubric, the task once, then each
member's text (its calls, tool results and variables, each cut to ``judge.max_chars``), and asks for
JSON only: ``{"scores": [{"run": 1, "score": 0.7, "explanation": "..."}, ...]}``, one entry per run,
each score in [0, 1], scored relative to each other. ``parse_answer`` reads that back and raises
``JudgeAnswerError`` with the reason when it cannot be used (no JSON object, the wrong number of
scores, a score that is not a number in [0, 1]): the group is then left out, never scored 0.
Called by ``group_judge.py``; stdlib only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

MAX_EXPLANATION_CHARS = 500  # what is kept of each explanation (stored and shown by spanrl inspect)

PROMPT = """You are a judge. Several runs of an AI agent tried the same task. Score each run with \
respect to the rubric, comparing the runs with each other: a better run gets a higher score.

Rubric:
<rubric>
{rubric}
</rubric>

The task:
<task>
{task}
</task>

The runs (each one's model calls, tool results and final variables):
{runs}

Answer with JSON only, no other text, in exactly this form, with one entry for each of the {count} runs \
in order:
{{"scores": [{{"run": 1, "score": <a number from 0 to 1>, "explanation": "<one short sentence>"}}, ...]}}"""


class JudgeAnswerError(Exception):
    """The judge's answer cannot be used for its group; the message says why."""


@dataclass(frozen=True)
class Verdict:
    """The judge's score of one member of a group and why."""

    score: float
    explanation: str


def group_prompt(rubric: str, task: str, members: Sequence[str]) -> str:
    """The one request of a group: ``members`` are the runs' texts, in order."""
    runs = "\n\n".join(f"<run {n}>\n{text}\n</run {n}>" for n, text in enumerate(members, 1))
    return PROMPT.format(rubric=rubric.strip(), task=task, runs=runs, count=len(members))


def parse_answer(answer: str, count: int) -> list[Verdict]:
    """The ``count`` verdicts of a judge's ``answer``, in run order; ``JudgeAnswerError`` when unusable."""
    data = _json_object(answer)
    entries = data.get("scores") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise JudgeAnswerError(f"the answer has no \"scores\" list ({_excerpt(answer)})")
    if len(entries) != count:
        raise JudgeAnswerError(f"the answer has {len(entries)} scores for a group of {count} runs")
    verdicts = []
    for number, entry in enumerate(_in_run_order(entries, count), 1):
        score = entry.get("score") if isinstance(entry, dict) else entry
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
            raise JudgeAnswerError(f"run {number}'s score is not a number: {score!r}")
        if not 0.0 <= score <= 1.0:
            raise JudgeAnswerError(f"run {number}'s score {score} is outside [0, 1]")
        explanation = entry.get("explanation", "") if isinstance(entry, dict) else ""
        verdicts.append(Verdict(float(score), str(explanation or "")[:MAX_EXPLANATION_CHARS]))
    return verdicts


def _json_object(answer: str) -> Any:
    """The JSON object in ``answer``: all of it, or the span from its first ``{`` to its last ``}``
    (a model may wrap it in a code fence or a sentence)."""
    text = answer.strip()
    for candidate in (text, text[text.find("{"): text.rfind("}") + 1] if "{" in text else ""):
        if not candidate:
            continue
        try:
            return json.loads(candidate)
        except ValueError:
            continue
    raise JudgeAnswerError(f"the answer is not JSON ({_excerpt(answer)})")


def _in_run_order(entries: list, count: int) -> list:
    """``entries`` ordered by their ``run`` numbers when each names a distinct one of 1..count; else as given."""
    runs = [e.get("run") if isinstance(e, dict) else None for e in entries]
    if sorted(r for r in runs if isinstance(r, int)) == list(range(1, count + 1)):
        return sorted(entries, key=lambda e: e["run"])
    return entries


def _excerpt(text: str, limit: int = 80) -> str:
    flat = " ".join(text.split())
    if not flat:
        return f"only whitespace: {text[:limit]!r}"
    return repr(flat if len(flat) <= limit else flat[:limit] + "...")
