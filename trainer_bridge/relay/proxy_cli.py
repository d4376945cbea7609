"""``spanrl proxy --upstream URL``: an OpenAI-compatible endpoint in front of any other one, until
SIGTERM or SIGINT (then the spans of the last calls are exported before it exits).

Registered by ``core/cli.py``, which builds ``ProxySettings`` (``proxy_settings.py``; flags >
``OTEL_SPANRL_PROXY_*`` variables > the ``--config`` YAML file > defaults), prints them (keys masked) and calls
``proxy_command``. The work is ``proxy.start_proxy``: the relay of ``trainer_bridge/relay/``
with one upstream (a hosted API, vLLM, Ollama, ``spanrl serve``), emitting the endpoint's LLM
span of every call in the caller's trace. docs/proxy.md has the details. Imports nothing heavy at
module level (and the proxy never imports torch).
"""

from __future__ import annotations

import argparse
import signal
import threading

from spanrl.settings_loader import CommandSettings
from spanrl.trainer_bridge.relay.proxy_settings import ProxySettings

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
