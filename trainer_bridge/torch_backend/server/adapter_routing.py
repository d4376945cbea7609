"""Which LoRA adapter serves a request, when the engine serves per-agent adapters (``adapters:``).

Called by every generating route (``chat_completions.py``, ``completions.py``, ``responses.py``,
``messages.py``) right after ``serving.check_model``; torch-free (the front end's process runs it).
The engine's adapters are ``engine.adapters`` (adapter name -> its agents; the front end in its
own process has them from the engine's ``Hello``). The rule, first match wins:

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
from spanrl.trainer_bridge.endpoint_spans import call_origin, serving_call


def engine_adapters(engine: Any) -> Mapping[str, tuple[str, ...]]:
    """The engine's adapters (adapter -> agents); empty when it serves none."""
    return getattr(engine, "adapters", None) or {}


def is_adapter_model(engine: Any, name: object) -> bool:
    """Whether ``name`` is an adapter's name or one of its agents' names."""
    adapters = engine_adapters(engine)
    return isinstance(name, str) and (name in adapters or any(name in agents for agents in adapters.values()))


def call_agent(headers: Mapping[str, str]) -> str | None:
    """The agent that made the current call, from its baggage (None when it names none)."""
    served = serving_call()
    attributes = served.origin.attributes if served is not None else call_origin(headers).attributes
    agent = attributes.get(semconv.AGENT_NAME)
    return agent if isinstance(agent, str) and agent else None


def request_adapter(engine: Any, model: object, headers: Mapping[str, str]) -> str | None:
    """The adapter that serves a request for ``model`` with these HTTP headers (module docstring),
    also noted on the call's endpoint span (``spanrl.llm.adapter``) when it is one."""
    adapter = _chosen_adapter(engine_adapters(engine), model, headers)
    served = serving_call()
    if adapter is not None and served is not None:
        served.attributes[semconv.LLM_ADAPTER] = adapter
    return adapter


def _chosen_adapter(adapters: Mapping[str, tuple[str, ...]], model: object,
                    headers: Mapping[str, str]) -> str | None:
    if not adapters:
        return None
    owner = {agent: name for name, agents in adapters.items() for agent in agents}
    if isinstance(model, str):
        if model in adapters:
            return model
        if model in owner:
            return owner[model]
    agent = call_agent({key.lower(): value for key, value in headers.items()})
    return owner.get(agent) if agent is not None else None


__all__ = ["call_agent", "engine_adapters", "is_adapter_model", "request_adapter"]
