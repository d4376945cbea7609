"""Settings of the embedded torch backend, torch-free so ``--help`` and settings files read them.

``TrainerConfig`` drives ``trainer.TorchTrainer``: the loop's neutral ``AlgorithmConfig``
(``trainer_bridge/algorithm.py``) plus the torch trainer's own knobs (device, micro-batch
tokens, LoRA, checkpoints, ...). ``EngineConfig`` drives the policy engine
(``engine.policy_engine.PolicyEngine``). ``spanrl train`` exposes every field through its
``trainer:`` and ``engine:`` blocks (flags ``--trainer-<field>``, variables
``OTEL_SPANRL_TRAIN_TRAINER_<FIELD>``; see ``core/settings_loader.py``), the help of each
field is its ``metadata["help"]``.
"""

from __future__ import annotations

from dataclasses import dataclass

from spanrl.errors import SettingError
from spanrl.settings_loader import setting
from spanrl.trainer_bridge.adapter_specs import AdapterSpec, parse_adapters
from spanrl.trainer_bridge.algorithm import AlgorithmConfig

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class TrainerConfig(AlgorithmConfig):
    """Settings of the torch trainer: the neutral algorithm config and the trainer's own knobs."""

    sft_learning_rate: float = setting(3e-3, "SFT warm-start learning rate (sft_steps may override it)")
    micro_batch_tokens: int = setting(8192, "tokens per forward/backward pass (padded ones too when not packed)")
    pack_sequences: bool = setting(True, "pack a micro-batch's sequences into one row, no padding (models "
                                   "whose attention cannot be packed are padded whatever this says)")
    share_prefixes: bool = setting(True, "packed sequences that begin alike (a group's prompt, earlier turns) "
                                   "run that beginning once; the same logprobs and gradients, less work")
    scored_tail: bool = setting(True, "packed passes run the last layer on the scored positions only (the "
                                "others feed no logprob); the same logprobs and gradients, less work")
    device: str = setting("auto", "auto | cpu | cuda | cuda:N")
    autocast_dtype: str | None = setting(None, "autocast dtype, e.g. bfloat16 on CUDA (weights stay float32)")
    gradient_checkpointing: bool = setting(False, "recompute activations in backward to save memory")
    lora_rank: int = setting(0, "> 0 trains a LoRA adapter (peft) instead of all weights")
    lora_alpha: int = setting(32, "LoRA alpha")
    lora_dropout: float = setting(0.0, "LoRA dropout")
    lora_target_modules: tuple[str, ...] = setting(LORA_TARGETS, "module names LoRA adapts")
    adapters: dict = setting({}, "one LoRA adapter per agent: name -> {agents, rank, alpha, target_modules, "
                             "learning_rate}; the base model stays frozen (adapter_specs.py)")
    checkpoint_every: int = setting(0, "save every N GRPO steps into checkpoint_dir; 0 = never")
    checkpoint_dir: str | None = setting(None, "folder of periodic checkpoints")
    keep_checkpoints: int = setting(2, "periodic checkpoints kept (older ones are deleted)")
    seed: int = setting(0, "random seed")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.checkpoint_every and not self.checkpoint_dir:
            raise SettingError("checkpoint_every needs checkpoint_dir")
        object.__setattr__(self, "lora_target_modules", tuple(self.lora_target_modules))
        specs = parse_adapters(self.adapters)  # raises SettingError naming what is wrong
        if specs and self.lora_rank:
            raise SettingError("adapters: and trainer.lora_rank both set: adapters train one LoRA per agent on a "
                               "frozen base, lora_rank one LoRA for every call; set one of them")

    @property
    def adapter_specs(self) -> tuple[AdapterSpec, ...]:
        """The ``adapters:`` setting as specs (empty: no per-agent adapters)."""
        return parse_adapters(self.adapters)


DEFAULT_PREFIX_CACHE_MB = 256.0
PREFIX_CACHE_HELP = ("MiB of recent prompts' KV cache kept so that a prompt starting like one of them is prefilled "
                     "only from where they part (an agent's next turn, a GRPO group's rollouts); 0 = off")


@dataclass
class EngineConfig:
    """Settings of the embedded policy engine (generation with continuous batching)."""

    device: str = setting("auto", "auto | cpu | cuda | cuda:N")
    dtype: str = setting("auto", "auto | float32 | bfloat16 | float16 (auto: float32 on CPU)")
    max_batch_size: int = setting(64, "most sequences decoded together in one batch")
    batch_wait_ms: float = setting(20.0, "newcomers join a running batch after waiting this long at most")
    threads: int = setting(0, "torch intra-op threads of the process; 0 = torch's default")
    prefix_cache_mb: float = setting(DEFAULT_PREFIX_CACHE_MB, PREFIX_CACHE_HELP)


@dataclass(frozen=True)
class TorchOptions:
    """The torch backend's own knobs in a ``BackendRun``: the trainer's and the engine's blocks."""

    trainer: TrainerConfig
    engine: EngineConfig
