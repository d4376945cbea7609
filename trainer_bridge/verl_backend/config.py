"""Settings of the verl backend (the ``verl:`` block of ``train.yaml``) and their verl config.

``VerlConfig`` is torch-free and verl-free, so ``spanrl train --help`` lists it without
importing either. ``verl_overrides(run, cpu_mode)`` turns a ``BackendRun`` (the neutral
algorithm config, the model, the places, this block) into the Hydra overrides of verl's own
``ppo_trainer`` config; ``compose_verl_config`` applies them with
verl's config files. ``overrides`` passes any other verl setting through, last, so it wins.
docs/verl.md has the table of which spanrl setting maps to which verl key.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from spanrl.errors import SettingError
from spanrl.settings_loader import setting
from spanrl.trainer_bridge.algorithm import AlgorithmConfig

if TYPE_CHECKING:
    from spanrl.trainer_bridge.adapter_specs import AdapterSpec
    from spanrl.trainer_bridge.backend import BackendRun

# knobs of the verl: block that the trainer: block also has (verl read the trainer's before;
# train_settings still applies a trainer: value verl: leaves at its default, with a warning)
TRAINER_KNOBS_VERL_HAS = ("lora_rank", "lora_alpha", "gradient_checkpointing", "micro_batch_tokens",
                          "keep_checkpoints")




@dataclass(frozen=True)
class VerlConfig:
    """How verl runs the update and vLLM serves the agents (``backend: verl``)."""

    cpu_mode: str = setting("auto", "auto (CPU mode when no CUDA GPU is visible) | on | off")
    nnodes: int = setting(1, "machines in the Ray cluster that train")
    n_gpus_per_node: int = setting(1, "GPUs per machine (CPU mode: worker processes)")
    ray_address: str = setting("", "join this Ray cluster (e.g. auto, or ray://host:10001); empty = start one")
    ray_num_cpus: int = setting(0, "CPUs a locally started Ray may use; 0 = Ray's default (CPU mode: at least 8)")
    tensor_parallel_size: int = setting(1, "GPUs per vLLM replica; replicas = all GPUs / this")
    gpu_memory_utilization: float = setting(0.5, "share of each GPU vLLM may take (the rest trains)")
    max_prompt_length: int = setting(1024, "longer prompts are dropped from the update and counted")
    max_response_length: int = setting(512, "longer responses are dropped from the update and counted")
    temperature: float = setting(1.0, "sampling temperature of every agent request (the gateway sets it): "
                                  "the update recomputes log-probs at this temperature")
    dtype: str = setting("auto", "vLLM and FSDP dtype: auto (bfloat16 on GPU, float32 on CPU) | float32 | bfloat16")
    pause_wait_s: float = setting(300.0, "agent requests arriving during a weight sync wait this long, then 503")
    lora_rank: int = setting(0, "> 0 trains a LoRA adapter of this rank (on every projection) instead of all "
                                "weights; vLLM serves it for every call (the adapter 'lora' of every agent)")
    lora_alpha: int = setting(32, "LoRA alpha")
    gradient_checkpointing: bool = setting(False, "recompute activations in backward to save memory")
    micro_batch_tokens: int = setting(8192, "tokens per GPU in one forward/backward pass (ppo_max_token_len_per_gpu)")
    keep_checkpoints: int = setting(2, "checkpoints kept (older ones are deleted); 0 = all")
    overrides: list = setting([], "any other verl setting as KEY=VALUE (Hydra override syntax), applied last")


def cuda_available() -> bool:
    """Whether torch sees a CUDA GPU here (imports torch; only the backend calls it)."""
    import torch

    return bool(torch.cuda.is_available())


def resolve_cpu_mode(config: VerlConfig) -> bool:
    """True when verl must run on CPU: ``on``, or ``auto`` without a CUDA GPU."""
    if config.cpu_mode == "on":
        return True
    if config.cpu_mode == "off":
        if not cuda_available():
            raise SettingError("verl.cpu_mode is off but no CUDA GPU is visible here; set verl.cpu_mode: auto "
                               "(or on) to run verl and vLLM on CPU")
        return False
    if config.cpu_mode != "auto":
        raise SettingError(f"verl.cpu_mode must be auto, on or off, got {config.cpu_mode!r}")
    return not cuda_available()


def verl_overrides(run: BackendRun, cpu_mode: bool) -> list[str]:
    """Hydra overrides of verl's ``ppo_trainer`` config for ``run`` (user overrides last)."""
    verl, algorithm = run.options, run.algorithm
    dtype = verl.dtype if verl.dtype != "auto" else ("float32" if cpu_mode else "bfloat16")
    actor, rollout, model = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.model"
    values: dict[str, Any] = {
        **algorithm_values(algorithm),
        f"{model}.path": os.path.abspath(run.model),
        f"{model}.enable_gradient_checkpointing": verl.gradient_checkpointing,
        f"{model}.lora_rank": verl.lora_rank,
        f"{model}.lora_alpha": verl.lora_alpha,
        f"{actor}.strategy": "fsdp2",
        f"{actor}.entropy_coeff": 0,
        f"{actor}.shuffle": False,
        f"{actor}.data_loader_seed": run.seed,
        # micro-batches by tokens (batch sizes vary step to step), as the embedded trainer does
        f"{actor}.use_dynamic_bsz": True,
        f"{actor}.ppo_max_token_len_per_gpu": verl.micro_batch_tokens,
        f"{actor}.fsdp_config.seed": run.seed,
        # checkpoints are verl's own (resumable) plus the Hugging Face model, ready to serve
        f"{actor}.checkpoint.save_contents": "[model,optimizer,extra,hf_model]",
        f"{rollout}.name": "vllm",
        f"{rollout}.tensor_model_parallel_size": verl.tensor_parallel_size,
        f"{rollout}.gpu_memory_utilization": verl.gpu_memory_utilization,
        f"{rollout}.temperature": verl.temperature,
        f"{rollout}.dtype": dtype,
        f"{rollout}.load_format": "auto",
        f"{rollout}.calculate_log_probs": True,
        f"{rollout}.seed": run.seed,
        f"{rollout}.n": 1,
        "data.max_prompt_length": verl.max_prompt_length,
        "data.max_response_length": verl.max_response_length,
        "trainer.n_gpus_per_node": verl.n_gpus_per_node,
        "trainer.nnodes": verl.nnodes,
        "trainer.device": "cpu" if cpu_mode else "cuda",
        "trainer.default_local_dir": os.path.abspath(run.checkpoint_dir),
    }
    if dtype == "float32":  # verl's FSDP otherwise computes in bf16 (autocast) whatever the weights
        for role in ("actor", "ref"):
            values[f"+actor_rollout_ref.{role}.fsdp_config.mixed_precision"] = (
                "{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}")
    if algorithm.loss_agg_mode == "token-mean" and algorithm.loss_scale_factor is not None:
        values[f"{actor}.loss_scale_factor"] = algorithm.loss_scale_factor
    if cpu_mode:
        values.update(_cpu_mode_values())
    if run.adapters:
        check_uniform_adapters(run.adapters, verl.lora_rank)
        values.update(adapter_overrides(run.adapters))
    return [f"{key}={_hydra_value(value)}" for key, value in values.items()] + [str(o) for o in verl.overrides]


def algorithm_values(algorithm: AlgorithmConfig) -> dict[str, Any]:
    """verl's actor keys of the neutral algorithm config (docs/verl.md has the table)."""
    actor = "actor_rollout_ref.actor"
    return {
        f"{actor}.optim.lr": algorithm.learning_rate,
        f"{actor}.optim.weight_decay": algorithm.weight_decay,
        f"{actor}.optim.betas": f"[{algorithm.betas[0]},{algorithm.betas[1]}]",
        f"{actor}.optim.clip_grad": algorithm.grad_clip if algorithm.grad_clip > 0 else 1e9,
        f"{actor}.ppo_epochs": algorithm.ppo_epochs,
        f"{actor}.clip_ratio_low": algorithm.clip_ratio_low,
        f"{actor}.clip_ratio_high": algorithm.clip_ratio_high,
        f"{actor}.clip_ratio_c": algorithm.clip_ratio_c,
        f"{actor}.loss_agg_mode": algorithm.loss_agg_mode,
        f"{actor}.use_kl_loss": algorithm.kl_coef > 0,
        f"{actor}.kl_loss_coef": algorithm.kl_coef,
        f"{actor}.kl_loss_type": algorithm.kl_estimator,
        # truncated IS of the engine's tokens (async off_policy_rollouts: correct): verl's own
        # decoupled token-level TIS, weights min(exp(old - rollout logprob), cap) (off_policy.py)
        "algorithm.rollout_correction.rollout_is": "token" if algorithm.rollout_is_cap > 0 else "null",
        "algorithm.rollout_correction.rollout_is_threshold": algorithm.rollout_is_cap or 2.0,
        "algorithm.rollout_correction.bypass_mode": False,
    }


def check_uniform_adapters(specs: Sequence[AdapterSpec], verl_lora_rank: int) -> AdapterSpec:
    """The one LoRA config verl trains all adapters with; ``SettingError`` naming the setting when
    the adapters differ in it (verl's actor has one LoRA config) or ``verl.lora_rank`` is also set."""
    if verl_lora_rank:
        raise SettingError("adapters: and verl.lora_rank are two ways to train LoRA; with adapters: each adapter's "
                           "rank is its own (remove verl.lora_rank)")
    first = specs[0]
    for spec in specs[1:]:
        for field in ("rank", "alpha", "target_modules", "learning_rate"):
            if getattr(spec, field) != getattr(first, field):
                raise SettingError(f"adapters: with backend verl, every adapter has the same {field} (verl's actor "
                                   f"trains one LoRA config): {first.name!r} has {getattr(first, field)!r}, "
                                   f"{spec.name!r} has {getattr(spec, field)!r}")
    if first.learning_rate is not None:
        raise SettingError("adapters.<name>.learning_rate: with backend verl the adapters train at the run's "
                           "learning_rate (set that instead)")
    return first


WHOLE_POLICY_ADAPTER = "lora"  # the adapter verl.lora_rank trains: every agent's calls
LORA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_rank_as_adapter(verl: VerlConfig) -> tuple[AdapterSpec, ...]:
    """``verl.lora_rank`` as per-agent adapters are trained and served: one adapter of every agent
    (verl's own LoRA sync never reaches vLLM's HTTP server, where agents call; ``adapters.py``)."""
    from spanrl.trainer_bridge.adapter_specs import EVERY_AGENT, AdapterSpec

    if not verl.lora_rank:
        return ()
    return (AdapterSpec(WHOLE_POLICY_ADAPTER, (EVERY_AGENT,), verl.lora_rank, verl.lora_alpha, LORA_PROJECTIONS),)


def adapter_overrides(specs: Sequence[AdapterSpec]) -> dict[str, Any]:
    """verl's config for training the adapters: its LoRA (rank, alpha, targets), LoRA-only
    checkpoints, and vLLM keeping every adapter in its CPU cache (verl sets ``max_loras`` 1)."""
    spec = specs[0]
    model, actor = "actor_rollout_ref.model", "actor_rollout_ref.actor"
    return {
        f"{model}.lora_rank": spec.rank,
        f"{model}.lora_alpha": spec.alpha,
        f"{model}.target_modules": "[" + ",".join(spec.target_modules) + "]",
        f"+{actor}.checkpoint.save_lora_only": True,
        f"{actor}.checkpoint.save_contents": "[model,optimizer,extra]",
        "+actor_rollout_ref.rollout.engine_kwargs.vllm.max_cpu_loras": len(specs) + 1,
    }


def _cpu_mode_values() -> dict[str, Any]:
    """What verl and vLLM need on CPU (no flash-attention kernels: padded batches with sdpa are exact)."""
    actor, rollout, model = "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.model"
    return {
        # no flash-attention kernels on CPU: padded batches with sdpa are exact
        f"{model}.use_remove_padding": False,
        f"+{model}.override_config.attn_implementation": "sdpa",
        f"{actor}.use_torch_compile": False,
        f"{actor}.fsdp_config.use_torch_compile": False,
        f"{actor}.fsdp_config.dtype": "float32",
        f"{actor}.fsdp_config.model_dtype": "fp32",
        f"{rollout}.enforce_eager": True,
        f"{rollout}.free_cache_engine": False,
        f"+{rollout}.enable_sleep_mode": False,
    }


def _hydra_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def compose_verl_config(overrides: list[str]) -> Any:
    """verl's own ``ppo_trainer`` config with ``overrides`` applied (an OmegaConf DictConfig)."""
    import verl
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            return compose(config_name="ppo_trainer", overrides=overrides)
    except Exception as exc:  # hydra's errors name the bad key; say it is ours to fix
        raise SettingError(f"verl rejected the settings: {exc}") from exc
