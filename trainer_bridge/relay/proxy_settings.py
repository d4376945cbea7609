"""``spanrl proxy``'s settings: ``ProxySettings`` (one frozen dataclass, read by
``settings_loader`` from flags > ``OTEL_SPANRL_PROXY_*`` variables > YAML > defaults).

Used by ``proxy_cli.py`` (the command) and ``proxy.py`` (``start_proxy``); a module of its own so
that the two need not import each other. Stdlib and ``spanrl`` core only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

from spanrl.errors import SettingError
from spanrl.settings_loader import setting

DEFAULT_PORT = 8200


@dataclass(frozen=True)
class ProxySettings:
    upstream: str = setting("", "the upstream's OpenAI base URL (https://api.openai.com/v1, "
                                 "http://127.0.0.1:8000/v1 for vLLM or `spanrl serve`, http://127.0.0.1:11434/v1 "
                                 "for Ollama); one without a path gets /v1")
    host: str = setting("127.0.0.1", "bind address")
    port: int = setting(DEFAULT_PORT, "port (0: a free one)")
    upstream_api_key: str | None = setting(
        None, "the key sent upstream (Authorization: Bearer KEY); unset: each agent's own key is passed through "
        "(unless --token is set)", secret=True)
    token: str | None = setting(
        None, "require 'Authorization: Bearer TOKEN' from agents (their header then never goes upstream)", secret=True)
    upstream_headers: dict = field(default_factory=dict, metadata={
        "help": "more headers sent upstream with every request, as a JSON object (values of key-like names are "
        "masked)"})
    upstream_model: str | None = setting(None, "send every request with this model name (default: the agent's)")
    token_ids: bool = setting(
        False, "ask the upstream for the engine's token ids and logprobs (vLLM's return_token_ids: vLLM, "
        "`spanrl serve`); off: those vLLM-only fields are removed from requests, since hosted APIs refuse them")
    record_text: bool = setting(True, "every span carries the call's messages, tools and reply text")
    request_timeout_s: float = setting(600.0, "a non-streamed request's whole time; for a stream, its wait for "
                                               "each next event (then 504 naming the upstream)")
    spans_endpoint: str | None = setting(
        None, "OTLP endpoint (the receiver, e.g. http://127.0.0.1:4317) of the LLM span per call; default: "
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT; 'off' = none")
    prompts: str = setting("", "a YAML/JSON file of prompt candidates per agent (docs/proxy.md); they can also "
                                "be set at run time by POST /spanrl/v1/prompts")
    log_level: str = setting("warning", "uvicorn's log level (its access log stays off)")

    def __post_init__(self) -> None:
        if not self.upstream:
            raise SettingError("give the upstream's OpenAI base URL: spanrl proxy --upstream https://api.openai.com/v1")
        parts = urlsplit(self.upstream if "://" in self.upstream else f"http://{self.upstream}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise SettingError(f"upstream must be an http(s) URL such as https://api.openai.com/v1, got "
                               f"{parts.scheme}://{parts.hostname or ''}")
        if not 0 <= self.port <= 65535:
            raise SettingError(f"port {self.port} is not a port number (0 picks a free one)")
        if self.request_timeout_s <= 0:
            raise SettingError(f"request_timeout_s must be positive, got {self.request_timeout_s}")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in self.upstream_headers.items()):
            raise SettingError("upstream_headers must map header names to strings")


__all__ = ["DEFAULT_PORT", "ProxySettings"]
