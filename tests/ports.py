"""Port checks the tests share: whether a port of 127.0.0.1 can be bound right now (nothing holds
it), for tests of servers that must hold their ports through a long start."""

from __future__ import annotations

import socket


def port_is_free(port: int) -> bool:
    """True when a new socket can bind ``port`` on 127.0.0.1 (no one has it bound or listening)."""
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
