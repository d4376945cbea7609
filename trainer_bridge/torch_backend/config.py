"""Settings of the embedded torch backend, torch-free so ``--help`` and settings files read them.

``TrainerConfig`` drives ``trainer.TorchTrainer``; ``EngineConfig`` drives the policy engine
(``engine.policy_engine.PolicyEngine``). ``spanrl train`` exposes every field through its
``trainer:`` and ``engine:`` blocks (flags ``--trainer-<field>``, variables
``OTEL_SPANRL_TRAIN_TRAINER_<FIELD>``; see ``core/settings_loader.py``), the help of each
field is its ``metadata["help"]``. Only ``__post_init__`` imports torch (through ``grpo``),
for the lists it validates against.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from spanrl.errors import SettingError

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _setting(default: Any, help_text: str) -> Any:
    """A dataclass field with its help text (shown by ``--help``)."""
    return field(default=default, metadata={"help": help_text})


@dataclass
class TrainerConfig:
    """Settings of the torch trainer (``spanrl train`` fills them from its settings)."""

    learning_rate: float = _setting(2e-4, "GRPO AdamW learning rate")
    sft_learning_rate: float = _setting(3e-3, "SFT warm-start learning rate (sft_steps may override it)")
    weight_decay: float = _setting(0.0, "AdamW weight decay")
    betas: tuple[float, float] = _setting((0.9, 0.999), "AdamW betas, e.g. 0.9,0.999")
    grad_clip: float = _setting(1.0, "max global gradient norm; 0 = off")
    ppo_epochs: int = _setting(1, "optimizer steps per GRPO update on the same batch")
    clip_ratio_low: float = _setting(0.2, "PPO clip: lower ratio bound 1 - clip_ratio_low")
    clip_ratio_high: float = _setting(0.2, "PPO clip: upper ratio bound 1 + clip_ratio_high")
    clip_ratio_c: float = _setting(3.0, "dual-clip bound for negative advantages")
    loss_agg_mode: str = _setting(
        "token-mean", "loss aggregation: token-mean, seq-mean-token-mean or seq-mean-token-sum-norm")
    loss_scale_factor: float | None = _setting(
        None, "seq-mean-token-sum-norm divisor (default: the longest response)")
    kl_coef: float = _setting(0.0, "KL penalty to the initial policy; > 0 loads a frozen reference model")
    kl_estimator: str = _setting("low_var_kl", "KL estimator: kl (k1), low_var_kl (k3), mse, abs; '+' suffix: "
                                 "straight-through gradient")
    micro_batch_tokens: int = _setting(8192, "padded tokens per forward/backward pass")
    device: str = _setting("auto", "auto | cpu | cuda | cuda:N")
    autocast_dtype: str | None = _setting(None, "autocast dtype, e.g. bfloat16 on CUDA (weights stay float32)")
    gradient_checkpointing: bool = _setting(False, "recompute activations in backward to save memory")
    lora_rank: int = _setting(0, "> 0 trains a LoRA adapter (peft) instead of all weights")
    lora_alpha: int = _setting(32, "LoRA alpha")
    lora_dropout: float = _setting(0.0, "LoRA dropout")
    lora_target_modules: tuple[str, ...] = _setting(LORA_TARGETS, "module names LoRA adapts")
    checkpoint_every: int = _setting(0, "save every N GRPO steps into checkpoint_dir; 0 = never")
    checkpoint_dir: str | None = _setting(None, "folder of periodic checkpoints")
    keep_checkpoints: int = _setting(2, "periodic checkpoints kept (older ones are deleted)")
    seed: int = _setting(0, "random seed")
    rollout_is_cap: float = _setting(
        0.0, "truncated importance sampling of the engine's tokens: weigh each by min(exp(old - engine logprob), "
        "this); 0 = off (spanrl train sets it from is_truncation in async training)")

    def __post_init__(self) -> None:
        from spanrl.trainer_bridge import grpo  # torch: only once settings are built, not for --help

        if self.loss_agg_mode not in grpo.LOSS_AGG_MODES:
            raise SettingError(f"loss_agg_mode must be one of {grpo.LOSS_AGG_MODES}, got {self.loss_agg_mode!r}")
        base = self.kl_estimator.rstrip("+")
        if base not in grpo.KL_ESTIMATORS:
            raise SettingError(f"kl_estimator must be one of {sorted(grpo.KL_ESTIMATORS)} (optionally with '+'), "
                               f"got {self.kl_estimator!r}")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise SettingError("checkpoint_every needs checkpoint_dir")
        if len(tuple(self.betas)) != 2:
            raise SettingError(f"betas must be two numbers, got {self.betas!r}")
        self.betas = (float(self.betas[0]), float(self.betas[1]))
        self.lora_target_modules = tuple(self.lora_target_modules)


@dataclass
class EngineConfig:
    """Settings of the embedded policy engine (generation with continuous batching)."""

    device: str = _setting("auto", "auto | cpu | cuda | cuda:N")
    dtype: str = _setting("auto", "auto | float32 | bfloat16 | float16 (auto: float32 on CPU)")
    max_batch_size: int = _setting(64, "most sequences decoded together in one batch")
    batch_wait_ms: float = _setting(20.0, "newcomers join a running batch after waiting this long at most")
    threads: int = _setting(0, "torch intra-op threads of the process; 0 = torch's default")
