"""One LoRA adapter per trained agent: the ``adapters:`` setting of ``train.yaml``, read and checked.

Torch-free (``--help`` and settings files read it). ``TrainerConfig.adapters`` holds the mapping
as the user wrote it (adapter name -> ``{agents, rank, alpha, target_modules, learning_rate}``);
``parse_adapters`` turns it into ``AdapterSpec``s or raises ``SettingError`` naming what is wrong.
``samples_by_adapter`` splits a step's samples by the adapter of their agent. The torch backend
trains each adapter on its agents' transitions (``torch_backend/multi_adapter.py``) and serves
them all at once on the frozen base model (``torch_backend/engine/multi_lora.py``); the verl
backend trains them one after another in verl's LoRA actor and vLLM serves them
(``verl_backend/adapters.py``); ``docs/policy.md`` "One adapter per agent".
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from spanrl.errors import SettingError

if TYPE_CHECKING:
    from spanrl.trainer_bridge.backend import TrainingSample

logger = logging.getLogger(__name__)

ADAPTER_KEYS = ("agents", "rank", "alpha", "target_modules", "learning_rate")
DEFAULT_RANK = 8
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
RESERVED_NAMES = ("default",)  # peft's name of an unnamed adapter (saved at a folder's top)
# in an adapter's ``agents``: every agent no other adapter names, and calls that name no agent
# (``verl.lora_rank`` is one such adapter: verl_backend/config.py)
EVERY_AGENT = "*"


@dataclass(frozen=True)
class AdapterSpec:
    """One adapter: its name, the agents whose transitions train it and whose calls it serves,
    LoRA's rank, alpha and target modules, and its own learning rate (None: the run's)."""

    name: str
    agents: tuple[str, ...]
    rank: int = DEFAULT_RANK
    alpha: int = 2 * DEFAULT_RANK
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    learning_rate: float | None = None

    @property
    def scaling(self) -> float:
        """LoRA's ``alpha / rank``: the factor of ``B @ A``."""
        return self.alpha / self.rank


def parse_adapters(raw: Mapping[str, Any] | None) -> tuple[AdapterSpec, ...]:
    """``adapters:`` as written -> its specs, in the order written; ``SettingError`` for unknown
    keys, bad names or values, and an agent listed by two adapters."""
    if not raw:
        return ()
    if not isinstance(raw, Mapping):
        raise SettingError("adapters: must be a mapping of adapter name -> {agents, rank, alpha, ...}")
    specs = tuple(_spec(str(name), entry) for name, entry in raw.items())
    owner: dict[str, str] = {}
    for spec in specs:
        for agent in spec.agents:
            if agent in owner:
                raise SettingError(f"adapters: the agent {agent!r} is in two adapters ({owner[agent]!r} and "
                                   f"{spec.name!r}); an agent's calls are trained and served by one adapter")
            owner[agent] = spec.name
    return specs


def _spec(name: str, entry: Any) -> AdapterSpec:
    where = f"adapters.{name}"
    if not _NAME.match(name) or name in RESERVED_NAMES:
        raise SettingError(f"{where}: an adapter name is 1-64 letters, digits, '_', '.' or '-', not "
                           f"{RESERVED_NAMES}; got {name!r}")
    entry = {} if entry is None else entry
    if not isinstance(entry, Mapping):
        raise SettingError(f"{where}: must be a mapping with some of {list(ADAPTER_KEYS)}, got {entry!r}")
    unknown = sorted(set(entry) - set(ADAPTER_KEYS))
    if unknown:
        raise SettingError(f"{where}: unknown keys {unknown}; known: {list(ADAPTER_KEYS)}")
    agents = _names(entry.get("agents", [name]), f"{where}.agents")
    if not agents:
        raise SettingError(f"{where}.agents: list at least one agent (default: the adapter's name)")
    rank = _number(entry.get("rank", DEFAULT_RANK), int, f"{where}.rank")
    if rank <= 0:
        raise SettingError(f"{where}.rank must be a positive whole number, got {rank}")
    alpha = _number(entry.get("alpha", 2 * rank), int, f"{where}.alpha")
    if alpha <= 0:
        raise SettingError(f"{where}.alpha must be a positive whole number, got {alpha}")
    targets = _names(entry.get("target_modules", list(DEFAULT_TARGETS)), f"{where}.target_modules")
    if not targets:
        raise SettingError(f"{where}.target_modules: name at least one module (e.g. q_proj)")
    rate = entry.get("learning_rate")
    learning_rate = None if rate is None else _number(rate, float, f"{where}.learning_rate")
    if learning_rate is not None and learning_rate <= 0:
        raise SettingError(f"{where}.learning_rate must be positive, got {learning_rate}")
    return AdapterSpec(name, agents, rank, alpha, targets, learning_rate)


def _names(value: Any, where: str) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) and i.strip() for i in items):
        raise SettingError(f"{where} must be a list of names, got {value!r}")
    return tuple(dict.fromkeys(i.strip() for i in items))


def _number(value: Any, kind: type, where: str) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SettingError(f"{where} must be a number, got {value!r}")
    if kind is int and float(value) != int(value):
        raise SettingError(f"{where} must be a whole number, got {value!r}")
    return kind(value)


def adapter_of_agent(specs: tuple[AdapterSpec, ...]) -> dict[str, str]:
    """Agent name -> the name of the adapter that trains and serves it (``EVERY_AGENT``: the
    adapter of every agent no other adapter names, if one says so)."""
    return {agent: spec.name for spec in specs for agent in spec.agents}


def samples_by_adapter(specs: Sequence[AdapterSpec],
                       samples: Sequence[TrainingSample]) -> dict[str, list[TrainingSample]]:
    """The samples each adapter trains on (by ``agent_name``), in ``specs``' order; adapters
    without samples are left out, and so are samples of agents no adapter names."""
    owner = adapter_of_agent(tuple(specs))
    groups: dict[str, list[TrainingSample]] = {spec.name: [] for spec in specs}
    for sample in samples:
        name = owner.get(sample.agent_name or "", owner.get(EVERY_AGENT))
        if name is not None:
            groups[name].append(sample)
    return {name: group for name, group in groups.items() if group}


def warn_unseen_agents(specs: Sequence[AdapterSpec], agents_seen: set[str], steps: int) -> None:
    """Once per run, at its end: each adapter's agents no update ever had a transition of (a
    misspelt agent name, or an agent the run never called): their adapters never trained."""
    if steps == 0:
        return
    for spec in specs:
        unseen = [agent for agent in spec.agents if agent not in agents_seen and agent != EVERY_AGENT]
        if unseen:
            seen = ", ".join(sorted(agents_seen)) or "none"
            logger.warning("adapter %r: no transition of its agent(s) %s reached an update in this run (%d steps; "
                           "agents seen: %s): check the agent names in adapters:", spec.name,
                           ", ".join(repr(a) for a in unseen), steps, seen)


def names_an_adapter(adapters: Mapping[str, tuple[str, ...]], model: object) -> bool:
    """Whether ``model`` is an adapter's name or one of its agents' (names an endpoint serving
    ``adapters``, adapter name -> its agents, answers to)."""
    return isinstance(model, str) and model != EVERY_AGENT and (
        model in adapters or any(model in agents for agents in adapters.values()))


def choose_adapter(adapters: Mapping[str, tuple[str, ...]], model: object, agent: str | None) -> str | None:
    """The adapter that serves a call for ``model`` made by ``agent`` (its baggage's), first match
    wins: ``model`` names an adapter or one of an adapter's agents; ``agent`` is one of an
    adapter's agents; the adapter of ``EVERY_AGENT`` when one is; else None (the base model).
    Both backends' endpoints route by it."""
    if not adapters:
        return None
    owner = {name: adapter for adapter, agents in adapters.items() for name in agents}
    if isinstance(model, str):
        if model in adapters:
            return model
        if model in owner and model != EVERY_AGENT:
            return owner[model]
    return owner.get(agent or "", owner.get(EVERY_AGENT))


__all__ = ["ADAPTER_KEYS", "EVERY_AGENT", "AdapterSpec", "adapter_of_agent", "choose_adapter", "names_an_adapter",
           "parse_adapters", "samples_by_adapter", "warn_unseen_agents"]
