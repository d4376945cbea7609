"""A test agent that looks at everything it was given and says so; it imports no spanrl.

Run as a script (a command agent) it writes what it got (its environment, its stdin, the file
``SPANRL_TASK_FILE`` names) as JSON to the file ``PEEK_OUT`` names, and prints the task it read
from stdin as its last line, which the runner records in the rollout's spans as the variable
``output``. ``solve`` (an in-process agent) answers with its task and the ``OTEL_SPANRL_*``
variables it can see in its process.
"""

from __future__ import annotations

import json
import os
import sys


def solve(task: dict) -> str:
    return json.dumps({"task": task, "spanrl_variables": sorted(k for k in os.environ if k.startswith("OTEL_SPANRL_"))})


def main() -> int:
    stdin = sys.stdin.read()
    task_file = os.environ.get("SPANRL_TASK_FILE")
    seen = {"environ": dict(os.environ), "stdin": stdin, "task_file": None, "task_file_mode": None}
    if task_file:
        with open(task_file, encoding="utf-8") as f:
            seen["task_file"] = f.read()
        seen["task_file_mode"] = oct(os.stat(task_file).st_mode & 0o777)
    with open(os.environ["PEEK_OUT"], "w", encoding="utf-8") as f:
        json.dump(seen, f)
    print(json.dumps(json.loads(stdin)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
