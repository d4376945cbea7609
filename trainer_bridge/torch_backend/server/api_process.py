"""The policy server's HTTP front end in a process of its own, and how the engine's side starts it.

``serve_in_process(engine, host, port)`` (in the process that owns the model: ``spanrl serve``,
the training loop) binds the listening socket, starts ``python -m
spanrl.trainer_bridge.torch_backend.server.api_process`` with that socket and one end of a
socketpair, and serves the child's requests from ``engine`` through an ``EngineHost``
(``engine/link.py``). The child runs the same FastAPI app as ``serve_in_thread``
(``app.create_app``) over a ``RemoteEngine``; it never imports torch. Weight swaps, versions and cancellation work as
in one process: the engine stays where the weights are.

The child exits when the engine's side closes the link (``handle.stop()``, or its process
died); the engine's side sees the child's exit as the link closing.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from spanrl.server_connections import IDLE_CONNECTION_TIMEOUT_S
from spanrl.trainer_bridge.torch_backend.engine.link import EngineHost, FrameChannel, RemoteEngine

if TYPE_CHECKING:  # this module never imports torch at run time
    from spanrl.trainer_bridge.torch_backend.engine.policy_engine import PolicyEngine
    from spanrl.trainer_bridge.torch_backend.server.policy import WeightsAdmin

logger = logging.getLogger(__name__)

MODULE = "spanrl.trainer_bridge.torch_backend.server.api_process"  # what the child runs
TOKEN_ENV = "SPANRL_API_PROCESS_TOKEN"  # the bearer token reaches the child here, not in its argv
ADMIN_TOKEN_ENV = "SPANRL_API_PROCESS_ADMIN_TOKEN"  # the weights route's token, likewise
VALIDATION_TEMPERATURE_ENV = "SPANRL_API_PROCESS_VALIDATION_TEMPERATURE"


@dataclass
class ProcessServerHandle:
    """A server whose HTTP front end runs in a child process: ``url``, ``base_url``, ``stop()``."""

    url: str
    host: str
    port: int
    process: subprocess.Popen
    engine_host: EngineHost
    engine: PolicyEngine
    owns_engine: bool

    @property
    def base_url(self) -> str:
        """The OpenAI client's ``base_url`` (``.../v1``)."""
        return f"{self.url}/v1"

    def wait(self, timeout: float | None = None) -> int:
        """Until the front end exits (its exit status).

        Waits in short slices: a blocking ``waitpid`` is not interrupted when Ctrl-C's SIGINT is
        delivered to another thread of this process, and on CUDA the driver's own threads
        receive it (``spanrl serve`` then never stopped on a GPU machine). Between slices
        Python runs its signal handler, so ``KeyboardInterrupt`` reaches the caller.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = 0.5 if deadline is None else min(0.5, max(deadline - time.monotonic(), 0.0))
            try:
                return self.process.wait(left)
            except subprocess.TimeoutExpired:
                if deadline is not None and time.monotonic() >= deadline:
                    raise

    def stop(self, timeout: float = 10.0) -> None:
        self.engine_host.channel.close()  # the child's link closes: it shuts its server down
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.owns_engine:
            self.engine.stop()


# How long the HTTP process may take to import and report ready: seconds on an idle 2-core machine,
# far longer beside a loaded test suite; a server given up on closes the port a client may already
# have connected to (the likely cause, not confirmed, of a connection refused in a slow CI run of
# 2026-12-04, when this was 60 s)
API_STARTUP_TIMEOUT_S = 180.0


def serve_in_process(engine: PolicyEngine, host: str = "127.0.0.1", port: int = 0, api_token: str | None = None,
                     log_level: str = "warning", startup_timeout: float = API_STARTUP_TIMEOUT_S,
                     validation_temperature: float | None = None, weights_admin: WeightsAdmin | None = None,
                     tls_cert: str | None = None, tls_key: str | None = None,
                     max_concurrency: int | None = None, model_names: Sequence[str] = (),
                     prompts: str | None = None) -> ProcessServerHandle:
    """Serve ``engine`` over HTTP from a child process; ``port=0`` picks a free one.

    Starts the engine if it is not running (and then stops it in ``handle.stop()``). Raises
    ``OSError`` when the address cannot be bound or the TLS files do not load (``TlsSetupError``),
    ``RuntimeError`` when the child fails to start. ``weights_admin``: who may load weights over
    HTTP (``policy.py``); ``tls_cert``/``tls_key``: HTTPS only. Where there are no Unix sockets to
    hand over (Windows), serves from a thread instead.
    """
    from spanrl.trainer_bridge.torch_backend.server.app import MAX_CONCURRENCY, check_server_security, url_of

    max_concurrency = max_concurrency or MAX_CONCURRENCY
    if os.name != "posix":
        from spanrl.trainer_bridge.torch_backend.server.app import serve_in_thread

        logger.warning("no Unix socketpair here: the policy server's HTTP runs in this process")
        # a thread's handle: the same url, base_url and stop(), but no process to wait() for
        return serve_in_thread(engine, host, port, api_token, log_level,  # type: ignore[return-value]
                               validation_temperature=validation_temperature, weights_admin=weights_admin,
                               tls_cert=tls_cert, tls_key=tls_key, max_concurrency=max_concurrency,
                               model_names=model_names, prompts=prompts)
    tls = check_server_security(host, api_token, tls_cert, tls_key)
    listener = socket.create_server((host, port), backlog=1024)
    bound_port = listener.getsockname()[1]
    ours, theirs = socket.socketpair()
    owns_engine = not engine.is_running
    engine.start()
    env = _front_end_environment(api_token, weights_admin.token if weights_admin else None, validation_temperature)
    command = [sys.executable, "-m", MODULE, "--engine-fd", str(theirs.fileno()),
               "--listen-fd", str(listener.fileno()), "--log-level", log_level,
               "--max-concurrency", str(max_concurrency)]
    if weights_admin is not None:
        command += ["--weights-dir", weights_admin.root]
    if tls_cert and tls_key:
        command += ["--tls-cert", tls_cert, "--tls-key", tls_key]
    for name in model_names:
        command += ["--model-name", name]
    if prompts:
        command += ["--prompts", os.path.abspath(prompts)]
    try:
        process = subprocess.Popen(command, pass_fds=(theirs.fileno(), listener.fileno()), env=env)
    finally:
        theirs.close()
        listener.close()  # the child holds its own copy: the port stays bound while it lives
    engine_host = EngineHost(engine, FrameChannel(ours)).start()
    handle = ProcessServerHandle(url_of(host, bound_port, tls), host, bound_port, process, engine_host, engine,
                                 owns_engine)
    deadline = time.monotonic() + startup_timeout
    while not engine_host.ready.wait(0.05):
        if process.poll() is not None or engine_host.closed.is_set() or time.monotonic() > deadline:
            handle.stop()
            raise RuntimeError(f"the policy server's API process did not start on {host}:{bound_port} "
                               f"(exit status {process.poll()}; its errors are above)")
    logger.info("policy server listening on %s (model %s, version %d; HTTP in process %d)",
                handle.url, engine.model_name, engine.version, process.pid)
    return handle


def _front_end_environment(api_token: str | None, admin_token: str | None,
                           validation_temperature: float | None) -> dict[str, str]:
    """This process's environment for the child, with its tokens (never in its argv) and settings."""
    env = dict(os.environ)
    # the child finds spanrl where this process does, also on a path added at run time
    # (sys.path already holds this process's PYTHONPATH)
    env["PYTHONPATH"] = os.pathsep.join(entry for entry in sys.path if entry)
    temperature = None if validation_temperature is None else repr(float(validation_temperature))
    for name, value in ((TOKEN_ENV, api_token), (ADMIN_TOKEN_ENV, admin_token),
                        (VALIDATION_TEMPERATURE_ENV, temperature)):
        env.pop(name, None)
        if value:
            env[name] = value
    return env


def _run_front_end(engine_fd: int, listen_fd: int, args: argparse.Namespace) -> int:
    import uvicorn

    from spanrl.trainer_bridge.torch_backend.server.app import create_app
    from spanrl.trainer_bridge.torch_backend.server.policy import WeightsAdmin

    channel = FrameChannel(socket.socket(fileno=engine_fd))
    engine = RemoteEngine(channel)
    listener = socket.socket(fileno=listen_fd)
    validation_temperature = os.environ.get(VALIDATION_TEMPERATURE_ENV)
    admin_token = os.environ.get(ADMIN_TOKEN_ENV)
    admin = WeightsAdmin(admin_token, args.weights_dir) if admin_token and args.weights_dir else None
    app = create_app(engine, os.environ.get(TOKEN_ENV) or None, weights_admin=admin,
                     validation_temperature=None if validation_temperature is None else float(validation_temperature),
                     model_names=args.model_name, prompts=args.prompts)
    config = uvicorn.Config(app, log_level=args.log_level, access_log=False, lifespan="off",
                            timeout_keep_alive=IDLE_CONNECTION_TIMEOUT_S,
                            limit_concurrency=args.max_concurrency, ssl_certfile=args.tls_cert,
                            ssl_keyfile=args.tls_key)
    server = uvicorn.Server(config)

    def engine_gone() -> None:
        server.should_exit = True

    engine.on_lost = engine_gone
    if engine.lost:  # lost before the callback was set
        return 1
    engine.announce_ready()
    server.run(sockets=[listener])
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="spanrl policy server: the HTTP front end (started by "
                                                 "`spanrl serve` and the training loop, not by hand)")
    parser.add_argument("--engine-fd", type=int, required=True, help="socket to the engine's process")
    parser.add_argument("--listen-fd", type=int, required=True, help="bound, listening HTTP socket")
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--max-concurrency", type=int, default=None, help="uvicorn's limit_concurrency")
    parser.add_argument("--weights-dir", default=None, help="POST /spanrl/v1/weights loads only under it")
    parser.add_argument("--tls-cert", default=None, help="PEM certificate: serve HTTPS")
    parser.add_argument("--tls-key", default=None, help="PEM key of --tls-cert")
    parser.add_argument("--model-name", action="append", default=[], help="a name the server answers to ('*': any)")
    parser.add_argument("--prompts", default=None, help="a prompts file: the prompt resources it serves")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    return _run_front_end(args.engine_fd, args.listen_fd, args)


if __name__ == "__main__":
    sys.exit(main())
