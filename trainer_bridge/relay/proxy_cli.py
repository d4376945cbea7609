"""``spanrl proxy --upstream URL``: an OpenAI-compatible endpoint in front of any other one, until
SIGTERM or SIGINT (then the spans of the last calls are exported before it exits).

Registered by ``core/cli.py``, which builds ``ProxySettings`` (flags > ``OTEL_SPANRL_PROXY_*``
variables > the ``--config`` YAML file > defaults), prints them (keys masked) and calls
``proxy_command``. The work is ``proxy.start_proxy``: the relay of ``trainer_bridge/relay/``
with one upstream (a hosted API, vLLM, Ollama, ``spanrl serve``), emitting the endpoint's LLM
span of every call in the caller's trace. docs/proxy.md has the details. Imports nothing heavy at
module level (and the proxy never imports torch).
"""

from __future__ import annotations

import argparse
import signal
import threading
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from spanrl.errors import SettingError
from spanrl.settings_loader import CommandSettings

DEFAULT_PORT = 8200


def _setting(default: Any, help_text: str, **more: Any) -> Any:
    return field(default=default, metadata={"help": help_text, **more})


@dataclass(frozen=True)
class ProxySettings:
    upstream: str = _setting("", "the upstream's OpenAI base URL (https://api.openai.com/v1, "
                                 "http://127.0.0.1:8000/v1 for vLLM or `spanrl serve`, http://127.0.0.1:11434/v1 "
                                 "for Ollama); one without a path gets /v1")
    host: str = _setting("127.0.0.1", "bind address")
    port: int = _setting(DEFAULT_PORT, "port (0: a free one)")
    upstream_api_key: str | None = _setting(
        None, "the key sent upstream (Authorization: Bearer KEY); unset: each agent's own key is passed through "
        "(unless --token is set)", secret=True)
    token: str | None = _setting(
        None, "require 'Authorization: Bearer TOKEN' from agents (their header then never goes upstream)", secret=True)
    upstream_headers: dict = field(default_factory=dict, metadata={
        "help": "more headers sent upstream with every request, as a JSON object (values of key-like names are "
        "masked)"})
    upstream_model: str | None = _setting(None, "send every request with this model name (default: the agent's)")
    token_ids: bool = _setting(
        False, "ask the upstream for the engine's token ids and logprobs (vLLM's return_token_ids: vLLM, "
        "`spanrl serve`); off: those vLLM-only fields are removed from requests, since hosted APIs refuse them")
    record_text: bool = _setting(True, "every span carries the call's messages, tools and reply text")
    request_timeout_s: float = _setting(600.0, "a non-streamed request's whole time; for a stream, its wait for "
                                               "each next event (then 504 naming the upstream)")
    spans_endpoint: str | None = _setting(
        None, "OTLP endpoint (the receiver, e.g. http://127.0.0.1:4317) of the LLM span per call; default: "
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT; 'off' = none")
    prompts: str = _setting("", "a YAML/JSON file of prompt candidates per agent (docs/proxy.md); they can also "
                                "be set at run time by POST /spanrl/v1/prompts")
    log_level: str = _setting("warning", "uvicorn's log level (its access log stays off)")

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


SETTINGS = CommandSettings("proxy", ProxySettings, "PROXY")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "proxy", help="an OpenAI-compatible endpoint in front of any model (a hosted API too) that records "
        "every call for spanrl",
        description="Forward every OpenAI-compatible request (chat completions, completions, Responses; streamed "
        "or not; tools) to --upstream and emit the endpoint's LLM span of the call (text; token ids when the "
        "upstream returns them) in the caller's trace, with its rollout identity. Prompt candidates "
        "(--prompts) replace the agents' instructions without a code change.")
    SETTINGS.add_to(parser)
    parser.set_defaults(func=proxy_command)


def proxy_command(settings: ProxySettings) -> int:
    from spanrl.trainer_bridge.relay.proxy import start_proxy

    handle = start_proxy(settings)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    # said once the signals are handled: whoever waits for this line may stop us right away
    print(f"spanrl proxy: ready, agents call {handle.url} (base_url); requests go to {handle.upstream}", flush=True)
    try:
        while handle.running and not stop.wait(0.5):
            pass
    finally:
        handle.stop()
    print("spanrl proxy: stopped", flush=True)
    return 0
