"""The seam between the training loop and a training backend; torch-free.

The loop hands out tasks, collects and scores rollouts, computes group advantages and logs
metrics; everything that trains weights and serves them sits behind ``PolicyBackend``:
``update(samples)`` makes a new policy version that the endpoint at ``endpoint_url`` serves
from then on (agents keep calling the same URL), plus checkpoints. A backend is started with a
``BackendRun``: the model, where its checkpoints go, the neutral ``AlgorithmConfig``, the
endpoint agents call (``EndpointConfig``) and the backend's own knobs (``options``).

Backends are sibling packages (``torch_backend/``, ``verl_backend/``) that import this module
and ``algorithm.py``, never the loop; the loop never imports them: ``BACKENDS`` names each one's
module, which provides ``start_backend(run)``, optionally ``check_backend(run)`` (refuse early:
a missing library, no device) and ``fine_tune(request)`` (supervised fine-tuning of a model
directory: the warm start). ``backend_module`` is the only place that imports one.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

from spanrl.errors import UserError

from .algorithm import AlgorithmConfig

# backend name -> the module providing start_backend(run) (and check_backend, fine_tune)
BACKENDS: dict[str, str] = {
    "torch": "spanrl.trainer_bridge.torch_backend.backend",
    "verl": "spanrl.trainer_bridge.verl_backend.backend",
    # an endpoint spanrl does not train (spanrl proxy before a hosted model): algorithm apo only
    "endpoint": "spanrl.trainer_bridge.endpoint_backend.backend",
}
# the backend whose fine_tune runs the warm start (spanrl sft, warm_start:), whatever trains after it
FINE_TUNING_BACKEND = "torch"
CHECKPOINT_DIR_MODE = 0o700  # checkpoint folders are their owner's only (every backend's)


@dataclass(frozen=True)
class EndpointConfig:
    """The OpenAI-compatible endpoint a backend serves its policy at (the same URL all run)."""

    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = "policy"
    model_names: tuple[str, ...] = ("*",)  # other names it answers to ('*': any); trainer_bridge/model_names.py
    token: str | None = None  # bearer token agents must send; None = no check
    validation_temperature: float | None = None  # pinned temperature of validation rollouts' requests
    prompts: str | None = None  # a file of prompt candidates it serves in place of agents' instructions
    tls_cert: str | None = None  # PEM files: the endpoint serves HTTPS only; None = plain HTTP
    tls_key: str | None = None


@dataclass(frozen=True)
class BackendRun:
    """What a backend is started with: one training run's model, places and configs."""

    model: str  # the Hugging Face model directory training starts from
    output_dir: str
    checkpoint_dir: str  # resumable checkpoints go here (resume: the newest one is loaded)
    resume: bool
    seed: int
    checkpoint_every: int  # updates between periodic checkpoints (0: only at the end)
    algorithm: AlgorithmConfig
    endpoint: EndpointConfig
    options: Any = None  # the backend's own knobs (torch: TorchOptions, verl: VerlConfig)
    # per-agent LoRA adapters (adapter_specs.AdapterSpec; ``adapters:``), read by the verl backend
    # (the torch backend has them in its trainer config)
    adapters: tuple = ()


@dataclass(frozen=True)
class TokenExample:
    """A demonstration in token ids (one call of a well-rewarded rollout): its response is learned."""

    prompt_token_ids: tuple[int, ...]
    response_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class FineTuneRequest:
    """Supervised fine-tuning of ``model_dir`` into ``out_dir``: chat demonstrations from a JSONL
    file and/or token examples, ``steps`` AdamW steps of ``batch_size`` examples."""

    model_dir: str
    out_dir: str
    demonstrations: str  # a chat JSONL file ("" = none)
    token_examples: tuple[TokenExample, ...]
    steps: int
    batch_size: int
    learning_rate: float
    seed: int
    device: str
    progress: bool = True
    # chat examples in memory ({"messages": [...], "tools": [...]}: calls recorded as text only),
    # tokenized with the model's own chat template like the demonstrations
    chat_examples: tuple[dict[str, Any], ...] = ()


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
    ``agent_name``: the agent that made the call (``None``: unknown); with per-agent adapters
    (the torch backend's ``adapters:``) it picks the adapter the sample trains.
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
    agent_name: str | None = None  # the agent that made the call (the trace's spanrl.agent.name)

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


def backend_module(name: str) -> ModuleType:
    """The module of backend ``name`` (``BACKENDS``); ``BackendUnavailable`` when it cannot load here."""
    module_name = BACKENDS.get(name)
    if module_name is None:
        raise BackendUnavailable(f"unknown backend {name!r}; choose one of {sorted(BACKENDS)}")
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendUnavailable(f"backend {name!r} cannot be imported ({exc}); install its dependencies") from exc


def check_backend(name: str, run: BackendRun) -> None:
    """Fail fast, before any waiting, when backend ``name`` cannot start here (its module's
    ``check_backend(run)``, when it has one: missing libraries, no device, ...)."""
    check = getattr(backend_module(name), "check_backend", None)
    if check is not None:
        check(run)


def make_backend(name: str, run: BackendRun) -> PolicyBackend:
    """Start backend ``name`` (resumed from ``run.checkpoint_dir`` with ``run.resume``), serving
    its policy at its ``endpoint_url``."""
    backend: PolicyBackend = backend_module(name).start_backend(run)
    return backend


def make_owner_only_dir(path: str | Path) -> Path:
    """``path`` (and missing parents) created for its owner only; a folder this run creates for
    checkpoints is narrowed to the owner too (weights and optimizer state are the user's)."""
    path = Path(path)
    existed = path.exists()
    path.mkdir(parents=True, exist_ok=True, mode=CHECKPOINT_DIR_MODE)
    if not existed:
        path.chmod(CHECKPOINT_DIR_MODE)  # mkdir's mode is filtered by the umask
    return path


def fine_tune(request: FineTuneRequest) -> dict[str, Any]:
    """Supervised fine-tuning by ``FINE_TUNING_BACKEND`` (see ``FineTuneRequest``); its statistics
    (``steps``, ``loss_first``, ``loss_last``, ``seconds``, ``demonstrations``)."""
    result: dict[str, Any] = backend_module(FINE_TUNING_BACKEND).fine_tune(request)
    return result
