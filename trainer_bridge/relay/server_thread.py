"""Serving a relay: uvicorn on an event loop of its own, in a daemon thread of this process.

Used by the verl gateway (``verl_backend/gateway.GatewayHandle``, in the bridge's process) and by
``spanrl proxy`` (``proxy.ProxyHandle``). The listening socket is bound by the caller's thread, so
a taken port fails there, clearly; the relay's state is made on its own loop (its HTTP client and
locks belong to that loop), and other threads reach it only through ``on_loop``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from starlette.applications import Starlette

from spanrl.errors import UserError
from spanrl.server_connections import IDLE_CONNECTION_TIMEOUT_S
from spanrl.server_security import check_tls_pair, warn_if_exposed
from spanrl.trainer_bridge.relay.config import RelayConfig
from spanrl.trainer_bridge.relay.forwarding import watch_upstreams
from spanrl.trainer_bridge.relay.state import RelayState

logger = logging.getLogger(__name__)

T = TypeVar("T")


class RelayServer:
    """The relay ``make_app(make_state())`` serving on ``host:port`` (0: a free port) once ``start``ed,
    over HTTPS when ``config`` names a TLS pair (checked here, before binding); ``exposure_hint``:
    the settings a warning about an exposed relay names; ``bound``: a socket ``listening_socket``
    bound earlier on ``host:port``, for a caller that must hold its port through a long start."""

    def __init__(self, name: str, host: str, port: int, make_state: Callable[[], RelayState],
                 make_app: Callable[[RelayState], Starlette], config: RelayConfig, log_level: str = "warning",
                 exposure_hint: str = "token, tls_cert/tls_key", bound: socket.socket | None = None):
        self.name = name
        self.host = host
        self.config, self._exposure_hint = config, exposure_hint
        self.tls = check_tls_pair(config.tls_cert, config.tls_key, f"the {name}")
        self._make_state, self._make_app, self._log_level = make_state, make_app, log_level
        self._socket = bound if bound is not None else listening_socket(name, host, port)
        self.port: int = self._socket.getsockname()[1]
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._state: RelayState | None = None
        self._server: Any = None
        self._thread = threading.Thread(target=self._run, name=f"spanrl-{name}", daemon=True)

    @property
    def url(self) -> str:
        """The agents' OpenAI ``base_url``: ``http(s)://host:port/v1``."""
        return f"{'https' if self.tls else 'http'}://{url_host(self.host)}:{self.port}/v1"

    @property
    def state(self) -> RelayState:
        if self._state is None:
            raise RuntimeError(f"the {self.name} is not running")
        return self._state

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def start(self, startup_timeout_s: float = 30.0) -> None:
        warn_if_exposed(f"the {self.name}", self.host, bool(self.config.api_token), self.tls, logger,
                        self._exposure_hint)
        self._thread.start()
        if not self._ready.wait(startup_timeout_s) or self._failure is not None:
            self.stop()
            raise RuntimeError(f"the {self.name} did not start on {self.host}:{self.port}") from self._failure

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop serving and close the upstream connections (waits up to ``timeout_s``)."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("%s: its thread did not stop within %.0f s", self.name, timeout_s)
        self._socket.close()

    def on_loop(self, coro: Coroutine[Any, Any, T], timeout_s: float = 30.0) -> T:
        """Run ``coro`` on the relay's loop and wait for its result (from another thread)."""
        if self._loop is None or not self._thread.is_alive():
            coro.close()
            raise RuntimeError(f"the {self.name} is not running")
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError(f"{self.name} handle methods are for other threads; the relay's own loop would block")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def call(self, function: Callable[[], T], timeout_s: float = 30.0) -> T:
        """``function()`` run on the relay's loop (it touches loop-owned state)."""
        async def run() -> T:
            return function()

        return self.on_loop(run(), timeout_s)

    def _run(self) -> None:
        loop = new_event_loop()
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:  # reported to the starting thread; a crash later is logged
            self._failure = exc
            logger.error("%s: stopped by an error", self.name, exc_info=exc)
        finally:
            self._ready.set()
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _serve(self) -> None:
        import uvicorn

        self._loop = asyncio.get_running_loop()
        state = self._state = self._make_state()
        app = self._make_app(state)
        config = uvicorn.Config(app, log_level=self._log_level, access_log=False, lifespan="off",
                                timeout_graceful_shutdown=5, timeout_keep_alive=IDLE_CONNECTION_TIMEOUT_S,
                                limit_concurrency=self.config.max_concurrency,
                                ssl_certfile=self.config.tls_cert, ssl_keyfile=self.config.tls_key)
        self._server = server = uvicorn.Server(config)
        watcher = None
        if state.config.rotate_out_on_failure:
            watcher = asyncio.create_task(watch_upstreams(state, state.config.health_check_interval_s))
        ready = asyncio.create_task(self._signal_ready(server))
        try:
            await server.serve(sockets=[self._socket])
        finally:
            if watcher is not None:
                watcher.cancel()
            ready.cancel()
            await state.client.aclose()
            if app.state.endpoint_spans is not None:  # the spans of the last calls leave before the relay does
                await asyncio.to_thread(app.state.endpoint_spans.shutdown)

    async def _signal_ready(self, server: Any) -> None:
        while not server.started:
            await asyncio.sleep(0.01)
        self._ready.set()


def listening_socket(name: str, host: str, port: int) -> socket.socket:
    """The relay's socket, bound here so that a taken port fails in the caller, clearly."""
    if not 0 <= port <= 65535:
        raise UserError(f"{name} port {port} is not a port number (0 picks a free one)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UserError(f"the {name} cannot listen on {host}:{port} ({exc.strerror}); choose another port, "
                        "or 0 for a free one") from exc
    sock.set_inheritable(True)
    return sock


def url_host(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"  # reachable from this machine; other machines use this machine's address
    return f"[{host}]" if ":" in host else host


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop where it is installed (as uvicorn picks it), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


__all__ = ["RelayServer", "listening_socket", "new_event_loop", "url_host"]
