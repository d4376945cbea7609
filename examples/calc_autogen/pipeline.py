"""The AutoGen calculator example end to end: a local model, its warm start, training, held-out accuracy.

AutoGen pins its own protobuf, so its agent runs in ``.venv-autogen`` (``bash .ci/frameworks_env.sh``
builds it: this repository installed plainly, plus AutoGen): ``spanrl run`` is started with that
venv's Python and calls ``agent:solve`` in its process; the receiver and the trainer run here, in
the main environment (``examples/task_pipeline.py`` does the running). Called by
``python -m spanrl.examples.calc_autogen.pipeline``, by ``bench/learning.py`` and by the example's test.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from spanrl.errors import UserError
from spanrl.examples.task_pipeline import Task, TrainingRun, WarmStart, held_out_accuracy, prepare_model, train

from . import demonstrations

EXAMPLE_DIR = Path(__file__).resolve().parent
AUTOGEN_PYTHON = EXAMPLE_DIR.parents[1] / ".venv-autogen" / "bin" / "python"
TASK = Task(
    name="calc_autogen",
    train_tasks=EXAMPLE_DIR / "train.jsonl",
    val_tasks=EXAMPLE_DIR / "val.jsonl",
    reward="spanrl.examples.calc_autogen.reward:reward",
    agent="spanrl.examples.calc_autogen.agent:solve",
    write_demonstrations=demonstrations.write_demonstrations,
    write_tokenizer_corpus=demonstrations.write_tokenizer_corpus,
    demonstration_batches=demonstrations.demonstration_batches,
    demonstration_share=demonstrations.MENTAL_SHARE,
    runner_python=str(AUTOGEN_PYTHON),
)


def check_autogen_venv() -> None:
    if not AUTOGEN_PYTHON.exists():
        raise UserError(f"the AutoGen agent runs in its own venv and {AUTOGEN_PYTHON} is missing: "
                        "build it with `bash .ci/frameworks_env.sh`")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="train the AutoGen calculator example on CPU")
    parser.add_argument("--output-dir", default="runs/calc_autogen")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--val-every", type=int, default=2)
    parser.add_argument("--sft-steps", type=int, default=WarmStart.steps)
    parser.add_argument("--algorithm", default="grpo", choices=("grpo", "sft"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    check_autogen_venv()
    started = time.monotonic()
    warm_dir = prepare_model(TASK, os.path.join(args.output_dir, "model"),
                             WarmStart(steps=args.sft_steps, seed=args.seed, device=args.device))
    warm = held_out_accuracy(TASK, warm_dir, os.path.join(args.output_dir, "warm-validation"), seed=args.seed,
                             device=args.device)
    print(f"warm start done: held-out accuracy {warm:.2f}")
    summary = train(TASK, TrainingRun(output_dir=os.path.join(args.output_dir, "train"), model_dir=warm_dir,
                                      algorithm=args.algorithm, steps=args.steps, val_every=args.val_every,
                                      seed=args.seed, device=args.device))
    curve = " ".join(f"{step}:{value:.2f}" for step, value in summary["accuracy"].items())
    print(f"held-out accuracy by step: 0:{warm:.2f} {curve}; {time.monotonic() - started:.0f} s; "
          f"metrics {summary['metrics']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
