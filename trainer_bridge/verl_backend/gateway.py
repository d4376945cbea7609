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
(when set, agents must send ``Authorization: Bearer <token>``), ``upstream_api_key`` (sent to
the upstreams as their bearer token: verl's vLLM replicas require one), ``spans_endpoint`` (where
the gateway's own LLM span per request goes over OTLP, ``trainer_bridge/endpoint_spans.py``; None:
``OTEL_SPANRL_SERVE_SPANS_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_*`` as for ``spanrl serve``; ``off``:
none), ``tls_cert``/``tls_key`` (PEM files: HTTPS only), ``max_body_bytes`` (a larger request
body gets 413), ``max_concurrency`` (connections and requests at once; more get 503 at once),
``adapters`` (per-agent LoRA adapters the replicas serve: a call is sent upstream under the model
name of its agent's adapter, ``adapter_specs.choose_adapter``; their names are listed and served).
Bound beyond loopback without a token, or with a token but no TLS, it logs one warning.

The gateway is the relay of ``trainer_bridge/relay/`` (the same code as ``spanrl proxy``) with
the replicas as upstreams: ``relay_config()`` says how it treats requests; what is its own is the
pause gate and its stats (``gateway_state.py``, ``gateway_app.py``). What passes through:
``POST /v1/chat/completions``, ``/v1/completions`` and ``/v1/responses`` (streamed or not, event
by event), ``GET /v1/models`` (the served name), ``GET /health``, ``GET /spanrl/gateway/stats``,
``GET``/``POST /spanrl/v1/prompts`` (prompt resources: ``prompts`` names a file of them); other
routes are OpenAI-style 404s. A rollout's calls go to one upstream while it is up (prefix
cache reuse), found from ``x-spanrl-rollout-id``, the ``spanrl.rollout.id`` baggage entry or the
``traceparent`` trace id; other calls go to the least loaded. Requests ask for
``return_token_ids`` and logprobs whatever the agent asked; replies carry the policy version in
``x-spanrl-policy-version`` and a top-level ``policy_version`` (every SSE chunk too), as
spanrl's embedded server writes them. An upstream that cannot be reached gives that request a
502 naming it (504 when it does not answer in time) and leaves rotation until its ``/health``
answers; with none up, requests get 503 with ``Retry-After``.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass, field

from spanrl.errors import SettingError
from spanrl.trainer_bridge.model_names import ANY_NAME, ServedModelNames
from spanrl.trainer_bridge.prompt_resources import PromptResources
from spanrl.trainer_bridge.relay.config import RelayConfig
from spanrl.trainer_bridge.relay.server_thread import RelayServer
from spanrl.trainer_bridge.relay.upstreams import UpstreamStats, normalize_upstream_url
from spanrl.trainer_bridge.verl_backend.gateway_app import create_app
from spanrl.trainer_bridge.verl_backend.gateway_state import GatewayState, GatewayStats

logger = logging.getLogger(__name__)


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
    api_token: str | None = field(default=None, repr=False)
    upstream_api_key: str | None = field(default=None, repr=False)  # the replicas' token (VLLM_API_KEY)
    log_level: str = "warning"  # uvicorn's
    spans_endpoint: str | None = None  # OTLP endpoint of its LLM spans; None: the environment's; "off": none
    prompts: str | None = None  # a file of prompt resources (trainer_bridge/prompt_resources.py)
    tls_cert: str | None = None
    tls_key: str | None = None
    max_body_bytes: int = 32 * 1024 * 1024  # as the embedded policy server's
    max_concurrency: int = 2048
    # per-agent LoRA adapters the replicas serve (adapter -> its agents; verl_backend/adapters.py):
    # a call goes to its agent's adapter (adapter_specs.choose_adapter), others to the base model
    adapters: tuple[tuple[str, tuple[str, ...]], ...] = ()

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
        for name in ("retry_after_s", "request_timeout_s", "health_check_interval_s", "max_body_bytes",
                     "max_concurrency"):
            if getattr(self, name) <= 0:
                raise SettingError(f"gateway {name} must be positive, got {getattr(self, name)}")

    def relay_config(self) -> RelayConfig:
        """The relay's settings for the gateway: token ids asked, a failing replica out of rotation."""
        return RelayConfig(
            name="gateway", served_model_name=self.served_model_name, model_names=self.model_names, ask_token_ids=True,
            temperature=self.temperature, validation_temperature=self.validation_temperature,
            request_timeout_s=self.request_timeout_s, retry_after_s=self.retry_after_s,
            health_check_interval_s=self.health_check_interval_s, rotate_out_on_failure=True,
            api_token=self.api_token, upstream_api_key=self.upstream_api_key, stamp_policy_version=True,
            spans_endpoint=self.spans_endpoint, prompts=self.prompts, tls_cert=self.tls_cert, tls_key=self.tls_key,
            max_body_bytes=self.max_body_bytes, max_concurrency=self.max_concurrency, adapters=self.adapters)


class GatewayHandle:
    """A gateway running in a background thread of this process (its own event loop); ``prompts``
    is its live ``PromptResources`` (thread-safe); ``bound``: its socket, bound earlier on
    ``config.host:config.port`` (``listening_socket``), or None to bind it here."""

    def __init__(self, config: GatewayConfig, upstreams: list[str], bound: socket.socket | None = None):
        self.config = config
        self._upstreams = list(upstreams)
        self.prompts = PromptResources.from_file(config.prompts) if config.prompts else PromptResources()
        self._server = RelayServer("gateway", config.host, config.port, lambda: GatewayState(config, self._upstreams),
                                   lambda state: create_app(state, self.prompts), config.relay_config(),
                                   config.log_level, exposure_hint="policy_token, tls_cert/tls_key", bound=bound)
        self.tls = self._server.tls
        self.port: int = self._server.port
        self.host = config.host

    @property
    def url(self) -> str:
        """The agents' OpenAI ``base_url``: ``http://host:port/v1``."""
        return self._server.url

    @property
    def policy_version(self) -> int:
        return self._state().policy_version or 0

    def pause(self, timeout_s: float = 120.0) -> bool:
        """Hold new requests; True once no request is in flight, False if some still are after
        ``timeout_s`` (the gateway stays paused either way)."""
        drained = self._server.on_loop(self._state().gate.pause(timeout_s), timeout_s + 10.0)
        if not drained:
            logger.warning("gateway: paused, but %d requests were still in flight after %.0f s",
                           self._state().gate.in_flight, timeout_s)
        return drained

    def resume(self) -> None:
        """Let requests through again (those waiting go on at once)."""
        self._server.call(self._state().gate.resume)

    def set_policy_version(self, version: int) -> None:
        """The version stamped on replies to requests admitted from now on."""
        self._state().policy_version = int(version)

    def set_upstreams(self, urls: list[str]) -> None:
        """Replace the upstream servers (``host:port`` or ``http://host:port[/v1]``)."""
        normalized = [normalize_upstream_url(u) for u in urls]
        self._server.call(lambda: self._state().pool.set_urls(normalized))

    def stats(self) -> GatewayStats:
        return self._server.call(self._state().stats)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop serving and close the upstream connections (waits up to ``timeout_s``)."""
        self._server.stop(timeout_s)

    def __enter__(self) -> GatewayHandle:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def _start(self, startup_timeout_s: float) -> None:
        self._server.start(startup_timeout_s)
        logger.info("gateway listening on %s, upstreams %s", self.url, ", ".join(self._upstreams) or "(none)")

    def _state(self) -> GatewayState:
        state = self._server.state
        assert isinstance(state, GatewayState)
        return state


def start_gateway(config: GatewayConfig, upstreams: list[str], startup_timeout_s: float = 30.0,
                  bound: socket.socket | None = None) -> GatewayHandle:
    """Start the gateway in a daemon thread of this process; returns once it accepts requests."""
    handle = GatewayHandle(config, upstreams, bound)
    handle._start(startup_timeout_s)
    return handle


__all__ = ["GatewayConfig", "GatewayHandle", "GatewayStats", "UpstreamStats", "start_gateway"]
