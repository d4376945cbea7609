"""kill -9 of the trainer mid-step (also mid-checkpoint): it resumes from the newest complete
checkpoint, the policy version never goes back, and every checkpoint directory a server could be
pointed at is complete (written in a staging directory and renamed into place)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest

torch = pytest.importorskip("torch")

from spanrl.trainer_bridge.torch_backend.checkpoints import (  # noqa: E402
    STATE_FILE,
    checkpoint_name,
    list_checkpoints,
)
from spanrl.trainer_bridge.torch_backend.trainer import TorchTrainer  # noqa: E402

KILLS = int(os.environ.get("SPANRL_TRAINER_KILLS", "2"))  # each run imports torch anew: ~15 s on 2 busy cores
TRAINING_RUN = textwrap.dedent("""
    import random, sys
    from pathlib import Path
    from spanrl.trainer_bridge.backend import TrainingSample
    from spanrl.trainer_bridge.torch_backend.checkpoints import list_checkpoints
    from spanrl.trainer_bridge.torch_backend.config import TrainerConfig
    from spanrl.trainer_bridge.torch_backend.trainer import TorchTrainer
    model_dir, checkpoints = sys.argv[1:3]
    config = TrainerConfig(device="cpu", learning_rate=1e-3, checkpoint_every=1, checkpoint_dir=checkpoints,
                           keep_checkpoints=2)
    if list_checkpoints(checkpoints):
        trainer = TorchTrainer.resume(checkpoints, config)
    else:
        trainer = TorchTrainer(model_dir, config)
    print(f"started at version {trainer.policy_version}", flush=True)
    rng = random.Random(trainer.step)
    while True:
        batch = [TrainingSample([1] + [rng.randrange(3, 200) for _ in range(6)], [rng.randrange(3, 200), 2],
                                rng.uniform(-1, 1)) for _ in range(8)]
        trainer.grpo_step(batch)  # saves step-NNNNNN after every step
        print(f"version {trainer.policy_version}", flush=True)
""")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from spanrl.trainer_bridge.torch_backend.model_init import create_model_dir

    folder = tmp_path_factory.mktemp("trainer-kill")
    corpus = folder / "corpus.txt"
    corpus.write_text("CALC 1+2\nRESULT 3\nANSWER 3\n" * 20)
    return create_model_dir(folder / "tiny", preset="tiny", corpus_files=[corpus], seed=0)


def _run_until_killed(model_dir, checkpoints, steps_before_kill: int, rng: random.Random) -> tuple[int, int]:
    """Train until ``steps_before_kill`` steps were reported, then kill -9 at a random moment of
    the next step (training or writing its checkpoint). Returns (version started at, last
    version reported, i.e. saved)."""
    process = subprocess.Popen([sys.executable, "-c", TRAINING_RUN, str(model_dir), str(checkpoints)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert process.stdout is not None
    started_at, reported, step_times = None, None, []
    try:
        last = time.monotonic()
        for line in process.stdout:
            if line.startswith("started at version"):
                started_at = int(line.split()[-1])
                last = time.monotonic()
            elif line.startswith("version"):
                reported = int(line.split()[-1])
                step_times.append(time.monotonic() - last)
                last = time.monotonic()
                if len(step_times) >= steps_before_kill:
                    break
        assert started_at is not None and reported is not None, "the training run did not start"
        time.sleep(rng.uniform(0.0, sum(step_times) / len(step_times)))
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return started_at, reported


def test_kill_9_mid_step_resumes_without_going_back(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    checkpoints = tmp_path / "checkpoints"
    rng = random.Random(0)
    highest_saved = 0
    for _ in range(KILLS):
        started_at, reported = _run_until_killed(tiny_model, checkpoints, 2, rng)
        assert started_at >= highest_saved, f"resumed at version {started_at} after {highest_saved} was saved"
        highest_saved = max(highest_saved, reported)
        complete = list_checkpoints(checkpoints)
        assert complete, "no complete checkpoint after the kill"
        newest = complete[-1]
        state = json.loads((newest / STATE_FILE).read_text())
        assert state["policy_version"] >= highest_saved
        # what a policy server would load from the newest checkpoint is whole
        assert AutoModelForCausalLM.from_pretrained(newest) is not None
        for entry in checkpoints.iterdir():  # anything else is a hidden staging or replaced directory
            assert entry in complete or entry.name.startswith("."), entry
    resumed = TorchTrainer.resume(checkpoints)
    assert resumed.policy_version >= highest_saved >= 2 * KILLS


def test_a_kill_between_the_two_renames_of_a_replacement_keeps_the_checkpoint(tiny_model, tmp_path):
    """A re-save of the same step renames the old directory aside, then the new one into place;
    a kill in between left no step-N at all, so a resume went back to an older step."""
    checkpoints = tmp_path / "checkpoints"
    trainer = TorchTrainer(tiny_model, trainer_config())
    trainer.step = trainer.policy_version = 1
    trainer.save_checkpoint(checkpoints / checkpoint_name(1))
    trainer.step = trainer.policy_version = 2
    trainer.save_checkpoint(checkpoints / checkpoint_name(2))
    # the state a kill between `out.rename(old)` and `staging.rename(out)` leaves behind
    (checkpoints / checkpoint_name(2)).rename(checkpoints / f".{checkpoint_name(2)}.old-4242")
    resumed = TorchTrainer.resume(checkpoints)
    assert (resumed.step, resumed.policy_version) == (2, 2)
    assert [p.name for p in list_checkpoints(checkpoints)] == [checkpoint_name(1), checkpoint_name(2)]


def trainer_config():
    from spanrl.trainer_bridge.torch_backend.config import TrainerConfig

    return TrainerConfig(device="cpu", learning_rate=1e-3)
