"""Checkpoints are their owner's: the folders `spanrl train` writes are owner-only, and a resumed
run loads the optimizer state with ``weights_only``, so a crafted ``optimizer.pt`` (a pickle that
would run code when loaded) is refused instead of run. Real trainer, real files."""

from __future__ import annotations

import os
import pickle
import stat

import pytest
import torch

from spanrl.trainer_bridge.backend import TrainingSample
from spanrl.trainer_bridge.torch_backend.checkpoints import OPTIMIZER_FILE, checkpoint_name
from spanrl.trainer_bridge.torch_backend.config import TrainerConfig
from spanrl.trainer_bridge.torch_backend.trainer import TorchTrainer


class RunsCodeWhenLoaded:
    """What an attacker would put in a checkpoint: unpickling it calls ``os.mkdir(marker)``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


@pytest.fixture
def saved(tiny_model_dir, tmp_path):
    trainer = TorchTrainer(tiny_model_dir, TrainerConfig(device="cpu", learning_rate=1e-3))
    trainer.grpo_step([TrainingSample([1, 5, 6, 7], [8, 9, 2], 1.0), TrainingSample([1, 5, 6, 7], [10, 2], -1.0)])
    root = tmp_path / "run" / "checkpoints"
    path = trainer.save_checkpoint(root / checkpoint_name(trainer.step))
    return root, path


def test_checkpoint_folders_are_owner_only_and_resume(saved):
    root, path = saved
    for folder in (root, path):
        assert stat.S_IMODE(os.stat(folder).st_mode) & 0o077 == 0, (folder, oct(os.stat(folder).st_mode))
    resumed = TorchTrainer.resume(root)  # the optimizer state loads with weights_only=True
    assert resumed.step == 1 and resumed.optimizer.state_dict()["state"]


def test_a_crafted_optimizer_file_is_refused_not_run(saved, tmp_path):
    root, path = saved
    marker = tmp_path / "code-ran"
    state = torch.load(path / OPTIMIZER_FILE, weights_only=True)
    state["payload"] = RunsCodeWhenLoaded(str(marker))
    torch.save(state, path / OPTIMIZER_FILE)
    with pytest.raises(pickle.UnpicklingError):
        TorchTrainer.resume(root)
    assert not marker.exists()
