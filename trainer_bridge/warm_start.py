"""Warm start: supervised fine-tuning of a model before RL, from demonstrations or good rollouts.

A model fresh from ``spanrl model init`` has random weights: its agent never succeeds and GRPO
has nothing to compare. A warm start teaches it the agent's protocol first, from either source
(or both):

- ``demonstrations``: a JSONL file of chat examples, ``{"messages": [...]}`` a line;
- ``store``: the best-rewarded rollouts already in a receiver store (``top_k`` of them and/or
  those at or above ``min_reward``; scored by the agent's reward events or a reward function),
  whose calls are learned token for token as the engine served them; calls recorded as text only
  (a hosted teacher behind ``spanrl proxy``) are re-tokenized with this model's own tokenizer and
  chat template (``otlp_receiver/text_calls.py``): distill, then train.

Used by ``spanrl sft`` (``sft_cli``) and by ``spanrl train`` (the ``warm_start:`` block of
``train.yaml``, run by ``session.warm_start_before_training`` before the first step). This module picks the
examples (token examples, and chat examples of text-only calls) and keeps the record; the training
itself is the fine-tuning backend's
(``backend.fine_tune``: the torch trainer, ``torch_backend/fine_tune.py``), imported only when
it runs, so ``--help`` and settings files stay light.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

from spanrl.errors import SettingError, UserError
from spanrl.schema.tasks import load_tasks

from .backend import FineTuneRequest, TokenExample, fine_tune
from .rollout_calls import call_reward
from .scoring import load_reward_function

logger = logging.getLogger(__name__)

RECORD_FILE = "warm_start.json"  # written into a warm-started model directory: what was learned
# settings of the warm_start: block of train.yaml that the top level owns
WARM_START_FROM_TOP_LEVEL = ("reward", "tasks", "python_path", "seed", "device")


@dataclass
class WarmStartConfig:
    """Where the examples come from and how long to learn (``spanrl sft`` and ``warm_start:``)."""

    demonstrations: str = field(default="", metadata={
        "help": 'chat JSONL file of demonstrations, one {"messages": [...]} a line'})
    store: str = field(default="", metadata={
        "help": "a receiver store (SQLite) whose best-rewarded rollouts are learned"})
    top_k: int = field(default=0, metadata={"help": "learn the k best-rewarded rollouts of the store (0 = all)"})
    min_reward: float | None = field(default=None, metadata={
        "help": "learn only rollouts of the store rewarded at least this much"})
    reward: str = field(default="events", metadata={
        "help": "how store rollouts are scored: 'events' (their spanrl.reward events) or 'module:function' "
        "called with (task, variables)"})
    tasks: str = field(default="", metadata={"help": "task JSONL file (a reward function gets each rollout's task)"})
    python_path: list = field(default_factory=list, metadata={
        "help": "folders to import the reward module from (in a config file: relative to it; the config "
        "file's own folder is always one)", "import_folders": True})
    steps: int = field(default=300, metadata={"help": "SFT steps (one AdamW step per batch)"})
    batch_size: int = field(default=32, metadata={"help": "examples per SFT step (drawn at random)"})
    learning_rate: float = field(default=1e-3, metadata={"help": "SFT AdamW learning rate"})
    seed: int = field(default=0, metadata={"help": "random seed (batches)"})
    device: str = field(default="auto", metadata={"help": "auto | cpu | cuda | cuda:N"})

    @property
    def enabled(self) -> bool:
        return bool(self.demonstrations or self.store)

    def __post_init__(self) -> None:
        if self.reward != "events" and ":" not in self.reward:
            raise SettingError(f"reward must be 'events' or 'module:function', got {self.reward!r}")
        if self.reward != "events" and self.store and not self.tasks:
            raise SettingError("a reward function scores each stored rollout with its task: give tasks (the JSONL "
                               "file the rollouts were run on)")
        for name in ("steps", "batch_size"):
            if getattr(self, name) < 1:
                raise SettingError(f"{name} must be at least 1")
        if self.top_k < 0:
            raise SettingError("top_k must be 0 (all) or more")
        if (self.top_k or self.min_reward is not None) and not self.store:
            raise SettingError("top_k and min_reward choose rollouts of a store: give store (the receiver's "
                               "SQLite file)")


@dataclass(frozen=True)
class ChosenRollouts:
    """The store's rollouts picked for a warm start: their SFT examples and what they scored."""

    examples: list[Any]  # one per call: a TokenExample, or a chat example of a call recorded as text only
    rollouts: int
    scored: int     # rollouts of the store that had a score
    best: float | None
    worst_chosen: float | None
    text_calls: int = 0  # of the examples, calls recorded as text only (re-tokenized by this model's tokenizer)


def choose_rollouts(config: WarmStartConfig) -> ChosenRollouts:
    """The transitions of the best-rewarded ok rollouts of ``config.store`` (torch-free)."""
    from spanrl.otlp_receiver.store import SpanStore

    if not os.path.isfile(config.store):
        raise UserError(f"store {config.store!r} not found: give the SQLite file `spanrl receive --db` wrote")
    with SpanStore(config.store) as store:
        rollouts, _ = store.completed_rollouts(since=0)
        scored = _scored_rollouts(config, rollouts, store)
    chosen = [pair for pair in scored if config.min_reward is None or pair[0] >= config.min_reward]
    if config.top_k:
        chosen = chosen[: config.top_k]
    if not chosen:
        best = f"; the best scored {scored[0][0]:g}" if scored else ""
        raise UserError(f"no rollout of {config.store} to learn from: {len(scored)} of {len(rollouts)} rollouts "
                        f"have a score ({config.reward}){best}, min_reward is {config.min_reward}")
    examples, text_calls = _examples_of([rollout for _, rollout in chosen], config.store)
    if not examples:
        raise UserError(f"the {len(chosen)} rollouts chosen from {config.store} have no LLM call to learn from "
                        "(no transition, and no call recorded with its text)")
    return ChosenRollouts(examples, len(chosen), len(scored), scored[0][0], chosen[-1][0], text_calls)


def _scored_rollouts(config: WarmStartConfig, rollouts: list[Any], store: Any) -> list[tuple[float, Any]]:
    """The ok training rollouts of ``store`` with their scores (total reward or the reward function's),
    best first."""
    from spanrl.bridge_protocol import is_held_out_rollout

    reward_fn = None if config.reward == "events" else load_reward_function(config.reward, config.python_path)
    tasks = dict(load_tasks(config.tasks)) if config.tasks else {}
    scored: list[tuple[float, Any]] = []
    for rollout in rollouts:
        if rollout.status != "ok" or is_held_out_rollout(rollout.rollout_id):
            continue  # validation and eval rollouts are held out: never learned (a rollout without transitions may
            # still have calls recorded as text only)
        if reward_fn is None:
            score = rollout.total_reward
        elif rollout.task_id in tasks:
            try:
                value = call_reward(reward_fn, tasks[rollout.task_id], rollout, store)
                score = value.outcome + sum(value.call_rewards.values())
            except Exception:  # one bad rollout must not stop the warm start
                logger.exception("reward function %s failed on rollout %s: skipped", config.reward, rollout.rollout_id)
                continue
        else:
            continue
        if score is not None and math.isfinite(score):
            scored.append((score, rollout))
    scored.sort(key=lambda pair: pair[0], reverse=True)
    return scored


def _examples_of(rollouts: list[Any], store_path: str) -> tuple[list[Any], int]:
    """The SFT examples of ``rollouts``: their transitions as served (token ids), and their calls that
    came without engine ids as chat examples (read from the store's spans); how many of those."""
    from spanrl.otlp_receiver.store import SpanStore
    from spanrl.otlp_receiver.text_calls import chat_examples

    examples: list[Any] = []
    text_calls = 0
    with SpanStore(store_path) as store:
        for rollout in rollouts:
            examples += [TokenExample(tuple(t.prompt_token_ids), tuple(t.response_token_ids))
                         for t in rollout.transitions if t.response_token_ids and not t.retokenized]
            # a call without engine ids is either a problem of the rollout or a receiver-retokenized transition
            if not rollout.transitions or rollout.problems or any(t.retokenized for t in rollout.transitions):
                texts = chat_examples(store, rollout.rollout_id)
                examples += texts
                text_calls += len(texts)
    return examples, text_calls


def warm_start_model(config: WarmStartConfig, model_dir: str, out_dir: str, progress: bool = True) -> dict:
    """SFT ``model_dir`` on the configured examples and write the result to ``out_dir`` (which may be
    ``model_dir`` itself: it is replaced atomically). Returns what was done (also saved in
    ``out_dir/warm_start.json``): steps, first and last loss, examples, seconds."""
    if not config.enabled:
        raise SettingError("nothing to learn from: give demonstrations (a chat JSONL file) and/or store "
                           "(a receiver store)")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise UserError(f"model {model_dir!r} is not a Hugging Face model directory (no config.json); "
                        "create one with `spanrl model init DIR`")
    record: dict[str, Any] = {"model": os.path.abspath(model_dir)}
    examples: list[Any] = []  # TokenExamples and chat examples (calls recorded as text only)
    if config.store:
        chosen = choose_rollouts(config)
        examples = chosen.examples
        record["store"] = {"file": os.path.abspath(config.store), "rollouts": chosen.rollouts,
                           "transitions": len(chosen.examples), "text_calls": chosen.text_calls,
                           "best_reward": chosen.best, "lowest_reward_learned": chosen.worst_chosen}
        retokenized = (f", {chosen.text_calls} of them recorded as text and re-tokenized with this model's "
                       "tokenizer and chat template" if chosen.text_calls else "")
        print(f"learning {chosen.rollouts} of {chosen.scored} scored rollouts of {config.store} "
              f"(rewards {chosen.worst_chosen:g} to {chosen.best:g}; {len(chosen.examples)} calls{retokenized})",
              flush=True)
    stats = fine_tune(FineTuneRequest(
        model_dir=model_dir, out_dir=out_dir, demonstrations=config.demonstrations,
        token_examples=tuple(e for e in examples if isinstance(e, TokenExample)),
        chat_examples=tuple(e for e in examples if not isinstance(e, TokenExample)),
        steps=config.steps, batch_size=config.batch_size,
        learning_rate=config.learning_rate, seed=config.seed, device=config.device, progress=progress))
    if config.demonstrations:
        record["demonstrations"] = {"file": os.path.abspath(config.demonstrations),
                                    "examples": stats["demonstrations"]}
    record.update({"steps": int(stats["steps"]), "batch_size": config.batch_size,
                   "learning_rate": config.learning_rate, "loss_first": stats["loss_first"],
                   "loss_last": stats["loss_last"], "seconds": round(stats["seconds"], 1),
                   "finished_at": time.time()})
    with open(os.path.join(out_dir, RECORD_FILE), "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)
    return record


def describe_sources(config: WarmStartConfig) -> str:
    sources = []
    if config.demonstrations:
        sources.append(f"demonstrations {config.demonstrations}")
    if config.store:
        limits = [f"top {config.top_k}" if config.top_k else "", f"reward >= {config.min_reward:g}"
                  if config.min_reward is not None else ""]
        which = ", ".join(x for x in limits if x) or "all scored"
        sources.append(f"rollouts of {config.store} ({which})")
    return " and ".join(sources)
