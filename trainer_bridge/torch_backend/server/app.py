"""The embedded OpenAI-compatible policy server's app factory (FastAPI), and running it in a thread.

Called by ``spanrl serve`` (``serve_cli.py``), by ``api_process.py`` (the torch-free front end
in a child process, over a ``RemoteEngine``) and, inside the trainer's process, through
``serve_in_thread(engine, host, port)``. ``create_app`` only assembles the parts: the routes
live one module per API family (``chat_completions``, ``completions``, ``responses``, ``messages``
(Anthropic's Messages API), ``models``, ``policy``), their bodies in ``protocol``,
``responses_protocol`` and ``messages_protocol``, chat formatting in ``chat_format``, the error
mapping in ``errors``. Every response carries the serving policy version in the body
(``policy_version``) and the ``x-spanrl-policy-version`` header (names from
``spanrl.instrumentation.semconv``). Prompt resources (``trainer_bridge/endpoint_prompts.py``)
replace agents' instructions before a route sees the request, and add ``/spanrl/v1/prompts``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI, Request

from spanrl.instrumentation import semconv
from spanrl.server_connections import IDLE_CONNECTION_TIMEOUT_S
from spanrl.server_security import agent_token_matches, check_tls_pair, warn_if_exposed
from spanrl.trainer_bridge.endpoint_prompts import install_prompt_resources
from spanrl.trainer_bridge.endpoint_spans import EndpointSpans
from spanrl.trainer_bridge.model_names import ServedModelNames
from spanrl.trainer_bridge.prompt_resources import PromptResources
from spanrl.trainer_bridge.torch_backend.server import (
    chat_completions,
    completions,
    messages,
    models,
    policy,
    responses,
)
from spanrl.trainer_bridge.torch_backend.server.call_spans import CallSpanMiddleware
from spanrl.trainer_bridge.torch_backend.server.errors import (
    AuthenticationError,
    RequestTooLarge,
    error_response,
    install_error_handlers,
)
from spanrl.trainer_bridge.torch_backend.server.policy import WeightsAdmin
from spanrl.trainer_bridge.torch_backend.server.serving import ServedEngine, ServerState

if TYPE_CHECKING:  # this module runs in the torch-free API process too (api_process.py)
    from spanrl.trainer_bridge.torch_backend.engine.policy_engine import PolicyEngine

logger = logging.getLogger(__name__)

VERSION_HEADER = semconv.POLICY_VERSION_HEADER  # kept for importers of the old name

# one router per API family
ROUTERS = (chat_completions.router, completions.router, responses.router, messages.router, models.router,
           policy.router)
# Largest request body: far above any real prompt, far below what would strain memory.
MAX_BODY_BYTES = 32 * 1024 * 1024
# Connections and requests uvicorn serves at once; past it, new requests get a 503 at once
# instead of piling up (the engine's own queue is bounded too: PolicyEngine's max_queued_requests).
MAX_CONCURRENCY = 2048
# routes that do not take the agents' token: the health probe, and the weights route (its own token)
NO_AGENT_TOKEN_PATHS = (policy.HEALTH_PATH, policy.WEIGHTS_PATH)
SPANS_FROM_ENVIRONMENT = "environment"  # create_app's default: EndpointSpans.from_environment()


def create_app(engine: ServedEngine, api_token: str | None = None,
               spans: EndpointSpans | None | str = SPANS_FROM_ENVIRONMENT,
               validation_temperature: float | None = None, weights_admin: WeightsAdmin | None = None,
               model_names: Sequence[str] = (), prompts: PromptResources | str | None = None) -> FastAPI:
    """A FastAPI app serving ``engine``; requires ``Authorization: Bearer <api_token>`` (or
    ``x-api-key: <api_token>``, as Anthropic's clients send it) if set.

    ``spans``: where its LLM span per generation request goes (``trainer_bridge/endpoint_spans.py``):
    by default as the environment says (off when it names no OTLP endpoint), None for none.
    ``validation_temperature``: what validation rollouts are sampled at (``serving.ServerState``).
    ``weights_admin``: who may call ``POST /spanrl/v1/weights`` (``policy.py``); None: nobody.
    ``model_names``: the names it answers to (``*``: any; none: only the engine's own name).
    ``prompts``: its prompt resources, or a prompts file to read them from (None: none until set
    by ``POST /spanrl/v1/prompts``)."""
    # a dependency rather than an HTTP middleware: Starlette's BaseHTTPMiddleware costs every
    # request an extra task and stream, which shows at small models' request rates; and only
    # when a token is set, since solving a dependency costs each request too
    dependencies = [Depends(_bearer_token_check(api_token))] if api_token else []
    app = FastAPI(title="spanrl policy server", docs_url=None, redoc_url=None, dependencies=dependencies)
    if weights_admin is not None and api_token is not None and weights_admin.token == api_token:
        raise ValueError("the admin token must differ from the agents' token")
    app.state.server = ServerState(engine, validation_temperature=validation_temperature, api_token=api_token,
                                   weights_admin=weights_admin,
                                   model_names=ServedModelNames.of(model_names, engine.model_name))
    install_error_handlers(app)
    if not isinstance(prompts, PromptResources):
        prompts = PromptResources.from_file(prompts) if prompts else PromptResources()
    install_prompt_resources(app, prompts, api_token)  # first: inside the body limit and the span middleware
    app.add_middleware(_BodyLimit, max_bytes=MAX_BODY_BYTES)
    if spans == SPANS_FROM_ENVIRONMENT:
        spans = EndpointSpans.from_environment()
    if isinstance(spans, EndpointSpans):
        app.add_middleware(CallSpanMiddleware, spans=spans)
    app.state.endpoint_spans = spans
    for router in ROUTERS:
        app.include_router(router)
    return app


class _BodyLimit:
    """ASGI middleware: a body over ``max_bytes`` is answered 413, whether its Content-Length
    says so up front or it grows past the limit while streaming in (chunked)."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await error_response(self._too_large(int(declared)), scope.get("path", ""))(scope, receive, send)
            return
        received = 0

        async def counted_receive() -> Any:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._too_large(received)  # answered by the app's error handlers
            return message

        await self.app(scope, counted_receive, send)

    def _too_large(self, size: int) -> RequestTooLarge:
        return RequestTooLarge(f"request body of {size} bytes or more exceeds the limit of {self.max_bytes} bytes",
                               code="request_too_large")


def _bearer_token_check(api_token: str) -> Any:
    async def check_token(request: Request) -> None:
        if request.url.path not in NO_AGENT_TOKEN_PATHS:
            if not agent_token_matches(request.headers.get("authorization"), request.headers.get("x-api-key"),
                                       api_token):
                raise AuthenticationError("missing or wrong bearer token", code="invalid_api_key")

    return check_token


def check_server_security(host: str, api_token: str | None, tls_cert: str | None, tls_key: str | None) -> bool:
    """Before the server starts: its TLS files load as a pair (``TlsSetupError`` otherwise), and
    one warning if it is reachable beyond loopback without a token or TLS. Returns whether TLS is on."""
    tls = check_tls_pair(tls_cert, tls_key, "the policy server")
    warn_if_exposed("the policy server", host, bool(api_token), tls, logger, "token, tls_cert/tls_key")
    return tls


def url_of(host: str, port: int, tls: bool) -> str:
    """``http(s)://host:port`` as a client on this machine writes it."""
    shown = "127.0.0.1" if host in ("0.0.0.0", "", "::") else (f"[{host}]" if ":" in host else host)
    return f"{'https' if tls else 'http'}://{shown}:{port}"


@dataclass
class ServerHandle:
    """A server running in a background thread: ``url`` (``http://host:port``), ``stop()``."""

    url: str
    host: str
    port: int
    server: Any
    thread: threading.Thread
    engine: PolicyEngine
    owns_engine: bool

    @property
    def base_url(self) -> str:
        """The OpenAI client's ``base_url`` (``.../v1``)."""
        return f"{self.url}/v1"

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        if self.owns_engine:
            self.engine.stop()


def serve_in_thread(engine: PolicyEngine, host: str = "127.0.0.1", port: int = 0,
                    api_token: str | None = None, log_level: str = "warning",
                    startup_timeout: float = 30.0, validation_temperature: float | None = None,
                    weights_admin: WeightsAdmin | None = None, tls_cert: str | None = None,
                    tls_key: str | None = None, max_concurrency: int = MAX_CONCURRENCY,
                    model_names: Sequence[str] = (), prompts: PromptResources | str | None = None) -> ServerHandle:
    """Run the server for ``engine`` in a daemon thread of this process; ``port=0`` picks a free one.

    Starts the engine if it is not running (and then stops it in ``handle.stop()``). With
    ``tls_cert``/``tls_key`` it speaks HTTPS only.
    """
    import uvicorn

    tls = check_server_security(host, api_token, tls_cert, tls_key)
    owns_engine = not engine.is_running
    engine.start()
    app = create_app(engine, api_token, validation_temperature=validation_temperature, weights_admin=weights_admin,
                     model_names=model_names, prompts=prompts)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False, lifespan="off",
                            timeout_keep_alive=IDLE_CONNECTION_TIMEOUT_S,
                            limit_concurrency=max_concurrency, ssl_certfile=tls_cert, ssl_keyfile=tls_key)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="spanrl-policy-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            if owns_engine:
                engine.stop()
            raise RuntimeError(f"the policy server did not start on {host}:{port}")
        time.sleep(0.02)
    bound_port = server.servers[0].sockets[0].getsockname()[1]
    url = url_of(host, bound_port, tls)
    logger.info("policy server listening on %s (model %s, version %d)", url, engine.model_name, engine.version)
    return ServerHandle(url, host, bound_port, server, thread, engine, owns_engine)


__all__ = ["create_app", "check_server_security", "serve_in_thread", "url_of", "ServerHandle", "ROUTERS",
           "VERSION_HEADER", "MAX_CONCURRENCY", "WeightsAdmin"]
