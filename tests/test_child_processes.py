"""``LocalServices`` (``spanrl demo``, the examples' pipelines, ``bench/``): SIGTERM to the process
that started the children stops them too, instead of leaving a receiver and a runner as orphans."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

PARENT = textwrap.dedent("""
    import sys, time
    from spanrl.child_processes import LocalServices

    with LocalServices(sys.argv[1]) as services:
        child = services.start("sleeper", [sys.executable, "-c", "import time; time.sleep(120)"])
        print(child.pid, flush=True)
        time.sleep(120)
""")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_to_the_parent_stops_its_children(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        child_pid = int(parent.stdout.readline())
        assert alive(child_pid)
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(timeout=30) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 15
        while alive(child_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(child_pid), "the child outlived its parent's SIGTERM"
    finally:
        parent.kill()
        parent.wait()
