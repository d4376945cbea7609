"""Pieces of ``algorithm: sft`` and validation on their own: which rollouts an SFT step learns,
the torch trainer's NLL step, the validation rounds' rollout ids and schedule, and the plot's
val_reward line."""

from __future__ import annotations

import json
import random

import pytest

from spanrl.bridge_protocol import is_validation_rollout
from spanrl.schema.rollouts import Transition
from spanrl.schema.scored import ScoredRollout
from spanrl.trainer_bridge.backend import TrainingSample
from spanrl.trainer_bridge.metrics import MetricsLog
from spanrl.trainer_bridge.rejection_sampling import sft_samples
from spanrl.trainer_bridge.task_dispatch import Attempt, TaskDispatcher
from spanrl.trainer_bridge.train_settings import TrainSettings
from spanrl.trainer_bridge.validation import VALIDATION_PREFIX, Validator


def transition(rollout_id: str, index: int, response: tuple[int, ...]) -> Transition:
    return Transition(rollout_id=rollout_id, index=index, span_id=f"{rollout_id}-{index}", agent_name=None,
                      prompt_token_ids=(1, 2, 3 + index), response_token_ids=response, response_logprobs=None,
                      choice_index=0, policy_version=0, reward=0.0, return_=0.0, retokenized=False)


def scored(rollout_id: str, score: float, responses: list[tuple[int, ...]]) -> ScoredRollout:
    attempt = Attempt(rollout_id, "t1", 0, {}, 0)
    return ScoredRollout(attempt, score, tuple(transition(rollout_id, i, r) for i, r in enumerate(responses)))


def test_sft_learns_every_call_of_the_rollouts_at_or_above_the_threshold_only():
    rollouts = [scored("good", 1.0, [(5, 6), (7,)]), scored("bad", 0.0, [(8,)]),
                scored("edge", 0.5, [(9,), ()]), scored("low", 0.49, [(10,)])]
    samples, rejected = sft_samples(rollouts, min_reward=0.5)
    assert [(s.rollout_id, s.turn_index, tuple(s.response_token_ids)) for s in samples] == [
        ("good", 0, (5, 6)), ("good", 1, (7,)), ("edge", 0, (9,))]  # an empty response has nothing to learn
    assert rejected == {"bad", "low"}
    assert {s.reward for s in samples} == {1.0, 0.5}


def test_the_torch_sft_step_lowers_the_nll_of_the_learned_responses(tmp_path):
    from spanrl.trainer_bridge.torch_backend.config import TrainerConfig
    from spanrl.trainer_bridge.torch_backend.model_init import create_model_dir
    from spanrl.trainer_bridge.torch_backend.sft_update import sft_step
    from spanrl.trainer_bridge.torch_backend.trainer import TorchTrainer

    model = create_model_dir(tmp_path / "model", preset="tiny", seed=0)
    trainer = TorchTrainer(model, TrainerConfig(device="cpu", learning_rate=1e-3, checkpoint_every=0))
    rng = random.Random(0)
    samples = [TrainingSample([rng.randrange(3, 300) for _ in range(6)], [rng.randrange(3, 300) for _ in range(4)],
                              advantage=1.0) for _ in range(4)]

    def nll() -> float:
        values = [x for row in trainer.sequence_logprobs(samples) for x in row]
        return -sum(values) / len(values)

    before = nll()
    stats = sft_step(trainer, samples)
    assert stats["loss"] == pytest.approx(before, rel=1e-4)  # the NLL the step started from
    assert nll() < before - 0.05
    assert (trainer.step, trainer.policy_version) == (1, 1) and stats["response_tokens"] == 16


def test_validation_rounds_are_marked_apart_and_due_every_n_steps_and_at_the_end(tmp_path):
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps({"id": f"v{n}", "q": n}) + "\n" for n in range(3)))
    settings = TrainSettings(tasks=str(val), model="m", val_tasks=str(val), val_every=3, val_attempts=2, steps=7)
    validator = Validator(settings)
    assert [step + 1 for step in range(7) if validator.due(step)] == [3, 6, 7]
    attempts = TaskDispatcher(10.0).open_round(6, validator.tasks, 2, prefix=VALIDATION_PREFIX)
    assert len(attempts) == 6 and all(is_validation_rollout(a.rollout_id) for a in attempts)
    training = TaskDispatcher(10.0).open_round(6, validator.tasks, 2)
    assert not any(is_validation_rollout(a.rollout_id) for a in training)


def test_the_plot_draws_val_reward_where_it_was_taken(tmp_path):
    from PIL import Image, ImageChops

    rows = [{"step": n, "rollout/reward_mean": 0.1 * n, "actor/policy_version": n} for n in range(1, 6)]
    plain, validated = MetricsLog(str(tmp_path / "a")), MetricsLog(str(tmp_path / "b"))
    for row in rows:
        plain.append(row)
        validated.append({**row, "val/reward": 0.9} if row["step"] in (2, 4) else row)
    with Image.open(plain.plot()) as a, Image.open(validated.plot()) as b:
        difference = ImageChops.difference(a.convert("RGB"), b.convert("RGB"))
        assert difference.getbbox() is not None  # the val_reward line and its legend are drawn
