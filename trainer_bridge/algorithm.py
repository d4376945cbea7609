"""The neutral algorithm config: what every backend's update computes, whatever runs it.

The loop owns it and every backend receives it (``backend.BackendRun.algorithm``): the learning
rate, the PPO clip ratios, the KL penalty and its estimator, the loss aggregation, epochs per
update, gradient clipping, AdamW's betas and weight decay, the cap of truncated importance
sampling. The torch backend's ``trainer:`` block extends it with the torch trainer's own knobs
(``torch_backend/config.py``: device, micro-batch tokens, LoRA, checkpoints); verl maps it onto
verl's actor config (``verl_backend/config.py``). The names a setting may take are listed here,
once; the functions that implement them are ``advantages.py`` (the loop's) and
``torch_backend/losses.py`` (the torch backend's), each checked against these lists.
Torch-free: ``--help`` and settings files read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spanrl.errors import SettingError
from spanrl.settings_loader import setting

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# k1/k2/k3 are verl's aliases; a trailing "+" takes k2's gradient (straight-through)
KL_ESTIMATOR_NAMES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
ADVANTAGE_ESTIMATOR_NAMES = ("grpo", "drgrpo", "reinforce_plus_plus")
ADVANTAGE_LEVELS = ("rollout", "transition")
LOSS_WEIGHTINGS = ("token", "rollout")
ALGORITHMS = ("grpo", "sft", "apo")


@dataclass(frozen=True)
class AlgorithmConfig:
    """How one policy update is computed from samples whose advantages the loop computed."""

    learning_rate: float = setting(2e-4, "GRPO AdamW learning rate")
    weight_decay: float = setting(0.0, "AdamW weight decay")
    betas: tuple[float, float] = setting((0.9, 0.999), "AdamW betas, e.g. 0.9,0.999")
    grad_clip: float = setting(1.0, "max global gradient norm; 0 = off")
    ppo_epochs: int = setting(1, "optimizer steps per GRPO update on the same batch")
    clip_ratio_low: float = setting(0.2, "PPO clip: lower ratio bound 1 - clip_ratio_low")
    clip_ratio_high: float = setting(0.2, "PPO clip: upper ratio bound 1 + clip_ratio_high")
    clip_ratio_c: float = setting(3.0, "dual-clip bound for negative advantages")
    loss_agg_mode: str = setting(
        "token-mean", "loss aggregation: token-mean, seq-mean-token-mean or seq-mean-token-sum-norm")
    loss_scale_factor: float | None = setting(
        None, "seq-mean-token-sum-norm divisor (default: the longest response)")
    kl_coef: float = setting(0.0, "KL penalty to the initial policy; > 0 loads a frozen reference model")
    kl_estimator: str = setting("low_var_kl", "KL estimator: kl (k1), low_var_kl (k3), mse, abs; '+' suffix: "
                                "straight-through gradient")
    rollout_is_cap: float = setting(
        0.0, "truncated importance sampling of the engine's tokens: weigh each by min(exp(old - engine logprob), "
        "this); 0 = off (spanrl train sets it from is_truncation in async training)")

    def __post_init__(self) -> None:
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise SettingError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {self.loss_agg_mode!r}")
        if self.kl_estimator.rstrip("+") not in KL_ESTIMATOR_NAMES:
            raise SettingError(f"kl_estimator must be one of {sorted(KL_ESTIMATOR_NAMES)} (optionally with '+'), "
                               f"got {self.kl_estimator!r}")
        if len(tuple(self.betas)) != 2:
            raise SettingError(f"betas must be two numbers, got {self.betas!r}")
        object.__setattr__(self, "betas", (float(self.betas[0]), float(self.betas[1])))


def algorithm_of(config: Any) -> AlgorithmConfig:
    """The ``AlgorithmConfig`` part of ``config`` (e.g. the torch ``trainer:`` block that extends it)."""
    from dataclasses import fields

    return AlgorithmConfig(**{f.name: getattr(config, f.name) for f in fields(AlgorithmConfig)})
