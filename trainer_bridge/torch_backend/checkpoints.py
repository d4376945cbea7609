"""Checkpoints of the torch trainer: save, find and resume from them.

A checkpoint is a Hugging Face model directory (``from_pretrained``-loadable, LoRA merged; with
per-agent adapters the frozen base, and each adapter in peft's format under ``adapters/<name>/``)
plus the optimizer state (``optimizer.pt``) and ``trainer_state.json`` (step, policy version,
base model, settings), written last so a directory without it is incomplete; folders are
created owner-only, and the optimizer state loads with ``weights_only``. Called by
``trainer.TorchTrainer`` (``save_checkpoint``, ``resume``, periodic checkpoints) and by the
torch backend, which resumes the newest ``step-NNNNNN`` checkpoint of a run.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from spanrl.trainer_bridge.backend import CHECKPOINT_DIR_MODE, make_owner_only_dir
from spanrl.trainer_bridge.torch_backend.adapter_checkpoint import (  # per-agent adapters: one peft folder each
    ADAPTERS_DIR,
    STATE_FILE,
)
from spanrl.trainer_bridge.torch_backend.config import TrainerConfig

if TYPE_CHECKING:
    from spanrl.trainer_bridge.torch_backend.trainer import TorchTrainer

logger = logging.getLogger(__name__)

OPTIMIZER_FILE = "optimizer.pt"
ADAPTER_DIR = "adapter"
CHECKPOINT_PREFIX = "step-"


def checkpoint_name(step: int) -> str:
    """The directory name of the checkpoint taken after ``step`` updates."""
    return f"{CHECKPOINT_PREFIX}{step:06d}"


def save_checkpoint(trainer: TorchTrainer, out_dir: str | Path) -> Path:
    """Write an HF model directory plus trainer state to ``out_dir`` (atomically replaced).

    ``from_pretrained(out_dir)`` loads the policy (LoRA merged); ``resume_trainer``
    continues with the same step, policy version and optimizer state.
    """
    out = Path(out_dir)
    make_owner_only_dir(out.parent)
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(mode=CHECKPOINT_DIR_MODE)
    if trainer.config.lora_rank:
        trainer.model.get_base_model().save_pretrained(staging, state_dict=trainer.policy_state_dict())
        trainer.model.save_pretrained(staging / ADAPTER_DIR)
    elif trainer.config.adapters:  # the frozen base, and each adapter in peft's format
        trainer.model.get_base_model().save_pretrained(staging, state_dict=trainer.policy_state_dict())
        trainer.model.save_pretrained(staging / ADAPTERS_DIR)
    else:
        trainer.model.save_pretrained(staging)
    trainer.tokenizer.save_pretrained(staging)
    sft_optimizer = trainer.sft_optimizer
    torch.save({"optimizer": trainer.optimizer.state_dict(),
                "sft_optimizer": sft_optimizer.state_dict() if sft_optimizer else None,
                "adapter_optimizers": {name: opt.state_dict() for name, opt in trainer.adapter_optimizers.items()},
                "torch_rng": torch.get_rng_state()}, staging / OPTIMIZER_FILE)
    state = {"step": trainer.step, "policy_version": trainer.policy_version,
             "base_model_dir": trainer.base_model_dir, "lora": bool(trainer.config.lora_rank),
             "adapters": bool(trainer.config.adapters),
             "config": asdict(trainer.config), "saved_at": time.time()}
    (staging / STATE_FILE).write_text(json.dumps(state, indent=2))  # written last: marks complete
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
        staging.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        staging.rename(out)
    logger.info("checkpoint saved: %s (step %d, policy version %d)", out, trainer.step, trainer.policy_version)
    return out


def save_periodic_checkpoint(trainer: TorchTrainer, root: str | Path, keep: int) -> Path:
    """``root/step-NNNNNN`` for the trainer's step; only the newest ``keep`` (at least 1) stay."""
    root = Path(root)
    saved = save_checkpoint(trainer, root / checkpoint_name(trainer.step))
    kept = list_checkpoints(root)
    for stale in kept[: max(0, len(kept) - max(1, keep))]:
        shutil.rmtree(stale, ignore_errors=True)
    return saved


def resume_trainer(trainer_class: type[TorchTrainer], checkpoint: str | Path,
                   config: TrainerConfig | None = None) -> TorchTrainer:
    """A trainer continuing from a checkpoint directory, or from the latest one under it.

    ``config`` overrides the saved settings (e.g. another device); by default the saved
    ones are used.
    """
    path = latest_checkpoint(checkpoint)
    state = json.loads((path / STATE_FILE).read_text())
    if config is None:
        saved = {f.name: state["config"][f.name] for f in fields(TrainerConfig) if f.name in state["config"]}
        config = TrainerConfig(**saved)
    if state.get("lora"):
        trainer = trainer_class(state["base_model_dir"], config, _adapter_dir=path / ADAPTER_DIR)
    elif state.get("adapters"):
        trainer = trainer_class(state["base_model_dir"], config, _adapter_dir=path / ADAPTERS_DIR)
    else:
        trainer = trainer_class(path, config, _reference_dir=state["base_model_dir"])
    trainer.base_model_dir = state["base_model_dir"]
    # tensors, numbers and containers only: a crafted file cannot run code when loaded
    saved_optim = torch.load(path / OPTIMIZER_FILE, map_location=trainer.device, weights_only=True)
    saved_adapters = saved_optim.get("adapter_optimizers") or {}
    for name, optimizer in trainer.adapter_optimizers.items():
        if name in saved_adapters:  # an adapter added since the checkpoint starts afresh
            optimizer.load_state_dict(saved_adapters[name])
    if not trainer.adapter_optimizers:
        trainer.optimizer.load_state_dict(saved_optim["optimizer"])
    if saved_optim.get("sft_optimizer") is not None:
        trainer.sft_optimizer = trainer.new_optimizer(config.sft_learning_rate)
        trainer.sft_optimizer.load_state_dict(saved_optim["sft_optimizer"])
    # map_location put the RNG state on the trainer's device; set_rng_state takes only a
    # CPU ByteTensor (on CUDA it raised "RNG state must be a torch.ByteTensor").
    torch.set_rng_state(saved_optim["torch_rng"].cpu())
    trainer.step = int(state["step"])
    trainer.policy_version = int(state["policy_version"])
    logger.info("resumed from %s: step %d, policy version %d", path, trainer.step, trainer.policy_version)
    return trainer


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints (``step-NNNNNN`` with a state file) under ``root``, oldest first.

    A checkpoint that was being replaced when the process died (renamed to ``.NAME.old-PID``, the
    new one not yet in place) is put back first, so the newest step is never skipped."""
    root = Path(root)
    if not root.is_dir():
        return []
    _restore_interrupted_replacements(root)
    found = [p for p in root.iterdir() if p.name.startswith(CHECKPOINT_PREFIX) and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(path: str | Path) -> Path:
    """``path`` itself when it is a checkpoint, else its newest complete ``step-*`` checkpoint."""
    path = Path(path)
    if (path / STATE_FILE).is_file():
        return path
    found = list_checkpoints(path)
    if not found:
        raise FileNotFoundError(f"no complete checkpoint (with {STATE_FILE}) in {path}")
    return found[-1]


def _restore_interrupted_replacements(root: Path) -> None:
    for old in root.glob(f".{CHECKPOINT_PREFIX}*.old-*"):
        name = old.name[1:].rsplit(".old-", 1)[0]
        if (old / STATE_FILE).is_file() and not (root / name).exists():
            logger.warning("checkpoint %s was being replaced when its process died: restored", name)
            old.rename(root / name)
