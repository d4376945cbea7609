"""Port checks the tests share: whether a port of 127.0.0.1 can be bound right now (nothing holds
it), for tests of servers that must hold their ports through a long start, and whether a server
could listen on it again once they let it go."""

from __future__ import annotations

import socket


def _binds(port: int, as_server: bool) -> bool:
    with socket.socket() as probe:
        if as_server:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
            if as_server:
                probe.listen()
        except OSError:
            return False
    return True


def port_is_free(port: int) -> bool:
    """True when a new socket can bind ``port`` on 127.0.0.1 (no one has it bound or listening)."""
    return _binds(port, as_server=False)


def port_is_released(port: int) -> bool:
    """True when a server can listen on ``port`` again, as servers do (SO_REUSEADDR): a connection
    the server closed leaves the port in TIME_WAIT for a minute, which blocks a plain bind
    (``port_is_free``) but not a server's; the task API test failed on it once (2026-12-02)."""
    return _binds(port, as_server=True)
