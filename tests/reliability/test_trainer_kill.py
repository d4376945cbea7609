"""kill -9 of the trainer mid-step (also mid-checkpoint): it resumes from the newest complete
checkpoint, the policy version never goes back, and every checkpoint directory a server could be
pointed at is complete (written in a staging directory and renamed into place). The scenario is
``reliability_faults.trainer_kill_rounds`` (``bench/reliability.py`` repeats it)."""

from __future__ import annotations

import os

import pytest
import reliability_faults as faults  # tests/reliability/ is on sys.path (conftest.py)

from spanrl.trainer_bridge.torch_backend.checkpoints import checkpoint_name, list_checkpoints
from spanrl.trainer_bridge.torch_backend.config import TrainerConfig
from spanrl.trainer_bridge.torch_backend.trainer import TorchTrainer

KILLS = int(os.environ.get("SPANRL_TRAINER_KILLS", "1"))  # each run imports torch anew: ~15-25 s on 2 busy cores


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return faults.tiny_model_dir(tmp_path_factory.mktemp("trainer-kill"))


def test_kill_9_mid_step_resumes_without_going_back(tiny_model, tmp_path):
    assert faults.trainer_kill_rounds(tiny_model, tmp_path / "checkpoints", KILLS) >= 2 * KILLS


def test_a_kill_between_the_two_renames_of_a_replacement_keeps_the_checkpoint(tiny_model, tmp_path):
    """A re-save of the same step renames the old directory aside, then the new one into place;
    a kill in between left no step-N at all, so a resume went back to an older step."""
    checkpoints = tmp_path / "checkpoints"
    trainer = TorchTrainer(tiny_model, TrainerConfig(device="cpu", learning_rate=1e-3))
    trainer.step = trainer.policy_version = 1
    trainer.save_checkpoint(checkpoints / checkpoint_name(1))
    trainer.step = trainer.policy_version = 2
    trainer.save_checkpoint(checkpoints / checkpoint_name(2))
    # the state a kill between `out.rename(old)` and `staging.rename(out)` leaves behind
    (checkpoints / checkpoint_name(2)).rename(checkpoints / f".{checkpoint_name(2)}.old-4242")
    resumed = TorchTrainer.resume(checkpoints)
    assert (resumed.step, resumed.policy_version) == (2, 2)
    assert [p.name for p in list_checkpoints(checkpoints)] == [checkpoint_name(1), checkpoint_name(2)]
