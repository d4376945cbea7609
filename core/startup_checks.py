"""Checks a command makes before it starts, so that a user's mistake is one line, not a traceback.

``ensure_port_free`` is called by ``spanrl receive``, ``spanrl serve`` and ``spanrl train``
before they load anything slow (a model), so a taken port is said at once and names the flag
to change; ``ensure_model_dir`` by ``serve`` and ``train`` before a model is loaded;
``wait_until_reachable`` by ``spanrl run``, whose agents' spans would otherwise be dropped
silently when no receiver listens. All raise ``UserError`` subclasses, which ``core/cli.py``
prints as one line (exit 2). Stdlib only.
"""

from __future__ import annotations

import errno
import os
import socket
import time
import urllib.parse

from .errors import UserError

__all__ = ["ModelDirMissing", "PortInUse", "ServiceUnreachable", "ensure_model_dir", "ensure_port_free",
           "wait_until_reachable"]


class PortInUse(UserError):
    """A server of this command cannot listen on the address it was given."""


class ServiceUnreachable(UserError):
    """A service this command needs (the receiver) does not answer."""


class ModelDirMissing(UserError):
    """The model to serve or train is not a Hugging Face model directory."""


def ensure_model_dir(path: str, setting: str) -> None:
    """Raise ``ModelDirMissing`` unless ``path`` is a folder holding a model's ``config.json``.

    Checked before anything loads it: transformers would take a missing folder for a Hub repo
    id and fail with a long traceback about repo names.
    """
    create = f"create one with `spanrl model init {path}` (random weights) or give a Hugging Face model folder"
    if not os.path.exists(path):
        raise ModelDirMissing(f"{setting} {path!r}: no such directory; {create}")
    if not os.path.isdir(path):
        raise ModelDirMissing(f"{setting} {path!r} is a file, not a model directory; {create}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelDirMissing(f"{setting} {path!r} is not a Hugging Face model directory (no config.json); "
                              f"{create}")


def ensure_port_free(host: str, port: int, setting: str, action: str) -> None:
    """Raise ``PortInUse`` unless a server can listen on ``host:port``.

    ``action`` starts the message ("the policy server cannot listen on"); ``setting`` is the
    settings field that chooses the port (``policy_port``), named with its flag. Port 0 (any
    free port) is always fine. The probe socket is bound the way spanrl's servers bind theirs
    (``SO_REUSEADDR``, never ``SO_REUSEPORT``): connections of an old server in TIME_WAIT do
    not count as taken, a live listener does.
    """
    if port == 0:
        return
    flag = "--" + setting.replace("_", "-")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise PortInUse(f"{action} {host}:{port} ({setting}): unknown host {host!r} ({exc.strerror}); "
                        "give an address of this machine") from exc
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                fix = "another spanrl process still running? stop what holds it, or choose another port"
            elif exc.errno == errno.EACCES:
                fix = "ports below 1024 need privileges; choose another port"
            else:
                fix = "choose another address or port"
            raise PortInUse(f"{action} {host}:{port} ({setting}): {exc.strerror or exc} ({fix} "
                            f"with {flag})") from exc


def host_and_port(url: str, default_port: int) -> tuple[str, int]:
    """``(host, port)`` of an ``http://host:port/...`` URL (or a bare ``host:port``)."""
    parsed = urllib.parse.urlsplit(url if "//" in url else f"//{url}")
    return parsed.hostname or "127.0.0.1", parsed.port or default_port


def wait_until_reachable(url: str, wait_s: float, service: str, fix: str, default_port: int = 4317) -> None:
    """Return once something accepts TCP connections at ``url``; after ``wait_s`` seconds of
    refusals raise ``ServiceUnreachable`` saying ``service`` is not there and ``fix``."""
    host, port = host_and_port(url, default_port)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=2.0):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise ServiceUnreachable(f"cannot reach {service} at {url} ({exc.strerror or exc}) "
                                         f"after {wait_s:.0f} s: {fix}") from exc
        time.sleep(0.25)
