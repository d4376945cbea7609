"""Per-agent adapters in the torch trainer: each adapter learns only from its own agents'
transitions, the base stays frozen, checkpoints hold every adapter in peft's format."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from spanrl.trainer_bridge.backend import TrainingSample
from spanrl.trainer_bridge.torch_backend.config import TrainerConfig
from spanrl.trainer_bridge.torch_backend.trainer import TorchTrainer

from .conftest import TEST_DEVICE

ADAPTERS = {"writer": {"rank": 4, "alpha": 8, "learning_rate": 0.02},
            "fixers": {"agents": ["rewriter", "checker"], "rank": 2, "alpha": 4,
                       "target_modules": ["q_proj", "v_proj"]}}


def agent_samples(agent: str, seed: int, count: int = 4) -> list[TrainingSample]:
    rng = random.Random(seed)
    samples = []
    for _ in range(count):
        prompt = [1] + [rng.randrange(3, 300) for _ in range(rng.randint(3, 8))]
        response = [rng.randrange(3, 300) for _ in range(rng.randint(1, 6))] + [2]
        samples.append(TrainingSample(prompt, response, rng.uniform(-1.5, 1.5), agent_name=agent))
    return samples


def weights(trainer: TorchTrainer, adapter: str | None) -> dict[str, torch.Tensor]:
    """The adapter's weights (None: the base's), cloned."""
    if adapter is None:
        return {k: v.detach().clone() for k, v in trainer.model.state_dict().items() if "lora_" not in k}
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items() if f".{adapter}." in k}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def config():
    return TrainerConfig(device=TEST_DEVICE, learning_rate=0.01, adapters=ADAPTERS)


def test_each_adapter_changes_only_from_its_own_agents_transitions(tiny_model_dir, config):
    trainer = TorchTrainer(tiny_model_dir, config)
    assert all(not p.requires_grad for p in trainer.model.parameters())  # nothing but the active adapter trains
    base, writer, fixers = weights(trainer, None), weights(trainer, "writer"), weights(trainer, "fixers")
    assert writer and fixers
    stats = trainer.grpo_step(agent_samples("writer", 0) + agent_samples("stranger", 1))
    assert same(weights(trainer, None), base)  # the base is frozen
    assert same(weights(trainer, "fixers"), fixers)  # its agents sent nothing: bitwise the same
    assert not same(weights(trainer, "writer"), writer)
    assert stats["adapter/writer/samples"] == 4 and "adapter/fixers/samples" not in stats
    assert (trainer.step, trainer.policy_version) == (1, 1)

    # a mixed step: each adapter's update is what it would be on its own agents' samples alone
    alone = TorchTrainer(tiny_model_dir, config)
    alone.grpo_step(agent_samples("writer", 0))
    mixed_writer = weights(trainer, "writer")
    assert same(weights(alone, "writer"), mixed_writer)
    fixer_samples = agent_samples("rewriter", 2) + agent_samples("checker", 3, count=2)
    trainer.grpo_step(agent_samples("writer", 4) + fixer_samples)
    alone.grpo_step(agent_samples("writer", 4))
    assert same(weights(trainer, "writer"), weights(alone, "writer"))  # the fixers' samples did not move it
    assert not same(weights(trainer, "fixers"), fixers)
    assert same(weights(trainer, None), base)
    # the adapters' own learning rates
    assert trainer.adapter_optimizers["writer"].param_groups[0]["lr"] == 0.02
    assert trainer.adapter_optimizers["fixers"].param_groups[0]["lr"] == 0.01


def test_checkpoints_hold_each_adapter_in_peft_format_and_resume(tiny_model_dir, config, tmp_path):
    trainer = TorchTrainer(tiny_model_dir, config)
    trainer.grpo_step(agent_samples("writer", 0) + agent_samples("rewriter", 1))
    saved = trainer.save_checkpoint(tmp_path / "ckpt")
    for name in ("writer", "fixers"):
        assert (saved / "adapters" / name / "adapter_config.json").is_file()
        assert (saved / "adapters" / name / "adapter_model.safetensors").is_file()

    # peft loads an adapter onto the (unchanged) base saved beside it: the same logits as the trainer's
    ids = torch.tensor([[1, 40, 41, 42, 43, 44]])
    base = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(saved / "adapters" / "writer")).eval()
    trainer.model.set_adapter("writer")
    trainer.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, trainer.model(ids.to(trainer.device)).logits.cpu(),
                                   rtol=1e-5, atol=1e-5)

    resumed = TorchTrainer.resume(saved)
    assert (resumed.step, resumed.policy_version) == (1, 1)
    for name in ("writer", "fixers"):
        assert same(weights(resumed, name), weights(trainer, name))
    assert resumed.adapter_optimizers["writer"].state  # the optimizer's moments came back
    # the resumed trainer keeps training each adapter on its own agents
    fixers = weights(resumed, "fixers")
    resumed.grpo_step(agent_samples("writer", 5))
    assert same(weights(resumed, "fixers"), fixers)


def test_kl_to_the_base_with_adapters(tiny_model_dir):
    config = dataclasses.replace(TrainerConfig(device=TEST_DEVICE, adapters=ADAPTERS), kl_coef=0.1, learning_rate=0.05)
    trainer = TorchTrainer(tiny_model_dir, config)
    assert trainer.reference is None  # the base, adapters off, is the reference
    first = trainer.grpo_step(agent_samples("writer", 0))
    second = trainer.grpo_step(agent_samples("writer", 0))
    assert first["kl_loss"] == pytest.approx(0.0, abs=1e-7)  # LoRA's B starts at zero
    assert second["kl_loss"] > 0


def test_samples_carry_their_calls_agent_and_merged_rows_never_mix_agents():
    from spanrl.schema.rollouts import Transition
    from spanrl.schema.scored import ScoredRollout
    from spanrl.trainer_bridge.samples import training_samples
    from spanrl.trainer_bridge.task_dispatch import Attempt
    from spanrl.trainer_bridge.trajectory_merge import merge_trajectories

    def call(rollout_id: str, index: int, agent: str, prompt: tuple[int, ...], response: tuple[int, ...]):
        return Transition(rollout_id=rollout_id, index=index, span_id=f"{rollout_id}-{index}", agent_name=agent,
                          prompt_token_ids=prompt, response_token_ids=response, response_logprobs=None,
                          choice_index=0, policy_version=1, reward=0.0, return_=0.0, retokenized=False)

    def rollout(rollout_id: str, attempt: int, score: float) -> ScoredRollout:
        # the rewriter's prompt extends the writer's conversation: mergeable tokens, another agent
        calls = (call(rollout_id, 0, "writer", (1, 5, 6), (7, 8)),
                 call(rollout_id, 1, "rewriter", (1, 5, 6, 7, 8, 9), (10,)))
        return ScoredRollout(Attempt(rollout_id, "task", attempt, {"id": "task"}, 0), score, calls)

    samples, _ = training_samples([rollout("a", 0, 1.0), rollout("b", 1, 0.0)], "rollout", True)
    assert [s.agent_name for s in samples] == ["writer", "rewriter", "writer", "rewriter"]
    rows, stats = merge_trajectories(samples)
    assert len(rows) == 4 and stats.prefix_mismatches == 2
    assert [r.agent_name for r in rows] == ["writer", "rewriter", "writer", "rewriter"]
