"""Per-agent LoRA adapters with ``backend: verl``: trained one after another in verl's LoRA actor,
served by vLLM under their own names behind the gateway.

verl's actor trains one LoRA (peft's ``default``) on a frozen base; it has no notion of several
adapters in one worker group. So each adapter's training state (its LoRA weights, their AdamW
moments, the RNG) is its own LoRA-only verl checkpoint (``checkpoint.save_lora_only``) in the
run's ``adapters-state/<name>/``, and an update, for each adapter whose agents had transitions:

1. loads that adapter's state into the actor (``activate``; the base weights are not touched),
2. runs verl's update on its agents' transitions only (``backend.VerlBackend``),
3. saves the state again and writes the adapter in peft's format (``adapter_worker.py``) to
   ``adapters/<name>/``, which every vLLM replica then loads under the adapter's name
   (``POST /v1/load_lora_adapter`` with ``load_inplace``; vLLM's runtime LoRA loading).

An adapter whose agents had no transitions is neither loaded nor saved: its weights stay bitwise
the same. All adapters start from the actor's fresh LoRA (peft's init: ``B`` zero, so each
starts as the base model). verl's one LoRA config means one rank, alpha and target-module list
and one learning rate for all adapters (``config.check_uniform_adapters``). The gateway sends each call to its
agent's adapter (``adapter_specs.choose_adapter``); other agents' calls get the base model.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from spanrl.errors import UserError
from spanrl.trainer_bridge.adapter_specs import AdapterSpec, samples_by_adapter
from spanrl.trainer_bridge.backend import TrainingSample

logger = logging.getLogger(__name__)

INITIAL = "initial"  # the actor's fresh LoRA: where every adapter's state starts
LOAD_TIMEOUT_S = 120.0


class AdapterLoadFailed(UserError):
    """A vLLM replica refused an adapter (one line naming the replica, the adapter and its answer)."""


class VerlAdapters:
    """The adapters of one verl run (module docstring): their states, peft folders and replicas."""

    def __init__(self, specs: Sequence[AdapterSpec], workers: Any, root: str):
        self.specs = tuple(specs)
        self.workers = workers
        self.state_dir = os.path.join(root, "adapters-state")
        self.peft_dir = os.path.join(root, "adapters")
        self.active: str | None = None  # the adapter whose state the actor holds now
        self.agents_seen: set[str] = set()  # agents whose transitions reached an update

    @property
    def agents(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """Adapter name -> its agents (what the gateway routes by)."""
        return tuple((spec.name, spec.agents) for spec in self.specs)

    def start(self, saved: str | None = None) -> None:
        """Keep the actor's fresh LoRA as every adapter's starting state, or take each adapter's
        state and peft folder from ``saved`` (a checkpoint's ``adapters/``); serve them all."""
        self.workers.actor.save_checkpoint(self._state(INITIAL), None, 0, None)
        self.workers.actor.save_lora_adapter(self._peft(INITIAL))
        for spec in self.specs:
            if saved and os.path.isdir(os.path.join(saved, spec.name)):
                _replace_tree(os.path.join(saved, spec.name, "verl"), self._state(spec.name))
                _replace_tree(os.path.join(saved, spec.name), self._peft(spec.name), ignore=("verl",))
            else:
                _replace_tree(self._peft(INITIAL), self._peft(spec.name))
            self.publish(spec.name)
        self.active = INITIAL

    def update(self, samples: Sequence[TrainingSample],
               train: Callable[[Sequence[TrainingSample]], dict[str, float]]) -> dict[str, dict[str, float]]:
        """``train`` (verl's update of the actor as it is) on each adapter's own samples, that
        adapter active; each trained adapter's state saved and its peft folder written (``publish``
        serves it). Its metrics per adapter, with the seconds each part took."""
        metrics: dict[str, dict[str, float]] = {}
        self.agents_seen.update(s.agent_name for s in samples if s.agent_name)
        for name, group in samples_by_adapter(self.specs, samples).items():
            mark = time.perf_counter()
            self.activate(name)
            loaded = time.perf_counter()
            metrics[name] = {**train(group), "samples": float(len(group))}
            trained = time.perf_counter()
            self.workers.actor.save_checkpoint(self._state(name), None, 0, None)
            self.workers.actor.save_lora_adapter(self._peft(name))
            metrics[name].update(load_state_s=loaded - mark, update_s=trained - loaded,
                                 save_state_s=time.perf_counter() - trained)
        return metrics

    def activate(self, name: str) -> None:
        """Load adapter ``name``'s state into the actor (its fresh start when it has none yet)."""
        if self.active == name:
            return
        state = self._state(name)
        self.workers.actor.load_checkpoint(state if os.path.isdir(state) else self._state(INITIAL))
        self.active = name

    def publish(self, name: str) -> None:
        """Every replica serves adapter ``name`` from its peft folder from now on."""
        headers = {}
        if self.workers.replica_api_key:
            headers["Authorization"] = f"Bearer {self.workers.replica_api_key}"
        body = {"lora_name": name, "lora_path": self._peft(name), "load_inplace": True}
        for url in self.workers.server_urls:
            reply = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=headers, timeout=LOAD_TIMEOUT_S)
            if reply.status_code != 200:
                raise AdapterLoadFailed(f"vLLM at {url} did not load adapter {name!r} from {self._peft(name)}: "
                                        f"{reply.status_code} {reply.text[:300]}")
        logger.info("adapter %r served by %d replica(s)", name, len(self.workers.server_urls))

    def save(self, folder: str) -> None:
        """Every adapter in peft's format under ``folder/<name>/`` (with its verl state in ``verl/``,
        so a resumed run goes on from it)."""
        for spec in self.specs:
            target = os.path.join(folder, spec.name)
            _replace_tree(self._peft(spec.name), target)
            if os.path.isdir(self._state(spec.name)):
                _replace_tree(self._state(spec.name), os.path.join(target, "verl"))

    def _state(self, name: str) -> str:
        return os.path.join(self.state_dir, name)

    def _peft(self, name: str) -> str:
        return os.path.join(self.peft_dir, name)


def adapter_details(per_adapter: dict[str, dict[str, float]]) -> dict[str, float]:
    """An adapters update's statistics: each adapter's own (``adapter/<name>/<key>``), its
    ``pg_loss`` averaged over the adapters by samples, the largest ``grad_norm``, the samples."""
    total = sum(metrics["samples"] for metrics in per_adapter.values()) or 1.0
    details = {"pg_loss": 0.0, "grad_norm": 0.0, "samples": 0.0}
    for name, metrics in per_adapter.items():
        details["pg_loss"] += float(metrics.get("pg_loss", 0.0)) * metrics["samples"] / total
        details["grad_norm"] = max(details["grad_norm"], float(metrics.get("grad_norm", 0.0)))
        details["samples"] += metrics["samples"]
        details.update({f"adapter/{name}/{key}": float(value) for key, value in metrics.items()})
    return details


def _replace_tree(source: str, target: str, ignore: tuple[str, ...] = ()) -> None:
    if os.path.isdir(target):
        shutil.rmtree(target)
    shutil.copytree(source, target, ignore=shutil.ignore_patterns(*ignore) if ignore else None)


__all__ = ["AdapterLoadFailed", "VerlAdapters", "adapter_details"]
