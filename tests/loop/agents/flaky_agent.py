"""Test agents that misbehave on purpose: they crash or hang on the tasks that say so.

``solve`` is the in-process callable (a normal task just echoes). Run as a script it is the
command-line agent (task on stdin): a normal task runs the calculator agent against the
policy. Neither imports spanrl.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

release_hung_agents = threading.Event()


def solve(task: dict) -> str:
    behaviour = task.get("behaviour", "ok")
    if behaviour == "crash":
        raise RuntimeError(f"agent crashed on purpose on {task['id']}")
    if behaviour == "hang":
        release_hung_agents.wait(60)
        return "too late"
    return f"answer-{task['id']}"


def main() -> int:
    task = json.loads(sys.stdin.read())
    behaviour = task.get("behaviour", "ok")
    if behaviour == "crash":
        print("about to crash", file=sys.stderr)
        os._exit(3)
    if behaviour == "hang":
        time.sleep(600)
    # A normal task: the calculator agent, a plain OpenAI-SDK agent.
    sys.path.insert(0, os.environ["CALC_AGENT_DIR"])
    from agent import solve as calc_solve

    print(calc_solve(task))
    return 0


if __name__ == "__main__":
    sys.exit(main())
