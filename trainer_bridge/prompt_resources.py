"""Prompt resources: named candidates for an agent's instructions, which the endpoint serves in
place of the agent's own (the agent's code keeps its prompt; the endpoint decides what the model sees).

One ``PromptResources`` per endpoint: ``spanrl proxy``, ``spanrl serve`` / the torch backend's
server and the verl gateway all hold one, and ``endpoint_prompts.PromptMiddleware`` applies it to
each generation request before the route sees it. Torch-free.

- A *resource* is named for the agent it serves: the agent's name as the receiver names it (the
  ``spanrl.agent.name`` baggage entry ``spanrl.instrumentation.agent()`` sets), or the ``model`` the
  agent requests. A call takes the resource named for its agent, else the one named for its model.
- A resource holds *candidates* (name -> instructions). Its ``active`` one (optional) is served to
  every call; a rollout can be given another (``assign``: what an optimizer such as APO calls to
  evaluate candidates side by side, one per rollout), which wins for that rollout's calls.
- What is replaced (``substitute_instructions``): on ``/v1/chat/completions`` the first ``system``
  or ``developer`` message's content (a system message is put first when there is none); on
  ``/v1/responses`` the ``instructions`` (or, without them, the first system/developer input
  message); on Anthropic's ``/v1/messages`` the top-level ``system`` (a string or text blocks,
  set when there is none). Text completions have no instructions and pass unchanged.

The file format (``--prompts FILE``, YAML or JSON; what ``spanrl prompts export`` writes)::

    planner:                        # a resource: an agent name, or a model name
      active: concise               # optional
      candidates:
        concise: "Plan in one line."
        detailed: "Plan step by step."
    writer: "Answer in French."     # shorthand: one candidate, "default", active
"""

from __future__ import annotations

import copy
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from spanrl.errors import SettingError, UserError

DEFAULT_CANDIDATE = "default"
CHAT_PATH, RESPONSES_PATH, MESSAGES_PATH = "/v1/chat/completions", "/v1/responses", "/v1/messages"
INSTRUCTION_ROLES = ("system", "developer")
MAX_ASSIGNED_ROLLOUTS = 100_000  # per resource; the least recently assigned is forgotten first


class PromptResourceError(UserError):
    """A prompt file, or an update of the resources, that cannot be used (the message says why)."""


@dataclass(frozen=True)
class PromptChoice:
    """The instructions one call is served: which resource, which candidate, its text."""

    resource: str
    candidate: str
    text: str


@dataclass
class _Resource:
    candidates: dict[str, str]
    active: str | None = None
    assigned: OrderedDict[str, str] = field(default_factory=OrderedDict)  # rollout id -> candidate


class PromptResources:
    """The resources of one endpoint; safe to use from any thread."""

    def __init__(self, resources: dict[str, Any] | None = None) -> None:
        self._lock = threading.Lock()
        self._resources: dict[str, _Resource] = {}
        for name, spec in (resources or {}).items():
            candidates, active = parse_resource(name, spec)
            self.set_candidates(name, candidates, active)

    @classmethod
    def from_file(cls, path: str) -> PromptResources:
        """The resources of a prompts file (see the module docstring)."""
        if not os.path.isfile(path):
            raise PromptResourceError(f"prompts file {path!r} not found")
        from spanrl.settings_loader import read_settings_file

        try:
            return cls(read_settings_file(path))
        except SettingError as exc:
            raise PromptResourceError(f"prompts file {path}: {exc}") from exc
        except PromptResourceError as exc:
            raise PromptResourceError(f"prompts file {path}: {exc}") from exc

    @property
    def empty(self) -> bool:
        return not self._resources

    def set_candidates(self, resource: str, candidates: dict[str, str], active: str | None = None) -> None:
        """Give ``resource`` these candidates (replacing its earlier ones; rollouts assigned a
        candidate that is gone fall back to ``active``)."""
        candidates, active = parse_resource(resource, {"candidates": candidates, "active": active})
        with self._lock:
            previous = self._resources.get(resource)
            kept = OrderedDict((rollout, name) for rollout, name in (previous.assigned.items() if previous else ())
                               if name in candidates)
            self._resources[resource] = _Resource(dict(candidates), active, kept)

    def set_active(self, resource: str, candidate: str | None) -> None:
        """Serve ``candidate`` to every call of ``resource`` (None: the agent's own instructions)."""
        with self._lock:
            entry = self._entry(resource)
            if candidate is not None and (not isinstance(candidate, str) or candidate not in entry.candidates):
                raise PromptResourceError(_unknown(resource, candidate, entry))
            entry.active = candidate

    def assign(self, resource: str, assignments: dict[str, str]) -> None:
        """Serve each rollout id of ``assignments`` its candidate (for that rollout's calls only)."""
        with self._lock:
            entry = self._entry(resource)
            for rollout_id, candidate in assignments.items():
                if not isinstance(rollout_id, str) or not rollout_id:
                    raise PromptResourceError(f"prompt resource {resource!r}: a rollout id must be a non-empty "
                                              f"string, got {rollout_id!r}")
                if not isinstance(candidate, str) or candidate not in entry.candidates:
                    raise PromptResourceError(_unknown(resource, str(candidate), entry))
            for rollout_id, candidate in assignments.items():
                entry.assigned[rollout_id] = candidate
                entry.assigned.move_to_end(rollout_id)
            while len(entry.assigned) > MAX_ASSIGNED_ROLLOUTS:
                entry.assigned.popitem(last=False)

    def remove(self, resource: str) -> None:
        with self._lock:
            self._resources.pop(resource, None)

    def choose(self, agent_name: str | None, model: str | None, rollout_id: str | None) -> PromptChoice | None:
        """The instructions for a call of ``agent_name`` asking for ``model`` in ``rollout_id``; None:
        the agent's own."""
        with self._lock:
            name = agent_name if agent_name in self._resources else model if model in self._resources else None
            if name is None:
                return None
            entry = self._resources[name]
            candidate = entry.assigned.get(rollout_id) if rollout_id else None
            candidate = candidate or entry.active
            if candidate is None:
                return None
            return PromptChoice(name, candidate, entry.candidates[candidate])

    def snapshot(self) -> dict[str, Any]:
        """Every resource: its active candidate, its candidates, how many rollouts are assigned one
        (the body of ``GET /spanrl/v1/prompts``)."""
        with self._lock:
            return {name: {"active": entry.active, "candidates": dict(entry.candidates),
                           "assigned_rollouts": len(entry.assigned)} for name, entry in self._resources.items()}

    def _entry(self, resource: str) -> _Resource:
        entry = self._resources.get(resource)
        if entry is None:
            known = ", ".join(sorted(self._resources)) or "none"
            raise PromptResourceError(f"no prompt resource {resource!r} (known: {known}); give it candidates first")
        return entry


def _unknown(resource: str, candidate: str, entry: _Resource) -> str:
    return (f"prompt resource {resource!r} has no candidate {candidate!r} "
            f"(its candidates: {', '.join(sorted(entry.candidates))})")


def parse_resource(name: Any, spec: Any) -> tuple[dict[str, str], str | None]:
    """``(candidates, active)`` of one resource as a prompts file or an update gives it."""
    if not isinstance(name, str) or not name:
        raise PromptResourceError(f"a prompt resource is named by a non-empty string, got {name!r}")
    if isinstance(spec, str):
        return {DEFAULT_CANDIDATE: spec}, DEFAULT_CANDIDATE
    if not isinstance(spec, dict):
        raise PromptResourceError(f"prompt resource {name!r}: expected instructions (a string) or a mapping "
                                  f"with 'candidates' and 'active', got {type(spec).__name__}")
    unknown = sorted(set(spec) - {"candidates", "active"})
    if unknown:
        raise PromptResourceError(f"prompt resource {name!r}: unknown keys {unknown} (it takes candidates, active)")
    candidates = spec.get("candidates")
    if not isinstance(candidates, dict) or not candidates:
        raise PromptResourceError(f"prompt resource {name!r}: 'candidates' must map candidate names to instructions")
    for candidate, text in candidates.items():
        if not isinstance(candidate, str) or not candidate or not isinstance(text, str):
            raise PromptResourceError(f"prompt resource {name!r}: candidate {candidate!r} must be a name with "
                                      f"instructions as a string, got {type(text).__name__}")
    active = spec.get("active")
    if active is not None and (not isinstance(active, str) or active not in candidates):
        raise PromptResourceError(f"prompt resource {name!r}: active {active!r} is not one of its candidates "
                                  f"({', '.join(sorted(candidates))})")
    return dict(candidates), active


def substitute_instructions(body: dict[str, Any], path: str, text: str) -> dict[str, Any] | None:
    """``body`` with its instructions replaced by ``text`` (a copy), or None for a route without
    instructions (text completions)."""
    if path == CHAT_PATH and isinstance(body.get("messages"), list):
        new = dict(body)
        messages = list(body["messages"])
        for index, message in enumerate(messages):
            if isinstance(message, dict) and message.get("role") in INSTRUCTION_ROLES:
                messages[index] = {**message, "content": text}
                break
        else:
            messages.insert(0, {"role": "system", "content": text})
        new["messages"] = messages
        return new
    if path == RESPONSES_PATH:
        new = dict(body)
        items = body.get("input")
        if body.get("instructions") is None and isinstance(items, list):
            for index, item in enumerate(items):
                if isinstance(item, dict) and item.get("role") in INSTRUCTION_ROLES:
                    replaced = copy.copy(items)
                    replaced[index] = {**item, "content": text}
                    new["input"] = replaced
                    return new
        new["instructions"] = text
        return new
    if path == MESSAGES_PATH:
        return {**body, "system": text}
    return None


__all__ = ["DEFAULT_CANDIDATE", "PromptChoice", "PromptResourceError", "PromptResources", "parse_resource",
           "substitute_instructions"]
