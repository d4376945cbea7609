"""``spanrl eval CONFIG --model DIR | --endpoint URL``: greedy accuracy and pass@k on a task file.

Registered by ``core/cli.py``, which builds ``EvalSettings`` (flags > ``OTEL_SPANRL_EVAL_*`` > the
``train.yaml`` file > defaults), prints them and calls ``eval_command``; the work is
``evaluation.run_eval``. Bad settings and files raise ``spanrl.errors.UserError``: one line, exit 2.
"""

from __future__ import annotations

import argparse

from .eval_settings import EVAL_PREFIX, EvalCommandSettings, EvalSettings

SETTINGS = EvalCommandSettings("eval", EvalSettings, EVAL_PREFIX, config_positional=True)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="score a model directory or a serving endpoint on a task file: greedy accuracy and pass@k",
        description="Evaluate --model DIR (served by the embedded backend) or --endpoint URL (an OpenAI-compatible "
        "endpoint already serving) on --tasks FILE with the agent, reward and runners of a train.yaml: one greedy "
        "rollout per task (greedy accuracy) and --samples rollouts per task at the agent's temperature (pass@k, "
        "--k). Start `spanrl receive` and `spanrl run` as for training. Writes a JSON summary with per-task "
        "results (--out) and prints a table. Nothing is trained.",
    )
    SETTINGS.add_to(parser)
    parser.set_defaults(func=eval_command)


def eval_command(settings: EvalSettings) -> int:
    from .evaluation import run_eval
    from .pass_at_k import summary_table

    summary = run_eval(settings)
    print(summary_table(summary))
    print(f"  summary: {settings.out_path}")
    return 0
