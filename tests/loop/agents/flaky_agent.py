"""Test agents that misbehave on purpose: they crash or hang on the tasks that say so.

``hang_once`` tasks hang on their first attempt only (the command-line agent; a marker
file per task in ``$FLAKY_MARKER_DIR``). ``solve`` is the in-process callable (a normal task
just echoes). Run as a script it is the command-line agent (task on stdin): a normal task
runs the calculator agent against the policy. Neither imports spanrl.
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


def first_attempt_of(task_id: str) -> bool:
    """True for the first process to ask about ``task_id`` (a marker file in $FLAKY_MARKER_DIR)."""
    try:
        os.close(os.open(os.path.join(os.environ["FLAKY_MARKER_DIR"], task_id), os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True


def main() -> int:
    task = json.loads(sys.stdin.read())
    behaviour = task.get("behaviour", "ok")
    if behaviour == "crash":
        print("about to crash", file=sys.stderr)
        os._exit(3)
    if behaviour == "hang":
        time.sleep(600)
    if behaviour == "hang_once" and first_attempt_of(task["id"]):
        time.sleep(600)  # the first attempt of the task hangs (timed out, then relaunched); the others run
    # A normal task: the calculator agent, a plain OpenAI-SDK agent.
    sys.path.insert(0, os.environ["CALC_AGENT_DIR"])
    from agent import solve as calc_solve

    print(calc_solve(task))
    return 0


if __name__ == "__main__":
    sys.exit(main())
