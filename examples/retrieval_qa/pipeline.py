"""The retrieval QA example end to end: a local model, its warm start, training, held-out accuracy.

Each step is the component a user would run by hand (README, "Multi-hop retrieval QA"):
``spanrl model init`` + a warm start on ``demonstrations.py``; ``spanrl receive`` and ``spanrl run``
(the harness ``rollout:solve``) as child processes and ``spanrl train``'s loop in this process,
scoring ``val.jsonl`` greedily every ``--val-every`` steps (``examples/task_pipeline.py`` does the
running). Called by ``python -m spanrl.examples.retrieval_qa.pipeline``, by ``bench/learning.py``
and by the example's test.
"""

from __future__ import annotations

import sys
from pathlib import Path

from spanrl.examples.task_pipeline import Task, WarmStart, example_main

from . import demonstrations

EXAMPLE_DIR = Path(__file__).resolve().parent
TASK = Task(
    name="retrieval_qa",
    train_tasks=EXAMPLE_DIR / "train.jsonl",
    val_tasks=EXAMPLE_DIR / "val.jsonl",
    reward="spanrl.examples.retrieval_qa.reward:reward",
    graded_reward="spanrl.examples.retrieval_qa.reward:search_reward",
    graded_call_reward="spanrl.examples.retrieval_qa.reward:search_step_rewards",
    agent="spanrl.examples.retrieval_qa.rollout:solve",
    write_demonstrations=demonstrations.write_demonstrations,
    write_tokenizer_corpus=demonstrations.write_tokenizer_corpus,
    demonstration_batches=demonstrations.demonstration_batches,
    demonstration_share=demonstrations.EARLY_SHARE,
    # copying names from the question and the results takes the tiny preset 500-600 steps of 64 to
    # learn (docs/results.md, 2026-11-28); the last quarter adds the hasty demonstrator
    warm_start=WarmStart(steps=800, batch_size=64),
)


def main(argv: list[str] | None = None) -> int:
    return example_main(TASK, "train the retrieval QA example (OpenAI Agents SDK) on CPU", argv)


if __name__ == "__main__":
    sys.exit(main())
