"""Checks ``spanrl train`` makes at start, so a user's mistake is one line naming the fix.

Called by ``training_loop.run_training``: ``check_before_start`` before the model loads (a
missing model directory, a taken policy or task-API port, TLS files that do not load),
``wait_for_receiver`` next (no
``spanrl receive`` writing the store means no rollout would ever assemble).
Both raise ``spanrl.errors.UserError`` subclasses.
"""

from __future__ import annotations

import time

from spanrl.errors import UserError

from .loop_settings import LoopSettings


def check_before_start(settings: LoopSettings) -> None:
    """A missing model or a taken port is said before the model loads (seconds to minutes)."""
    from spanrl.startup_checks import ensure_model_dir, ensure_port_free

    if settings.backend != "endpoint":  # an endpoint spanrl does not start needs neither
        ensure_model_dir(settings.model, "model")
        ensure_port_free(settings.policy_host, settings.policy_port, "policy_port",
                         "the policy server cannot listen on")
    ensure_port_free(settings.bridge_host, settings.bridge_port, "bridge_port",
                     "the task API for runners cannot listen on")
    from spanrl.server_security import TlsSetupError, check_tls_pair

    try:  # the policy endpoint and the task API serve HTTPS from these (bridge_api.py, the backends)
        check_tls_pair(settings.tls_cert, settings.tls_key, "tls_cert/tls_key")
    except TlsSetupError as exc:
        raise UserError(str(exc)) from exc


def wait_for_receiver(store: str, wait_s: float) -> None:
    """Rollouts reach the store only through a receiver: without one, every attempt would end
    'unassembled'. Waits ``wait_s`` for one to start, then raises ``UserError``."""
    from spanrl.otlp_receiver.store_lock import receiver_running

    deadline = time.monotonic() + wait_s
    while not receiver_running(store):
        if time.monotonic() > deadline:
            raise UserError(f"no `spanrl receive` is writing the store {store!r} (waited {wait_s:.0f} s); start "
                            f"`spanrl receive --db {store}`, or set store: to the --db of the running one")
        time.sleep(0.2)
