"""``spanrl proxy``: the relay with one upstream of any kind, started in a thread of this process.

Called by ``proxy_cli.proxy_command`` (and by tests, and by anything that wants the proxy
in-process)::

    handle = start_proxy(ProxySettings(upstream="https://api.openai.com/v1", spans_endpoint="http://127.0.0.1:4317"))
    handle.url        # the agents' base_url, http://127.0.0.1:8200/v1
    handle.prompts    # its live PromptResources (also GET/POST /spanrl/v1/prompts)
    handle.stop()

How it differs from the verl gateway (both are ``relay/``): the agent's model name passes (or
becomes ``upstream_model``); the upstream is asked for token ids only with ``token_ids`` (else the
vLLM-only fields are removed, since a hosted API refuses them); a failed upstream stays the upstream
(every request tries it: 502 or 504 naming it, never a hang); the key sent upstream is the proxy's
(``upstream_api_key``) or the agent's own; replies are not stamped with a policy version of the
proxy's; the span of each call carries its text (``record_text``). Keys never reach a log or a span:
spans are built from bodies, never headers, and settings print them as ``***``.
"""

from __future__ import annotations

import logging

from spanrl.trainer_bridge.prompt_resources import PromptResources
from spanrl.trainer_bridge.relay.app import create_relay_app
from spanrl.trainer_bridge.relay.config import RelayConfig
from spanrl.trainer_bridge.relay.proxy_settings import ProxySettings
from spanrl.trainer_bridge.relay.server_thread import RelayServer
from spanrl.trainer_bridge.relay.state import RelayState
from spanrl.trainer_bridge.relay.upstreams import display_url, normalize_base_url

logger = logging.getLogger(__name__)


def relay_config(settings: ProxySettings) -> RelayConfig:
    """The relay's settings for a proxy (the module docstring says how they differ from the gateway's)."""
    return RelayConfig(
        name="proxy", served_model_name=None, upstream_model=settings.upstream_model, ask_token_ids=settings.token_ids,
        request_timeout_s=settings.request_timeout_s, rotate_out_on_failure=False, api_token=settings.token,
        upstream_api_key=settings.upstream_api_key, pass_agent_key=True,
        upstream_headers=tuple(sorted(settings.upstream_headers.items())), stamp_policy_version=False,
        spans_endpoint=settings.spans_endpoint, record_text=settings.record_text, prompts=settings.prompts or None)


class ProxyHandle:
    """A proxy serving from a daemon thread of this process."""

    def __init__(self, settings: ProxySettings):
        self.settings = settings
        self.upstream = display_url(normalize_base_url(settings.upstream))
        config = relay_config(settings)
        self.prompts = PromptResources.from_file(settings.prompts) if settings.prompts else PromptResources()
        self._server = RelayServer("proxy", settings.host, settings.port,
                                   lambda: RelayState(config, [settings.upstream], base_urls=True),
                                   lambda state: create_relay_app(state, prompts=self.prompts), settings.log_level)
        self.port = self._server.port

    @property
    def url(self) -> str:
        """The agents' OpenAI ``base_url``: ``http://host:port/v1``."""
        return self._server.url

    @property
    def running(self) -> bool:
        return self._server.thread.is_alive()

    def start(self, startup_timeout_s: float = 30.0) -> ProxyHandle:
        self._server.start(startup_timeout_s)
        logger.info("proxy listening on %s, upstream %s", self.url, self.upstream)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop serving; the spans of the last calls are exported first."""
        self._server.stop(timeout_s)

    def __enter__(self) -> ProxyHandle:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()


def start_proxy(settings: ProxySettings, startup_timeout_s: float = 30.0) -> ProxyHandle:
    """Start a proxy in a daemon thread; returns once it accepts requests."""
    return ProxyHandle(settings).start(startup_timeout_s)


__all__ = ["ProxyHandle", "ProxySettings", "relay_config", "start_proxy"]
