"""How a relay treats requests: one frozen ``RelayConfig`` per relay, built by its front end.

The verl gateway (``verl_backend/gateway.GatewayConfig.relay_config``) and ``spanrl proxy``
(``proxy.ProxyConfig.relay_config``) fill it differently; everything in ``relay/`` reads it from
``RelayState.config``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from spanrl.errors import SettingError
from spanrl.trainer_bridge.model_names import ServedModelNames


@dataclass(frozen=True)
class RelayConfig:
    """What a relay does to the requests it forwards and the replies it relays."""

    name: str  # how its messages name it: "gateway", "proxy"
    # set: agents must call this model name (or one of model_names; ``*``: any name), which becomes
    # the upstream's own (read from its /v1/models); replies carry the name the agent asked for.
    # None: the agent's model passes (``upstream_model`` aside)
    served_model_name: str | None = None
    model_names: tuple[str, ...] = ()  # with a served name: the other names it answers to
    upstream_model: str | None = None  # without a served name: every request's model becomes this
    # ask every request for the engine's token ids and logprobs (vLLM's fields); False: vLLM-only
    # fields an agent sent are removed instead (hosted APIs refuse fields they do not know)
    ask_token_ids: bool = True
    temperature: float | None = None  # set: every request is sampled at it
    validation_temperature: float | None = None  # validation rollouts' temperature; None: as others
    request_timeout_s: float = 600.0  # a whole non-streamed request; a stream's wait for each event
    retry_after_s: float = 1.0  # the Retry-After of the relay's own 503s
    health_check_interval_s: float = 2.0
    # a failing upstream leaves rotation until its /health answers (several replicas); False: each
    # request tries it again (one upstream, e.g. a hosted API without /health)
    rotate_out_on_failure: bool = True
    # secrets (the token, the key, headers that may carry one) stay out of the printed settings
    api_token: str | None = field(default=None, repr=False)  # agents must send ``Authorization: Bearer <api_token>``
    upstream_api_key: str | None = field(default=None, repr=False)  # sent upstream as ``Authorization: Bearer <key>``
    # without an upstream key (and no api_token): the agent's own Authorization goes upstream
    pass_agent_key: bool = False
    upstream_headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)  # sent upstream with every request
    stamp_policy_version: bool = True  # replies carry the relay's policy version
    spans_endpoint: str | None = None  # where its LLM spans go (None: the environment's; "off": none)
    record_text: bool = False  # its spans carry the request's messages and the reply's text
    prompts: str | None = None  # a file of prompt candidates (``prompt_resources``)
    tls_cert: str | None = None  # PEM files: the relay serves HTTPS only; None: plain HTTP
    tls_key: str | None = None
    max_body_bytes: int = 32 * 1024 * 1024  # a larger request body gets 413 (as the policy server's)
    max_concurrency: int = 2048  # connections and requests at once; more get 503 at once
    # per-agent LoRA adapters the upstreams serve under their own names (adapter -> its agents): a
    # call goes upstream as its agent's adapter (adapter_specs.choose_adapter); with a served name only
    adapters: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def names(self) -> ServedModelNames | None:
        """The names a relay with a served name answers to (None: it passes any name on)."""
        if self.served_model_name is None:
            return None
        return ServedModelNames.of((self.served_model_name, *self.model_names), self.served_model_name)

    def __post_init__(self) -> None:
        if not isinstance(self.model_names, tuple):
            object.__setattr__(self, "model_names", tuple(self.model_names))
        if self.temperature is not None and self.temperature < 0:
            raise SettingError(f"{self.name} temperature {self.temperature} must be >= 0 (or unset)")
        if self.validation_temperature is not None and self.validation_temperature < 0:
            raise SettingError(f"{self.name} validation_temperature {self.validation_temperature} must be >= 0")
        for name in ("retry_after_s", "request_timeout_s", "health_check_interval_s", "max_body_bytes",
                     "max_concurrency"):
            if getattr(self, name) <= 0:
                raise SettingError(f"{self.name} {name} must be positive, got {getattr(self, name)}")


__all__ = ["RelayConfig"]
