"""TorchTrainer: GRPO raises a toy reward, SFT lowers loss, checkpoints resume after a crash."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM

from spanrl.trainer_bridge.advantages import group_advantages
from spanrl.trainer_bridge.backend import TrainingSample
from spanrl.trainer_bridge.torch_backend.config import TrainerConfig
from spanrl.trainer_bridge.torch_backend.engine.policy_engine import SamplingParams
from spanrl.trainer_bridge.torch_backend.trainer import TorchTrainer

# where models run in these tests: cpu, or cuda on a GPU machine (docs/gpu.md)
TEST_DEVICE = os.environ.get("SPANRL_TEST_DEVICE", "cpu")


def fixed_samples(seed: int = 0, count: int = 12) -> list[TrainingSample]:
    rng = random.Random(seed)
    samples = []
    for _ in range(count):
        prompt = [1] + [rng.randrange(3, 300) for _ in range(rng.randint(3, 9))]
        response = [rng.randrange(3, 300) for _ in range(rng.randint(1, 7))] + [2]
        samples.append(TrainingSample(prompt, response, rng.uniform(-1.5, 1.5)))
    return samples


def test_grpo_steps_raise_a_toy_reward(tiny_model_dir, engine):
    """Reward: the share of digit tokens in the response. A few GRPO steps must raise it."""
    trainer = TorchTrainer(tiny_model_dir, TrainerConfig(learning_rate=1e-2, device=TEST_DEVICE, seed=0))
    digits = {trainer.tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)}
    prompts = [engine.encode_chat([{"role": "user", "content": f"Say a number, please ({i})"}]) for i in range(4)]

    def rollouts(seed: int):
        results = []
        for group, prompt in enumerate(prompts):
            reply = engine.generate(prompt, SamplingParams(max_tokens=8, n=8, logprobs=True, seed=seed + group))
            for choice in reply.choices:
                share = sum(t in digits for t in choice.token_ids) / len(choice.token_ids)
                results.append((group, prompt, choice, share))
        return results

    before = sum(r[3] for r in rollouts(1000)) / 32
    for step in range(10):
        batch = rollouts(step * 10)
        advantages, keep = group_advantages([r[3] for r in batch], [r[0] for r in batch],
                                            list(range(len(batch))), level="rollout")
        samples = [TrainingSample(prompt, choice.token_ids, advantage, old_logprobs=choice.logprobs)
                   for (group, prompt, choice, _), advantage, kept in zip(batch, advantages, keep, strict=True)
                   if kept]
        stats = trainer.grpo_step(samples)
        assert stats["step"] == step + 1 and stats["policy_version"] == step + 1
        engine.swap_weights(trainer.policy_state_dict(), trainer.policy_version)
    after = sum(r[3] for r in rollouts(2000)) / 32
    assert after > before + 0.25, (before, after)


def test_engine_old_logprobs_are_used_when_given(tiny_model_dir):
    trainer = TorchTrainer(tiny_model_dir, TrainerConfig(device=TEST_DEVICE))
    samples = fixed_samples(1)
    current = trainer.sequence_logprobs(samples)
    given = [TrainingSample(s.prompt_token_ids, s.response_token_ids, s.advantage, [v + 1.0 for v in lp])
             for s, lp in zip(samples, current, strict=False)]
    stats = trainer.grpo_step(given)
    assert stats["ppo_kl"] == pytest.approx(1.0, abs=1e-3)  # mean(old - new) = +1
    recomputed = trainer.grpo_step(samples)
    assert abs(recomputed["ppo_kl"]) < 1e-5


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batches_give_the_full_batch_loss_and_gradient(tiny_model_dir, mode):
    samples = fixed_samples(2)
    results = []
    for budget in (100_000, 24):
        trainer = TorchTrainer(tiny_model_dir, TrainerConfig(device=TEST_DEVICE, loss_agg_mode=mode,
                                                             micro_batch_tokens=budget))
        old = [[v - 0.3 for v in lp] for lp in trainer.sequence_logprobs(samples)]
        results.append(trainer.grpo_step([TrainingSample(s.prompt_token_ids, s.response_token_ids,
                                                         s.advantage, o) for s, o in zip(samples, old, strict=False)]))
    whole, split = results
    assert whole["micro_batches"] == 1 and split["micro_batches"] > 3
    assert split["loss"] == pytest.approx(whole["loss"], rel=1e-5, abs=1e-7)
    assert split["grad_norm"] == pytest.approx(whole["grad_norm"], rel=1e-4)


def test_sft_learns_assistant_tokens_only(tiny_model_dir, make_calc_example, tmp_path):
    trainer = TorchTrainer(tiny_model_dir, TrainerConfig(device=TEST_DEVICE))
    rng = random.Random(0)
    example = make_calc_example(rng)
    ids, mask = trainer.encode_chat_example(example["messages"])
    learned = trainer.tokenizer.decode([t for t, m in zip(ids, mask, strict=False) if m])
    a_turn, b_turn = example["messages"][2]["content"], example["messages"][4]["content"]
    assert learned == f"{a_turn}<|im_end|>{b_turn}<|im_end|>"

    held_out = [make_calc_example(random.Random(99)) for _ in range(32)]
    before = trainer.sft_loss(held_out)
    summary = trainer.sft_steps(([make_calc_example(rng) for _ in range(32)] for _ in range(40)),
                                lr=3e-3, progress=False)
    after = trainer.sft_loss(held_out)
    assert summary["steps"] == 40 and summary["policy_version"] == 1
    assert after < 0.5 * before, (before, after)

    path = tmp_path / "demos.jsonl"
    path.write_text("".join(json.dumps(make_calc_example(rng)) + "\n" for _ in range(50)))
    assert trainer.sft_from_jsonl(path, steps=3, batch_size=8, progress=False)["steps"] == 3
    path.write_text(json.dumps(make_calc_example(rng)) + "\n" + '{"messages": "oops"}\n')
    with pytest.raises(ValueError, match=":2: not a chat example"):
        trainer.sft_from_jsonl(path, steps=1)



def test_sft_encodes_an_example_drawn_again_once_and_trains_on_the_same_tokens(tiny_model_dir, make_calc_example):
    from spanrl.trainer_bridge.backend import TokenExample
    from spanrl.trainer_bridge.torch_backend import sft

    trainer = TorchTrainer(tiny_model_dir, TrainerConfig(device=TEST_DEVICE))
    pool = [make_calc_example(random.Random(i)) for i in range(4)]
    # fresh dicts every step, as the warm-start generators build them
    summary = trainer.sft_steps(([json.loads(json.dumps(e)) for e in pool * 2] for _ in range(3)),
                                lr=1e-3, progress=False)
    assert summary["steps"] == 3 and summary["examples_encoded"] == 4

    cache = sft.EncodingCache(trainer.tokenizer, max_entries=2)
    for example in pool + pool:
        ids, mask = cache.encode(json.loads(json.dumps(example)))
        assert (ids, mask) == sft.encode_example(trainer.tokenizer, example)
        ids.append(0)  # the caller's own lists: what the cache keeps does not change
        mask.append(1)
    assert cache.encoded == 2 + 2 + 2  # two kept and read back; the two past max_entries encoded each time
    assert cache.encode(TokenExample((1, 2), (3,))) == ([1, 2, 3], [0, 0, 1])

CRASHING_RUN = textwrap.dedent("""
    import os, random, signal, sys
    from spanrl.trainer_bridge.backend import TrainingSample
    from spanrl.trainer_bridge.torch_backend.config import TrainerConfig
    from spanrl.trainer_bridge.torch_backend.trainer import TorchTrainer
    model_dir, checkpoints, samples_file = sys.argv[1:4]
    import json
    batches = [[TrainingSample(*s) for s in b] for b in json.load(open(samples_file))]
    device = os.environ.get("SPANRL_TEST_DEVICE", "cpu")
    trainer = TorchTrainer(model_dir, TrainerConfig(device=device, learning_rate=5e-3, checkpoint_every=2,
                                                    checkpoint_dir=checkpoints, keep_checkpoints=1))
    for number, batch in enumerate(batches):
        trainer.grpo_step(batch)
        if number == 2:   # step 3 done, its checkpoint not due: crash hard
            os.kill(os.getpid(), signal.SIGKILL)
""")


def test_resume_after_a_crash_continues_from_the_same_step_and_version(tiny_model_dir, tmp_path):
    batches = [fixed_samples(seed) for seed in range(10, 14)]
    samples_file = tmp_path / "batches.json"
    samples_file.write_text(json.dumps([[[list(s.prompt_token_ids), list(s.response_token_ids), s.advantage]
                                         for s in batch] for batch in batches]))
    checkpoints = tmp_path / "checkpoints"
    process = subprocess.Popen([sys.executable, "-c", CRASHING_RUN, str(tiny_model_dir), str(checkpoints),
                                str(samples_file)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == -signal.SIGKILL, output.decode()[-2000:]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000002"]

    resumed = TorchTrainer.resume(checkpoints)
    assert (resumed.step, resumed.policy_version) == (2, 2)
    assert AutoModelForCausalLM.from_pretrained(checkpoints / "step-000002") is not None
    for batch in batches[2:]:
        stats = resumed.grpo_step(batch)
    assert (stats["step"], stats["policy_version"]) == (4, 4)

    straight = TorchTrainer(tiny_model_dir, TrainerConfig(device=TEST_DEVICE, learning_rate=5e-3))
    for batch in batches:
        straight.grpo_step(batch)
    for (name, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values(), strict=False):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_lora_with_kl_trains_serves_and_resumes(tiny_model_dir, engine, tmp_path):
    config = TrainerConfig(device=TEST_DEVICE, lora_rank=4, lora_alpha=8, kl_coef=0.1, kl_estimator="low_var_kl",
                           learning_rate=1e-2)
    trainer = TorchTrainer(tiny_model_dir, config)
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in trainer.model.parameters())
    assert trainable < 0.2 * total
    samples = fixed_samples(5)
    first = trainer.grpo_step(samples)
    second = trainer.grpo_step(samples)
    assert first["kl_loss"] == pytest.approx(0.0, abs=1e-7)  # adapter starts as the reference
    assert second["kl_loss"] > 0
    merged = trainer.policy_state_dict()
    assert set(merged) == set(engine.model.state_dict())
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"],
                           engine.model.state_dict()["model.layers.0.self_attn.q_proj.weight"])
    engine.swap_weights(merged, trainer.policy_version)
    assert engine.version == 2

    saved = trainer.save_checkpoint(tmp_path / "lora-ckpt")
    loaded = AutoModelForCausalLM.from_pretrained(saved)
    torch.testing.assert_close(loaded.state_dict()["model.layers.0.self_attn.q_proj.weight"],
                               merged["model.layers.0.self_attn.q_proj.weight"].cpu())
    resumed = TorchTrainer.resume(saved)
    assert (resumed.step, resumed.policy_version) == (2, 2)
    torch.testing.assert_close(resumed.policy_state_dict()["model.layers.1.mlp.up_proj.weight"],
                               merged["model.layers.1.mlp.up_proj.weight"])


def test_mismatched_old_logprobs_are_recomputed_with_one_warning(tiny_model_dir, caplog):
    trainer = TorchTrainer(tiny_model_dir, TrainerConfig(device=TEST_DEVICE))
    samples = fixed_samples(3)
    current = trainer.sequence_logprobs(samples)
    given = [TrainingSample(s.prompt_token_ids, s.response_token_ids, s.advantage, [v + 1.0 for v in lp])
             for s, lp in zip(samples, current, strict=False)]
    bad = [0, 5]  # one logprob too many / too few: as from an engine that counts differently
    given[0] = TrainingSample(given[0].prompt_token_ids, given[0].response_token_ids, given[0].advantage,
                              list(given[0].old_logprobs) + [0.0])
    given[5] = TrainingSample(given[5].prompt_token_ids, given[5].response_token_ids, given[5].advantage,
                              list(given[5].old_logprobs)[:-1])
    with caplog.at_level("WARNING", logger="spanrl.trainer_bridge.torch_backend.batching"):
        stats = trainer.grpo_step(given)
    warnings = [r for r in caplog.records if "old logprobs" in r.getMessage()]
    assert len(warnings) == 1 and "sample 0" in warnings[0].getMessage() and "sample 5" in warnings[0].getMessage()
    # good samples keep their given logprobs (old - new = +1); the bad ones are recomputed (0)
    total = sum(len(s.response_token_ids) for s in samples)
    recomputed = sum(len(samples[i].response_token_ids) for i in bad)
    assert stats["ppo_kl"] == pytest.approx((total - recomputed) / total, abs=1e-3)


def test_resume_restores_the_torch_rng_state(tiny_model_dir, tmp_path):
    # The bug was on CUDA: the state was loaded onto the GPU and set_rng_state refused it; on
    # CPU this checks the state still round-trips through the checkpoint.
    trainer = TorchTrainer(tiny_model_dir, TrainerConfig(device=TEST_DEVICE))
    torch.manual_seed(1234)
    torch.rand(5)
    saved = trainer.save_checkpoint(tmp_path / "ckpt")
    expected = torch.rand(4)
    torch.manual_seed(0)
    TorchTrainer.resume(saved)
    assert torch.equal(torch.rand(4), expected)


def test_resumed_full_fine_tune_keeps_kl_to_the_base_model(tiny_model_dir, tmp_path):
    config = TrainerConfig(device=TEST_DEVICE, kl_coef=0.1, learning_rate=1e-2)
    trainer = TorchTrainer(tiny_model_dir, config)
    samples = fixed_samples(7)
    assert trainer.grpo_step(samples)["kl_loss"] == pytest.approx(0.0, abs=1e-7)
    saved = trainer.save_checkpoint(tmp_path / "ckpt")

    resumed = TorchTrainer.resume(saved)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    checkpoint = {name: value.cpu() for name, value in resumed.model.state_dict().items()}
    reference = {name: value.cpu() for name, value in resumed.reference.state_dict().items()}
    key = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(checkpoint[key], base[key])  # the step really moved the weights
    for name, value in base.items():
        torch.testing.assert_close(reference[name], value, rtol=0, atol=0, msg=name)
    assert not any(p.requires_grad for p in resumed.reference.parameters())
    assert resumed.grpo_step(samples)["kl_loss"] > 0  # the checkpoint as reference would give 0
