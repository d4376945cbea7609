"""The data files every example task writes the same way: its train / validation task splits
(``train.jsonl``, ``val.jsonl``) and the tokenizer text of its tool calls.

Each task's ``questions.py`` / ``problems.py`` draws its own tasks and calls ``split_main``; each
``demonstrations.py`` writes its own demonstrations and calls ``write_tool_call_text`` for the
lines ``spanrl model init --corpus`` should also learn (the chat template writes the tool schema
and the tool-call markers, which the demonstrations' message contents leave out). Stdlib only
until a tool-call text is written (it reads the chat template's tool intro from the torch backend).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Iterable

# The first part of a warm start shows only the tool route. A small model learns to copy numbers
# and names from the question and the tool's results late and abruptly (the tiny preset: the loss
# sits on a plateau near 0.4-0.5, then drops within 100-200 steps, after 300 to over 600 steps
# depending on the initialisation; docs/results.md, 2026-11-28), and answers from memory shown
# before then teach it to guess instead. The calculator demo's curriculum found the same.
TOOL_ONLY_FRACTION = 0.75


def weaker_share(step: int, steps: int, share: float, tool_only_fraction: float = TOOL_ONLY_FRACTION) -> float:
    """The share of the demonstrator's weaker behaviour in warm-start batch ``step`` of ``steps``:
    none for the first ``tool_only_fraction`` of the steps, then ``share``."""
    return 0.0 if step < int(steps * tool_only_fraction) else share


def write_jsonl(path: str, rows: Iterable[dict]) -> None:
    """One JSON object per line."""
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def split_main(make_tasks: Callable[[int], tuple[list[dict], list[dict]]], description: str) -> None:
    """The command line of a task's split writer: ``--out-dir DIR [--seed N]`` writes
    ``train.jsonl`` and ``val.jsonl`` from ``make_tasks(seed)`` (train, validation)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out-dir", required=True, help="writes train.jsonl and val.jsonl here")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    train, validation = make_tasks(args.seed)
    write_jsonl(os.path.join(args.out_dir, "train.jsonl"), train)
    write_jsonl(os.path.join(args.out_dir, "val.jsonl"), validation)
    print(f"{len(train)} train and {len(validation)} validation tasks in {args.out_dir}")


def write_tool_call_text(path: str, demonstrations_file: str, tool_name: str, tool_schema: dict,
                         extra_lines: Iterable[str] = ()) -> None:
    """The text the tokenizer also learns from: the tool's schema, the tool-call and tool-response
    markers and the chat template's tool intro, one line per tool call of the demonstrations as the
    template writes it, and ``extra_lines`` (e.g. a corpus the tool searches)."""
    from spanrl.trainer_bridge.torch_backend.model_init import TOOLS_INTRO, TOOLS_OUTRO

    lines = [json.dumps(tool_schema), "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
             TOOLS_INTRO, TOOLS_OUTRO, *extra_lines]
    with open(demonstrations_file, encoding="utf-8") as f:
        for line in f:
            for message in json.loads(line)["messages"]:
                for call in message.get("tool_calls") or []:
                    lines.append(f'{{"name": "{tool_name}", "arguments": {call["function"]["arguments"]}}}')
    with open(path, "w", encoding="utf-8") as out:
        out.write("\n".join(line.replace("\n", " ") for line in lines) + "\n")
