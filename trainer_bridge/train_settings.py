"""Settings of ``spanrl train``: YAML file, ``--flags`` and ``OTEL_SPANRL_TRAIN_*`` variables.

Read by ``train_cli`` through ``core/settings_loader.py``. ``TrainSettings`` is the loop's
``LoopSettings`` (every top-level key and the ``warm_start:`` block) plus each backend's own
block: ``trainer:`` and ``engine:`` of the embedded torch backend (``TrainerConfig``, which
extends the neutral ``AlgorithmConfig``, and ``EngineConfig``) and ``verl:`` (``VerlConfig``).
It sits above the loop and the backends, with the commands: the loop reads ``LoopSettings``
only, a backend only the ``BackendRun`` that ``backend_run`` makes of these settings.

The few block settings that the top level owns (``TRAINER_FROM_TOP_LEVEL``,
``ENGINE_FROM_TOP_LEVEL``) have only their top-level name, and ``__post_init__`` copies them into
the blocks, so ``settings.trainer`` and ``settings.engine`` are what runs. ``algorithm_config`` is
the ``AlgorithmConfig`` part of ``trainer:`` (with the top-level learning_rate, loss_agg_mode and
kl_coef), the one every backend trains with (``algorithm`` is the top-level grpo or sft).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from spanrl.errors import SettingError
from spanrl.settings_loader import setting
from spanrl.trainer_bridge.adapter_specs import parse_adapters
from spanrl.trainer_bridge.algorithm import AlgorithmConfig, algorithm_of
from spanrl.trainer_bridge.backend import BackendRun
from spanrl.trainer_bridge.endpoint_backend.backend import EndpointOptions
from spanrl.trainer_bridge.loop_settings import LoopSettings
from spanrl.trainer_bridge.torch_backend.config import EngineConfig, TorchOptions, TrainerConfig
from spanrl.trainer_bridge.verl_backend.config import (
    TRAINER_KNOBS_VERL_HAS,
    VerlConfig,
    check_uniform_adapters,
    lora_rank_as_adapter,
)

logger = logging.getLogger(__name__)

# trainer settings owned by a top-level key of the same name (users' train.yaml files use them)
TRAINER_FROM_TOP_LEVEL = ("learning_rate", "loss_agg_mode", "kl_coef", "device", "seed", "checkpoint_every",
                          "adapters")
# set by spanrl train itself: checkpoints go to <output_dir>/checkpoints
TRAINER_DERIVED = ("checkpoint_dir",)
ENGINE_FROM_TOP_LEVEL = ("device",)


@dataclass
class TrainSettings(LoopSettings):
    """``spanrl train``'s settings: the loop's and each backend's own block."""

    trainer: TrainerConfig = field(
        default_factory=TrainerConfig,
        metadata={"help": "the update's algorithm (clip ratios, KL, epochs, ...: every backend) and the torch "
                  "trainer's own knobs (learning_rate, loss_agg_mode, kl_coef, device, seed and "
                  "checkpoint_every are top-level keys)", "exclude": TRAINER_FROM_TOP_LEVEL + TRAINER_DERIVED},
    )
    engine: EngineConfig = field(
        default_factory=EngineConfig,
        metadata={"help": "the embedded policy engine (device is the top-level key)",
                  "exclude": ENGINE_FROM_TOP_LEVEL},
    )
    adapters: dict = setting({}, "one LoRA adapter per trained agent, served together on the frozen base model "
                             "(backends torch and verl): name -> {agents: [...], rank, alpha, target_modules, "
                             "learning_rate}")
    verl: VerlConfig = field(
        default_factory=VerlConfig,
        metadata={"help": "the verl backend (backend: verl): Ray, FSDP2 workers, vLLM replicas, the gateway"},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.adapters and self.backend not in ("torch", "verl"):
            raise SettingError(f"adapters: (one LoRA per agent) is built for backends torch and verl, "
                               f"not {self.backend!r}")
        if self.adapters and self.backend == "verl":  # verl trains one LoRA config (verl_backend/adapters.py)
            check_uniform_adapters(parse_adapters(self.adapters), self.verl.lora_rank)
        if self.backend == "verl" and self.verl.lora_rank and self.algorithm not in ("grpo", "apo"):
            raise SettingError(f"verl.lora_rank trains with algorithm grpo only on backend verl (its LoRA is served "
                               f"as an adapter), not {self.algorithm!r}")
        if self.adapters and self.algorithm != "grpo":
            raise SettingError(f"adapters: (one LoRA per agent) trains with algorithm grpo only, "
                               f"not {self.algorithm!r}")
        # the blocks run with the top-level values: one name per setting
        self.trainer = dataclasses.replace(
            self.trainer, checkpoint_dir=self.checkpoint_dir,
            **{name: getattr(self, name) for name in TRAINER_FROM_TOP_LEVEL},
        )
        if self.async_training and self.off_policy_rollouts == "correct":
            self.trainer = dataclasses.replace(self.trainer, rollout_is_cap=self.is_truncation)
        self.engine = dataclasses.replace(self.engine, **{name: getattr(self, name) for name in ENGINE_FROM_TOP_LEVEL})
        if self.backend == "verl":
            self.verl = _verl_with_old_trainer_knobs(self.verl, self.trainer)

    @property
    def algorithm_config(self) -> AlgorithmConfig:
        """The neutral algorithm config every backend trains with (from ``trainer:`` and the top level)."""
        return algorithm_of(self.trainer)

    def backend_run(self) -> BackendRun:
        """What the configured backend is started with: the run, the algorithm, the endpoint and
        the backend's own block (``TorchOptions`` of ``trainer:`` and ``engine:``, or ``verl:``)."""
        options: Any = TorchOptions(self.trainer, self.engine)
        adapters = self.trainer.adapter_specs
        if self.backend == "verl":
            options = self.verl
            if self.verl.lora_rank and not adapters:  # one LoRA for every call, served as an adapter
                adapters, options = lora_rank_as_adapter(self.verl), dataclasses.replace(self.verl, lora_rank=0)
        elif self.backend == "endpoint":
            options = EndpointOptions(self.endpoint_url)
        return BackendRun(model=self.model, output_dir=self.output_dir, checkpoint_dir=self.checkpoint_dir,
                          resume=self.resume, seed=self.seed, checkpoint_every=self.checkpoint_every,
                          algorithm=self.algorithm_config, endpoint=self.endpoint, options=options,
                          adapters=adapters)


_warned_trainer_knobs: set[str] = set()


def _verl_with_old_trainer_knobs(verl: VerlConfig, trainer: TrainerConfig) -> VerlConfig:
    """Deprecated: ``trainer:`` knobs that verl read before it had its own (``lora_rank``, ...) still
    apply with ``backend: verl`` where ``verl:`` leaves them at their default; said once each."""
    defaults, trainer_defaults = VerlConfig(), TrainerConfig()
    moved = {}
    for name in TRAINER_KNOBS_VERL_HAS:
        value = getattr(trainer, name)
        if value != getattr(trainer_defaults, name) and getattr(verl, name) == getattr(defaults, name):
            moved[name] = value
            if name not in _warned_trainer_knobs:
                _warned_trainer_knobs.add(name)
                logger.warning("trainer.%s with backend verl is deprecated: set verl.%s", name, name)
    return dataclasses.replace(verl, **moved) if moved else verl
