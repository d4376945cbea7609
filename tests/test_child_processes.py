"""``LocalServices`` (``spanrl demo``, the examples' pipelines, ``bench/``): SIGTERM to the process
that started the children stops them too, instead of leaving a receiver and a runner as orphans.
``free_port``: the ports it gives children are ones no port-0 bind or outgoing connection takes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

from spanrl import child_processes
from spanrl.child_processes import free_port

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


def test_free_ports_lie_below_the_kernels_ephemeral_range_and_are_free():
    start = child_processes._ephemeral_range_start()
    ports = {free_port() for _ in range(20)}
    assert len(ports) > 1  # drawn, not one fixed port
    assert all(child_processes._PORT_FLOOR <= p < start for p in ports), (sorted(ports), start)
    for port in ports:
        with socket.socket() as server:
            server.bind(("127.0.0.1", port))
            server.listen()


def test_a_taken_port_is_never_given_and_no_room_falls_back_to_the_kernels_choice(monkeypatch):
    kernels_range_start = child_processes._ephemeral_range_start()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", free_port()))
        taken = holder.getsockname()[1]
        # a range of one port, and that port taken: the kernel chooses
        monkeypatch.setattr(child_processes, "_PORT_FLOOR", taken)
        monkeypatch.setattr(child_processes, "_ephemeral_range_start", lambda: taken + 1)
        port = free_port()
    assert port != taken
    assert port >= kernels_range_start
    monkeypatch.setattr(child_processes, "_ephemeral_range_start", lambda: 1024)  # no room below the range
    port = free_port()
    assert port >= kernels_range_start
    with socket.socket() as server:
        server.bind(("127.0.0.1", port))
