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

from spanrl.trainer_bridge.torch_backend.engine.link import EngineHost, FrameChannel, RemoteEngine

if TYPE_CHECKING:  # this module never imports torch at run time
    from spanrl.trainer_bridge.torch_backend.engine.policy_engine import PolicyEngine

logger = logging.getLogger(__name__)

MODULE = "spanrl.trainer_bridge.torch_backend.server.api_process"  # what the child runs
TOKEN_ENV = "SPANRL_API_PROCESS_TOKEN"  # the bearer token reaches the child here, not in its argv
VALIDATION_TEMPERATURE_ENV = "SPANRL_API_PROCESS_VALIDATION_TEMPERATURE"
PROMPTS_ENV = "SPANRL_API_PROCESS_PROMPTS"  # the prompts file the child serves prompt resources from


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


def serve_in_process(engine: PolicyEngine, host: str = "127.0.0.1", port: int = 0, api_token: str | None = None,
                     log_level: str = "warning", startup_timeout: float = 60.0,
                     validation_temperature: float | None = None, model_names: Sequence[str] = (),
                     prompts: str | None = None) -> ProcessServerHandle:
    """Serve ``engine`` over HTTP from a child process; ``port=0`` picks a free one.

    Starts the engine if it is not running (and then stops it in ``handle.stop()``). Raises
    ``OSError`` when the address cannot be bound, ``RuntimeError`` when the child fails to start.
    Where there are no Unix sockets to hand over (Windows), serves from a thread instead.
    """
    if os.name != "posix":
        from spanrl.trainer_bridge.torch_backend.server.app import serve_in_thread

        logger.warning("no Unix socketpair here: the policy server's HTTP runs in this process")
        # a thread's handle: the same url, base_url and stop(), but no process to wait() for
        return serve_in_thread(engine, host, port, api_token, log_level,  # type: ignore[return-value]
                               validation_temperature=validation_temperature, model_names=model_names,
                               prompts=prompts)
    listener = socket.create_server((host, port), backlog=1024)
    bound_port = listener.getsockname()[1]
    ours, theirs = socket.socketpair()
    owns_engine = not engine.is_running
    engine.start()
    env = dict(os.environ)
    # the child finds spanrl where this process does, also on a path added at run time
    # (sys.path already holds this process's PYTHONPATH)
    env["PYTHONPATH"] = os.pathsep.join(entry for entry in sys.path if entry)
    env.pop(TOKEN_ENV, None)
    if api_token:
        env[TOKEN_ENV] = api_token
    env.pop(VALIDATION_TEMPERATURE_ENV, None)
    if validation_temperature is not None:
        env[VALIDATION_TEMPERATURE_ENV] = repr(float(validation_temperature))
    env.pop(PROMPTS_ENV, None)
    if prompts:
        env[PROMPTS_ENV] = os.path.abspath(prompts)
    command = [sys.executable, "-m", MODULE, "--engine-fd", str(theirs.fileno()),
               "--listen-fd", str(listener.fileno()), "--log-level", log_level]
    for name in model_names:
        command += ["--model-name", name]
    try:
        process = subprocess.Popen(command, pass_fds=(theirs.fileno(), listener.fileno()), env=env)
    finally:
        theirs.close()
        listener.close()  # the child holds its own copy: the port stays bound while it lives
    engine_host = EngineHost(engine, FrameChannel(ours)).start()
    handle = ProcessServerHandle(f"http://{host}:{bound_port}", host, bound_port, process, engine_host, engine,
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


def _run_front_end(engine_fd: int, listen_fd: int, log_level: str, model_names: Sequence[str] = ()) -> int:
    import uvicorn

    from spanrl.trainer_bridge.torch_backend.server.app import create_app

    channel = FrameChannel(socket.socket(fileno=engine_fd))
    engine = RemoteEngine(channel)
    listener = socket.socket(fileno=listen_fd)
    validation_temperature = os.environ.get(VALIDATION_TEMPERATURE_ENV)
    app = create_app(engine, os.environ.get(TOKEN_ENV) or None,
                     validation_temperature=None if validation_temperature is None else float(validation_temperature),
                     model_names=model_names, prompts=os.environ.get(PROMPTS_ENV) or None)
    config = uvicorn.Config(app, log_level=log_level,
                            access_log=False, lifespan="off")
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
    parser.add_argument("--model-name", action="append", default=[], help="a name the server answers to ('*': any)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    return _run_front_end(args.engine_fd, args.listen_fd, args.log_level, args.model_name)


if __name__ == "__main__":
    sys.exit(main())
