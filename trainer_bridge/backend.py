"""The seam between the training loop and a training backend; torch-free.

``training_loop`` hands out tasks, collects and scores rollouts, computes group advantages
and logs metrics; everything that trains weights and serves them sits behind
``PolicyBackend``: ``update(samples)`` makes a new policy version that the endpoint at
``endpoint_url`` serves from then on (agents keep calling the same URL), plus checkpoints.
Backends are sibling folders (``torch_backend/``, later ``verl_backend/``); ``make_backend``
picks one by ``settings.backend`` and is the only place that knows which one runs.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from spanrl.errors import UserError

if TYPE_CHECKING:
    from .train_settings import TrainSettings

# backend name -> "module:factory"; the factory is called as factory(settings, checkpoint_dir)
BACKENDS: dict[str, str] = {
    "torch": "spanrl.trainer_bridge.torch_backend.backend:start_torch_backend",
    "verl": "spanrl.trainer_bridge.verl_backend.backend:start_verl_backend",
}


@dataclass(frozen=True)
class TrainingSample:
    """One transition to train on: the call's prompt ids, its response ids and its advantage.

    ``old_logprobs``: the engine's logprob of each response token when it sampled them
    (``None``: recomputed with the current weights before the update).
    ``group_id`` (the task's GRPO group), ``rollout_id`` and ``turn_index`` (the call's index
    within its rollout) say where the sample came from; ``reward`` is the return its advantage
    was computed from. ``loss_weight``: the per-rollout loss weight already folded into
    ``advantage`` (``loss_weighting: rollout``; ``None`` when no such weight was applied), so
    the group advantage is ``advantage / loss_weight``.

    A merged row (``trajectory_merge``, ``merge_trajectories: true``) holds several calls of
    one rollout: ``response_loss_mask`` is 1 on the calls' own response tokens and 0 on the
    tokens in between (tool results, new user turns), ``token_advantages`` the advantage of
    each response token (its call's), ``old_logprobs`` one value per response token (0 where
    masked out). ``None``: every response token is trained on with ``advantage``.
    ``policy_version``: the oldest policy version that generated a response token (``None``:
    unknown); asynchronous training corrects or drops samples older than the current one.
    """

    prompt_token_ids: Sequence[int]
    response_token_ids: Sequence[int]
    advantage: float
    old_logprobs: Sequence[float] | None = None
    group_id: str = ""
    rollout_id: str = ""
    turn_index: int = 0
    reward: float = 0.0
    loss_weight: float | None = None
    response_loss_mask: Sequence[int] | None = None
    token_advantages: Sequence[float] | None = None
    policy_version: int | None = None

    @property
    def loss_mask(self) -> list[int]:
        """1 on each response token trained on, 0 on tokens in between (merged rows)."""
        if self.response_loss_mask is None:
            return [1] * len(self.response_token_ids)
        return [int(bool(m)) for m in self.response_loss_mask]

    @property
    def loss_token_count(self) -> int:
        """The number of response tokens the loss is taken on."""
        if self.response_loss_mask is None:
            return len(self.response_token_ids)
        return sum(1 for m in self.response_loss_mask if m)

    @property
    def response_advantages(self) -> list[float]:
        """The advantage of every response token (0 where masked out)."""
        if self.token_advantages is None:
            return [float(self.advantage) * m for m in self.loss_mask]
        return [float(a) for a in self.token_advantages]

    @property
    def group_advantage(self) -> float:
        """The advantage before any per-rollout loss weight (what GRPO computed)."""
        return self.advantage if self.loss_weight is None else self.advantage / self.loss_weight


@dataclass(frozen=True)
class UpdateStats:
    """What one ``update`` did: the policy version it published and the update's statistics.

    ``details`` holds every statistic the backend reports (``pg_loss``, ``kl_loss``,
    ``pg_clipfrac``, ``tokens_per_s``, ...); the named fields are the ones every backend has.
    """

    policy_version: int
    step: int
    loss: float
    grad_norm: float
    seconds: float
    details: Mapping[str, float] = field(default_factory=dict)

    def as_metrics(self) -> dict[str, float]:
        """All statistics as one flat dict (a row of ``metrics.jsonl`` takes them)."""
        return {**self.details, "loss": self.loss, "grad_norm": self.grad_norm, "seconds": self.seconds,
                "step": float(self.step), "policy_version": float(self.policy_version)}


@runtime_checkable
class PolicyBackend(Protocol):
    """What the training loop needs from a backend (see the module docstring)."""

    @property
    def policy_version(self) -> int:
        """The version the endpoint serves now; +1 per ``update``."""
        ...

    @property
    def endpoint_url(self) -> str:
        """The OpenAI-compatible base URL agents call (``.../v1``); the same for every version."""
        ...

    def update(self, samples: Sequence[TrainingSample]) -> UpdateStats:
        """One policy update on ``samples`` (advantages already computed), then publish the new
        weights to the endpoint. ``samples`` is never empty."""
        ...

    def save_checkpoint(self, root: str) -> str:
        """Write a resumable checkpoint of the current policy under ``root``; its path.

        A backend started with ``settings.resume`` continues from the newest one under the
        same root."""
        ...

    def close(self) -> None:
        """Stop serving and free what the backend holds."""
        ...


class BackendUnavailable(UserError):
    """The configured backend is unknown or cannot be imported here."""


def _backend_module(settings: TrainSettings) -> tuple[Any, str]:
    target = BACKENDS.get(settings.backend)
    if target is None:
        raise BackendUnavailable(f"unknown backend {settings.backend!r}; choose one of {sorted(BACKENDS)}")
    module_name, factory_name = target.split(":")
    try:
        return importlib.import_module(module_name), factory_name
    except ImportError as exc:
        raise BackendUnavailable(f"backend {settings.backend!r} cannot be imported ({exc}); "
                                 "install its dependencies") from exc


def check_backend(settings: TrainSettings) -> None:
    """Fail fast, before any waiting, when backend ``settings.backend`` cannot start here (its
    module's ``check_backend(settings)``, when it has one: missing libraries, no device, ...)."""
    module, _ = _backend_module(settings)
    check = getattr(module, "check_backend", None)
    if check is not None:
        check(settings)


def make_backend(settings: TrainSettings, checkpoint_dir: str) -> PolicyBackend:
    """Start the backend ``settings.backend`` (resumed from ``checkpoint_dir`` with
    ``settings.resume``), serving its policy at its ``endpoint_url``."""
    module, factory_name = _backend_module(settings)
    backend: PolicyBackend = getattr(module, factory_name)(settings, checkpoint_dir)
    return backend
