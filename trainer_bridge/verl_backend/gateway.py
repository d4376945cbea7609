"""One stable OpenAI-compatible URL for the agents, in front of N upstream servers (verl's vLLM
replicas): the verl backend starts it in the bridge's process and pauses it around weight syncs.

Public API (called by the verl backend)::

    handle = start_gateway(GatewayConfig(served_model_name="policy", temperature=1.0), ["host:port", ...])
    handle.url                    # "http://127.0.0.1:PORT/v1": the agents' base_url, the same all run
    handle.port
    handle.pause(timeout_s=120)   # new requests wait; returns True once none is in flight (False: timed out)
    handle.set_policy_version(2)  # stamped on every reply admitted from now on
    handle.set_upstreams([...])   # replace the replicas (kept ones keep their rollouts)
    handle.resume()
    handle.stats()                # GatewayStats: paused, version, counters, per-upstream UpstreamStats
    handle.stop()

``GatewayConfig``: ``served_model_name`` (the name agents call; each request's model becomes the
upstream's own, read from its ``/v1/models``), ``model_names`` (other names it answers to, ``*``:
any, the default; a reply carries the name its request asked for, ``trainer_bridge/model_names.py``),
``host`` (127.0.0.1), ``port`` (0: a free one),
``temperature`` (None: the agent's; set: every request is sampled at it, since the trainer
recomputes log-probs at that temperature; an agent's other value is logged once per process),
``pause_wait_s`` (how long a request waits while paused before its 503), ``retry_after_s`` (the
503's ``Retry-After``; the ``openai`` client retries by itself), ``request_timeout_s`` (a
non-streamed request's whole time; for a stream, its wait for each next event),
``health_check_interval_s`` (how often an upstream out of rotation is probed), ``api_token``
(when set, agents must send ``Authorization: Bearer <token>``), ``spans_endpoint`` (where the
gateway's own LLM span per request goes over OTLP, ``trainer_bridge/endpoint_spans.py``; None:
``OTEL_SPANRL_SERVE_SPANS_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_*`` as for ``spanrl serve``; ``off``: none).

What passes through (``gateway_app.py`` routes, ``gateway_relay.py``, ``gateway_rewrite.py``,
``gateway_upstreams.py``, ``gateway_state.py``):
``POST /v1/chat/completions``, ``/v1/completions`` and ``/v1/responses`` (streamed or not, event
by event), ``GET /v1/models`` (the served name), ``GET /health``, ``GET /spanrl/gateway/stats``;
other routes are OpenAI-style 404s. A rollout's calls go to one upstream while it is up (prefix
cache reuse), found from ``x-spanrl-rollout-id``, the ``spanrl.rollout.id`` baggage entry or the
``traceparent`` trace id; other calls go to the least loaded. Requests ask for
``return_token_ids`` and logprobs whatever the agent asked; replies carry the policy version in
``x-spanrl-policy-version`` and a top-level ``policy_version`` (every SSE chunk too), as
spanrl's embedded server writes them. An upstream that cannot be reached gives that request a
502 naming it (504 when it does not answer in time) and leaves rotation until its ``/health``
answers; with none up, requests get 503 with ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from spanrl.errors import SettingError, UserError
from spanrl.trainer_bridge.model_names import ANY_NAME, ServedModelNames
from spanrl.trainer_bridge.verl_backend.gateway_app import create_app
from spanrl.trainer_bridge.verl_backend.gateway_relay import watch_upstreams
from spanrl.trainer_bridge.verl_backend.gateway_state import GatewayState, GatewayStats
from spanrl.trainer_bridge.verl_backend.gateway_upstreams import UpstreamStats, normalize_upstream_url

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class GatewayConfig:
    """How the gateway listens and what it does to requests (the module docstring says each field)."""

    served_model_name: str
    model_names: tuple[str, ...] = (ANY_NAME,)
    host: str = "127.0.0.1"
    port: int = 0
    temperature: float | None = None
    validation_temperature: float | None = None  # validation rollouts' temperature (0: greedy); None: as others
    pause_wait_s: float = 30.0
    retry_after_s: float = 1.0
    request_timeout_s: float = 600.0
    health_check_interval_s: float = 2.0
    api_token: str | None = None
    log_level: str = "warning"  # uvicorn's
    spans_endpoint: str | None = None  # OTLP endpoint of its LLM spans; None: the environment's; "off": none

    @property
    def names(self) -> ServedModelNames:
        return ServedModelNames.of((self.served_model_name, *self.model_names), self.served_model_name)

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise SettingError("the gateway needs served_model_name: the model name the agents call")
        if not isinstance(self.model_names, tuple):
            object.__setattr__(self, "model_names", tuple(self.model_names))
        if not 0 <= self.port <= 65535:
            raise SettingError(f"gateway port {self.port} is not a port number (0 picks a free one)")
        if self.temperature is not None and self.temperature < 0:
            raise SettingError(f"gateway temperature {self.temperature} must be >= 0 (or unset to pass agents' own)")
        if self.validation_temperature is not None and self.validation_temperature < 0:
            raise SettingError(f"gateway validation_temperature {self.validation_temperature} must be >= 0")
        if self.pause_wait_s < 0:
            raise SettingError(f"gateway pause_wait_s must be >= 0, got {self.pause_wait_s}")
        for name in ("retry_after_s", "request_timeout_s", "health_check_interval_s"):
            if getattr(self, name) <= 0:
                raise SettingError(f"gateway {name} must be positive, got {getattr(self, name)}")


class GatewayHandle:
    """A gateway running in a background thread of this process (its own event loop)."""

    def __init__(self, config: GatewayConfig, upstreams: list[str]):
        self.config = config
        self._upstreams = list(upstreams)
        self._socket = _listening_socket(config.host, config.port)
        self.port: int = self._socket.getsockname()[1]
        self.host = config.host
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._state: GatewayState | None = None
        self._server: Any = None
        self._thread = threading.Thread(target=self._run, name="spanrl-gateway", daemon=True)

    @property
    def url(self) -> str:
        """The agents' OpenAI ``base_url``: ``http://host:port/v1``."""
        return f"http://{_url_host(self.host)}:{self.port}/v1"

    @property
    def policy_version(self) -> int:
        return self._live_state().policy_version

    def pause(self, timeout_s: float = 120.0) -> bool:
        """Hold new requests; True once no request is in flight, False if some still are after
        ``timeout_s`` (the gateway stays paused either way)."""
        drained = self._on_loop(self._live_state().gate.pause(timeout_s), timeout_s + 10.0)
        if not drained:
            logger.warning("gateway: paused, but %d requests were still in flight after %.0f s",
                           self._live_state().gate.in_flight, timeout_s)
        return drained

    def resume(self) -> None:
        """Let requests through again (those waiting go on at once)."""
        self._on_loop(_call(self._live_state().gate.resume))

    def set_policy_version(self, version: int) -> None:
        """The version stamped on replies to requests admitted from now on."""
        self._live_state().policy_version = int(version)

    def set_upstreams(self, urls: list[str]) -> None:
        """Replace the upstream servers (``host:port`` or ``http://host:port[/v1]``)."""
        normalized = [normalize_upstream_url(u) for u in urls]
        self._on_loop(_call(lambda: self._live_state().pool.set_urls(normalized)))

    def stats(self) -> GatewayStats:
        return self._on_loop(_call(self._live_state().stats))

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop serving and close the upstream connections (waits up to ``timeout_s``)."""
        if self._server is not None:
            self._server.should_exit = True
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("gateway: its thread did not stop within %.0f s", timeout_s)
        self._socket.close()

    def __enter__(self) -> GatewayHandle:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    # --- the serving thread ---------------------------------------------------------------------------------

    def _start(self, startup_timeout_s: float) -> None:
        self._thread.start()
        if not self._ready.wait(startup_timeout_s) or self._failure is not None:
            self.stop()
            raise RuntimeError(f"the gateway did not start on {self.host}:{self.port}") from self._failure
        logger.info("gateway listening on %s, upstreams %s", self.url, ", ".join(self._upstreams) or "(none)")

    def _run(self) -> None:
        loop = _new_event_loop()
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:  # reported to the starting thread; a crash later is logged
            self._failure = exc
            logger.error("gateway: stopped by an error", exc_info=exc)
        finally:
            self._ready.set()
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    async def _serve(self) -> None:
        import uvicorn

        self._loop = asyncio.get_running_loop()
        state = self._state = GatewayState(self.config, self._upstreams)
        app = create_app(state)
        config = uvicorn.Config(app, log_level=self.config.log_level, access_log=False,
                                lifespan="off", timeout_graceful_shutdown=5)
        self._server = server = uvicorn.Server(config)
        watcher = asyncio.create_task(watch_upstreams(state, self.config.health_check_interval_s))
        ready = asyncio.create_task(self._signal_ready(server))
        try:
            await server.serve(sockets=[self._socket])
        finally:
            watcher.cancel()
            ready.cancel()
            await state.client.aclose()
            if app.state.endpoint_spans is not None:  # the spans of the last calls leave before the gateway does
                await asyncio.to_thread(app.state.endpoint_spans.shutdown)

    async def _signal_ready(self, server: Any) -> None:
        while not server.started:
            await asyncio.sleep(0.01)
        self._ready.set()

    def _live_state(self) -> GatewayState:
        if self._state is None:
            raise RuntimeError("the gateway is not running")
        return self._state

    def _on_loop(self, coro: Coroutine[Any, Any, T], timeout_s: float = 30.0) -> T:
        if self._loop is None or not self._thread.is_alive():
            coro.close()
            raise RuntimeError("the gateway is not running")
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("GatewayHandle methods are for other threads; the gateway's own loop would block")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)


async def _call(function: Any) -> Any:
    return function()


def start_gateway(config: GatewayConfig, upstreams: list[str], startup_timeout_s: float = 30.0) -> GatewayHandle:
    """Start the gateway in a daemon thread of this process; returns once it accepts requests."""
    handle = GatewayHandle(config, upstreams)
    handle._start(startup_timeout_s)
    return handle


def _listening_socket(host: str, port: int) -> socket.socket:
    """The gateway's socket, bound here so that a taken port fails in the caller, clearly."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UserError(f"the gateway cannot listen on {host}:{port} ({exc.strerror}); choose another port, "
                        "or 0 for a free one") from exc
    sock.set_inheritable(True)
    return sock


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::", ""):
        return "127.0.0.1"  # reachable from this machine; other machines use this machine's address
    return f"[{host}]" if ":" in host else host


def _new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop where it is installed (as uvicorn picks it), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


__all__ = ["GatewayConfig", "GatewayHandle", "GatewayStats", "UpstreamStats", "start_gateway"]
