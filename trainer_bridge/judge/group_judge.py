"""``reward: judge``: each GRPO group's members scored together by a judge model, in one request.

``TrainingLoop.collect`` (training, validation, ``spanrl eval``) first scores each rollout alone
(``scoring.RolloutScorer``: with ``judge.combine_with``, that function's value; else nothing yet),
then hands the scored rollouts to ``GroupJudge.score_groups``. A group is the scored rollouts of one
task in one round (the rollouts GRPO compares). For each group the judge gets one chat request
(``answer.group_prompt``: the rubric, the task, each member's calls, tool results and variables,
bounded) through the real ``openai`` client, at most ``judge.concurrency`` at once, and answers one
score in [0, 1] and an explanation per member. A member's reward is the judge's score, or
``weight * judge + (1 - weight) * combine_with`` (``JudgeConfig.combined``).

A judge that fails (the endpoint down or answering an error, an answer that is not the JSON asked
for, the wrong number of scores) leaves its whole group out with ``LEFT_OUT_JUDGE_FAILED`` and a
logged warning saying why: a group is never scored 0 silently. The scores are recorded in the store
as ``gen_ai.evaluation.result`` events with the explanations (``otlp_receiver/judge_evaluations``),
which ``spanrl inspect rollout ID`` shows. The API key is read from ``judge.api_key_env`` and never
logged. Torch-free.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sqlite3
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from spanrl.otlp_receiver import judge_evaluations
from spanrl.otlp_receiver.judge_evaluations import JudgeEvaluation
from spanrl.schema.rollouts import AssembledRollout
from spanrl.schema.scored import ScoredRollout

from ..apo.rollout_text import RolloutText, cut_text, task_text
from ..scoring import LEFT_OUT_JUDGE_FAILED
from .answer import JudgeAnswerError, Verdict, group_prompt, parse_answer
from .config import JudgeConfig

logger = logging.getLogger(__name__)

MAX_TASK_CHARS = 4000  # the task is shown once per request, cut to this


class JudgeRequestError(Exception):
    """The judge's request failed (endpoint down, an HTTP error, an empty answer); the message says why."""


class GroupJudge:
    """Scores groups of rollouts with the judge of a ``judge:`` block (module docstring)."""

    def __init__(self, config: JudgeConfig, store: Any, store_path: str, model_dir: str = "",
                 environ: Mapping[str, str] | None = None) -> None:
        from openai import OpenAI

        environ = os.environ if environ is None else environ
        key = environ.get(config.api_key_env, "")
        if not key:
            logger.info("judge: %s is not set; calling the judge at %s without an API key", config.api_key_env,
                        config.url)
        self.config, self.store_path = config, store_path
        self.client = OpenAI(base_url=config.url, api_key=key or "none", max_retries=1, timeout=config.timeout_s)
        self.text = RolloutText(model_dir, config.max_chars, store)
        self.source = f"judge {config.model}" + (f" x{config.weight:g} + {config.combine_with}"
                                                 if config.combine_with else "")

    def score_groups(self, scored: Sequence[ScoredRollout], rollouts: Mapping[str, AssembledRollout],
                     reasons: dict[str, str]) -> list[ScoredRollout]:
        """``scored`` with the judge's rewards; members of a group whose judging failed are left out
        (their reason, ``LEFT_OUT_JUDGE_FAILED``, goes into ``reasons``)."""
        groups: dict[tuple[int, str], list[ScoredRollout]] = {}
        for item in scored:
            groups.setdefault((item.attempt.step, item.attempt.task_id), []).append(item)
        prompts = [self.prompt(members, rollouts) for members in groups.values()]
        with ThreadPoolExecutor(max_workers=min(self.config.concurrency, max(len(prompts), 1))) as pool:
            answers = list(pool.map(self._verdicts, prompts, [len(m) for m in groups.values()]))
        judged: list[ScoredRollout] = []
        evaluations: list[JudgeEvaluation] = []
        for (_, task_id), members, verdicts in zip(groups.keys(), groups.values(), answers, strict=True):
            if isinstance(verdicts, str):
                logger.warning("judge: the group of task %s (%d rollouts) is left out: %s", task_id, len(members),
                               verdicts)
                reasons.update({m.attempt.rollout_id: LEFT_OUT_JUDGE_FAILED for m in members})
                continue
            for member, verdict in zip(members, verdicts, strict=True):
                reward = self.config.combined(verdict.score, member.score if self.config.combine_with else None)
                judged.append(dataclasses.replace(member, score=reward, reward_source=self.source))
                evaluations.append(JudgeEvaluation(member.attempt.rollout_id, verdict.score, reward,
                                                   verdict.explanation, self.config.model, len(members)))
        self._record(evaluations)
        return judged

    def prompt(self, members: Sequence[ScoredRollout], rollouts: Mapping[str, AssembledRollout]) -> str:
        """The one request of a group: its task once, each member's calls and variables."""
        texts = []
        for member in members:
            rollout = rollouts.get(member.attempt.rollout_id)
            body = self.text.body(None, rollout)
            if rollout is not None and rollout.variables:
                body += "\nvariables: " + json.dumps(dict(rollout.variables), ensure_ascii=False, default=str)
            texts.append(cut_text(body, self.config.max_chars))
        task = cut_text(task_text(members[0].attempt.task), MAX_TASK_CHARS)
        return group_prompt(self.config.rubric, task, texts)

    def _verdicts(self, prompt: str, count: int) -> list[Verdict] | str:
        """The group's verdicts, or why there are none (a failed request or an unusable answer)."""
        try:
            return parse_answer(self.ask(prompt), count)
        except (JudgeRequestError, JudgeAnswerError) as exc:
            return str(exc)

    def ask(self, prompt: str) -> str:
        """The judge's answer to ``prompt``; ``JudgeRequestError`` when the request fails."""
        import openai

        config = self.config
        try:
            reply: Any = self.client.chat.completions.create(
                model=config.model, messages=[{"role": "user", "content": prompt}],
                temperature=config.temperature, max_tokens=config.max_tokens)
        except openai.APIStatusError as exc:
            raise JudgeRequestError(f"HTTP {exc.status_code} from the judge endpoint {config.url}") from None
        except openai.APIError as exc:  # connection errors, timeouts
            raise JudgeRequestError(f"{type(exc).__name__} at the judge endpoint {config.url}") from None
        choice: Any = reply.choices[0] if reply.choices else None
        content = choice.message.content if choice is not None else None
        if not content:
            raise JudgeRequestError("the judge's answer was empty")
        return str(content)

    def _record(self, evaluations: list[JudgeEvaluation]) -> None:
        try:
            judge_evaluations.record(self.store_path, evaluations)
        except sqlite3.Error as exc:  # what inspect shows must not stop training
            logger.warning("judge: could not record %d evaluations in %s: %s", len(evaluations), self.store_path, exc)
