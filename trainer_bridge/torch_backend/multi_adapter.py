"""One LoRA adapter per agent in the torch trainer: build, train per agent, export, save, load.

Used by ``trainer.TorchTrainer`` when ``TrainerConfig.adapters`` is set (``adapter_specs.py``). The
base model is frozen; peft holds every adapter by name on it. ``adapter_grpo_step`` groups a
step's samples by their ``agent_name``: each adapter is made the active one and trained by the
trainer's own GRPO update (``_prepare``/``_update``) on its agents' samples only, with its own
AdamW (its ``learning_rate``); samples of agents without an adapter train nothing (the base is
frozen). An adapter whose agents sent nothing this step is not touched at all, so its weights
stay bitwise the same. ``adapter_weights`` exports every adapter's ``A`` and ``scaling * B`` per
module for the engine (``engine/multi_lora.py``); checkpoints hold each adapter in peft's format
(``adapters/<name>/adapter_config.json`` + ``adapter_model.safetensors``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from spanrl.trainer_bridge.adapter_specs import AdapterSpec, samples_by_adapter
from spanrl.trainer_bridge.backend import TrainingSample

if TYPE_CHECKING:
    from spanrl.trainer_bridge.torch_backend.trainer import TorchTrainer

logger = logging.getLogger(__name__)


# summed over the adapters of a step; every other statistic is their sample-weighted mean
SUMMED_STATS = ("samples", "response_tokens", "tokens", "model_tokens", "micro_batches", "seconds")


def attach_adapters(model: Any, specs: Sequence[AdapterSpec], saved: str | Path | None = None) -> Any:
    """``model`` (a plain HF causal LM) with every adapter of ``specs`` on it, frozen base; an
    adapter saved under ``saved`` (a checkpoint's ``adapters/`` folder) is loaded, trainable."""
    from peft import LoraConfig, PeftModel, get_peft_model

    peft_model: Any = None
    for spec in specs:
        folder = Path(saved) / spec.name if saved is not None else None
        if folder is not None and (folder / "adapter_config.json").is_file():
            if peft_model is None:
                peft_model = PeftModel.from_pretrained(model, str(folder), adapter_name=spec.name, is_trainable=True)
            else:
                peft_model.load_adapter(str(folder), adapter_name=spec.name, is_trainable=True)
            continue
        config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=0.0, task_type="CAUSAL_LM",
                            target_modules=list(spec.target_modules))
        if peft_model is None:
            peft_model = get_peft_model(model, config, adapter_name=spec.name)
        else:
            peft_model.add_adapter(spec.name, config)
    for parameter in peft_model.parameters():  # only the active adapter's weights get gradients
        parameter.requires_grad_(False)
    return peft_model


def adapter_parameters(model: Any, name: str) -> list[torch.nn.Parameter]:
    """The parameters of adapter ``name`` (its ``lora_A``/``lora_B`` weights in every module)."""
    return [p for key, p in model.named_parameters() if "lora_" in key and f".{name}." in f"{key}."]


def new_adapter_optimizers(trainer: TorchTrainer) -> dict[str, torch.optim.Optimizer]:
    """One AdamW per adapter, at the adapter's learning rate (default: the run's)."""
    config = trainer.config
    return {spec.name: trainer.new_optimizer(spec.learning_rate or config.learning_rate,
                                             adapter_parameters(trainer.model, spec.name))
            for spec in config.adapter_specs}


def adapter_grpo_step(trainer: TorchTrainer, samples: Sequence[TrainingSample]) -> dict[str, float]:
    """One GRPO step with per-agent adapters (module docstring): one policy version, statistics
    merged over the adapters plus ``adapter/<name>/loss`` and ``adapter/<name>/samples`` each."""
    started = time.perf_counter()
    specs = trainer.config.adapter_specs
    groups = samples_by_adapter(specs, samples)
    trained_agents = {s.agent_name for group in groups.values() for s in group}
    trainer.agents_seen.update(s.agent_name for s in samples if s.agent_name)
    untrained = len(samples) - sum(len(group) for group in groups.values())
    if untrained:
        logger.info("%d of %d samples come from agents no adapter names (%s): not trained (the base is frozen)",
                    untrained, len(samples), sorted({str(s.agent_name) for s in samples} - trained_agents))
    per_adapter: dict[str, dict[str, float]] = {}
    try:
        for name, group in groups.items():
            trainer.model.set_adapter(name)
            trainer.optimizer = trainer.adapter_optimizers[name]
            adapter_started = time.perf_counter()
            prepared = trainer._prepare(group)
            totals, grad_norm = trainer._update(prepared)
            per_adapter[name] = trainer._step_stats(prepared, totals, grad_norm,
                                                    time.perf_counter() - adapter_started)
    finally:
        for parameter in trainer.model.parameters():
            parameter.requires_grad_(False)
    trainer.step += 1
    trainer.policy_version += 1
    stats = merged_stats(per_adapter, time.perf_counter() - started)
    stats.update(step=float(trainer.step), policy_version=float(trainer.policy_version))
    return stats


def merged_stats(per_adapter: dict[str, dict[str, float]], seconds: float) -> dict[str, float]:
    """The step's statistics: sums (``SUMMED_STATS``) or sample-weighted means over the adapters,
    the largest gradient norm, and each adapter's loss and sample count."""
    total = sum(stats["samples"] for stats in per_adapter.values())
    merged: dict[str, float] = {"loss": 0.0, "grad_norm": 0.0, "samples": 0.0}
    for name, stats in per_adapter.items():
        share = stats["samples"] / total
        for key, value in stats.items():
            if key in ("step", "policy_version"):
                continue
            if key in SUMMED_STATS:
                merged[key] = merged.get(key, 0.0) + value
            elif key == "grad_norm":
                merged[key] = max(merged[key], value)
            else:
                merged[key] = merged.get(key, 0.0) + value * share
        merged[f"adapter/{name}/loss"] = stats["loss"]
        merged[f"adapter/{name}/samples"] = stats["samples"]
    merged["seconds"] = seconds
    return merged


def trained_adapters(stats: dict[str, float]) -> set[str]:
    """The adapters a step's statistics (``adapter_grpo_step``) say it trained (samples > 0)."""
    return {key.split("/")[1] for key, value in stats.items()
            if key.startswith("adapter/") and key.endswith("/samples") and value > 0}


def adapter_weights(model: Any,
                    only: set[str] | None = None) -> dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Every adapter's weights (those named in ``only``, when given) for the engine: adapter ->
    HF module path -> (``A`` [r, in], ``scaling * B`` [out, r]), copies on the CPU."""
    from peft.tuners.lora import LoraLayer

    out: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    with torch.no_grad():
        for path, found in model.named_modules():
            if not isinstance(found, LoraLayer):
                continue
            module: Any = found
            plain = path.replace("base_model.model.", "", 1)
            for name in module.lora_A:
                if only is not None and name not in only:
                    continue
                a = module.lora_A[name].weight.detach().float().cpu().clone()
                b = (module.lora_B[name].weight.detach().float() * module.scaling[name]).cpu()
                out.setdefault(name, {})[plain] = (a, b)
    return out


def base_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The frozen base model's weights with plain HF keys (no adapter in them)."""
    return {key.replace("base_model.model.", "", 1).replace(".base_layer", ""): value.detach().clone()
            for key, value in model.state_dict().items() if "lora_" not in key}


def save_adapters(model: Any, folder: Path) -> None:
    """Each adapter in peft's format under ``folder/<name>/``."""
    model.save_pretrained(str(folder))


__all__ = ["adapter_grpo_step", "adapter_parameters", "adapter_weights", "attach_adapters", "trained_adapters",
           "base_state_dict", "new_adapter_optimizers", "save_adapters"]
