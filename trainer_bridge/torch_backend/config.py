"""Settings of the embedded torch backend, torch-free so ``--help`` and settings files read them.

``TrainerConfig`` drives ``trainer.TorchTrainer``; ``EngineConfig`` drives the policy engine
(``engine.policy_engine.PolicyEngine``). ``spanrl train`` and ``spanrl serve`` expose their
fields as flags, ``OTEL_SPANRL_*`` variables and YAML keys.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainerConfig:
    """Settings of the torch trainer (the bridge fills them from its config file)."""

    lr: float = 2e-4                       # GRPO learning rate (the prototype: 1e-3 harms copying)
    sft_lr: float = 3e-3                   # SFT warm-start learning rate (override per call)
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0                 # max global grad norm; 0 = off
    ppo_epochs: int = 1                    # optimizer steps per grpo_step on the same batch
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0              # dual-clip bound for negative advantages
    loss_agg_mode: str = "token-mean"      # one of grpo.LOSS_AGG_MODES
    loss_scale_factor: float | None = None  # seq-mean-token-sum-norm divisor (default: longest response)
    kl_coef: float = 0.0                   # > 0 loads a frozen reference model
    kl_estimator: str = "low_var_kl"       # grpo.KL_ESTIMATORS: kl (k1), low_var_kl (k3), ...
    micro_batch_tokens: int = 8192         # padded tokens per forward/backward pass
    device: str = "auto"                   # auto | cpu | cuda | cuda:N
    autocast_dtype: str | None = None      # e.g. "bfloat16" on CUDA; weights stay float32
    gradient_checkpointing: bool = False
    lora_rank: int = 0                     # > 0 trains a LoRA adapter (peft) instead of all weights
    lora_alpha: int = 32
    lora_dropout: float = 0.0
    lora_target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj",
                                            "gate_proj", "up_proj", "down_proj")
    checkpoint_every: int = 0              # save every N grpo steps into checkpoint_dir; 0 = never
    checkpoint_dir: str | None = None
    keep_checkpoints: int = 2
    seed: int = 0

    def __post_init__(self):
        from spanrl.trainer_bridge import grpo  # torch: only once settings are built, not for --help

        if self.loss_agg_mode not in grpo.LOSS_AGG_MODES:
            raise ValueError(f"loss_agg_mode must be one of {grpo.LOSS_AGG_MODES}, got {self.loss_agg_mode!r}")
        base = self.kl_estimator.rstrip("+")
        if base not in grpo.KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {sorted(grpo.KL_ESTIMATORS)}")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ValueError("checkpoint_every needs checkpoint_dir")
        self.betas = tuple(self.betas)
        self.lora_target_modules = tuple(self.lora_target_modules)


@dataclass
class EngineConfig:
    """Settings of the embedded policy engine (generation with continuous batching)."""

    device: str = "auto"                   # auto | cpu | cuda | cuda:N
    dtype: str = "auto"                    # auto | float32 | bfloat16 | float16 (auto: fp32 on CPU)
    max_batch_size: int = 64               # most sequences decoded together in one batch
    batch_wait_ms: float = 20.0            # newcomers join a running batch after waiting this long at most
    threads: int = 0                       # torch intra-op threads; 0 = torch's default
