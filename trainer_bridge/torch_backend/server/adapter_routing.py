"""Which LoRA adapter serves a request, when the engine serves per-agent adapters (``adapters:``).

Called by every generating route (``chat_completions.py``, ``completions.py``, ``responses.py``,
``messages.py``) right after ``serving.check_model``; torch-free (the front end's process runs it).
The engine's adapters are ``engine.adapters`` (adapter name -> its agents; the front end in its
own process has them from the engine's ``Hello``). The rule (``adapter_specs.choose_adapter``,
which the verl gateway follows too), first match wins:

1. the requested ``model`` names an adapter, or one of an adapter's agents;
2. the call's agent, from the caller's W3C baggage (``spanrl.agent.name``, which
   ``spanrl.instrumentation.agent()`` sets; the same origin the endpoint's span records),
   is one of an adapter's agents;
3. else the base model (``None``).

Adapter and agent names are model names the endpoint answers to (``is_adapter_model``); any other
name follows the endpoint's model-name rule (``trainer_bridge/model_names.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from spanrl.instrumentation import semconv
from spanrl.trainer_bridge.adapter_specs import choose_adapter, names_an_adapter
from spanrl.trainer_bridge.endpoint_spans import call_agent, serving_call


def engine_adapters(engine: Any) -> Mapping[str, tuple[str, ...]]:
    """The engine's adapters (adapter -> agents); empty when it serves none."""
    return getattr(engine, "adapters", None) or {}


def is_adapter_model(engine: Any, name: object) -> bool:
    """Whether ``name`` is an adapter's name or one of its agents' names."""
    return names_an_adapter(engine_adapters(engine), name)


def request_adapter(engine: Any, model: object, headers: Mapping[str, str]) -> str | None:
    """The adapter that serves a request for ``model`` with these HTTP headers (module docstring),
    also noted on the call's endpoint span (``spanrl.llm.adapter``) when it is one."""
    adapters = engine_adapters(engine)
    agent = call_agent({key.lower(): value for key, value in headers.items()}) if adapters else None
    adapter = choose_adapter(adapters, model, agent)
    served = serving_call()
    if adapter is not None and served is not None:
        served.attributes[semconv.LLM_ADAPTER] = adapter
    return adapter


__all__ = ["engine_adapters", "is_adapter_model", "request_adapter"]
