"""The last layer on the scored positions only (``scored_tail``): less work, nothing else changed.

A packed pass may run its last decoder layer only where a logprob is read. That must give the
same logprobs and gradients as the whole layer on every shape a batch takes (groups sharing a
prompt, a later call carrying an earlier one, completions that begin alike, a loss mask with a
gap), the same GRPO step, and be refused, leaving the layer as it was, on a model whose layer is
shaped otherwise.
"""

from __future__ import annotations

import random
from contextlib import nullcontext
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from spanrl.trainer_bridge.backend import TrainingSample
from spanrl.trainer_bridge.torch_backend.batching import enable_packing, enable_tail, pack_batch, token_logprobs
from spanrl.trainer_bridge.torch_backend.config import TrainerConfig
from spanrl.trainer_bridge.torch_backend.scored_tail import TAIL_FLAG
from spanrl.trainer_bridge.torch_backend.trainer import TorchTrainer


def varied_sequences(seed: int) -> list[tuple[list[int], list[int]]]:
    """Two groups of three calls sharing their prompt, each call's next call carrying it (prompt,
    response, a tool's result) before a new response; two completions of one prompt that begin
    alike (the shared beginning runs into what is scored); last, a call whose mask has a gap (a
    tool's result inside the scored part, as a merged trajectory has)."""
    rng = random.Random(seed)

    def new_ids(count: int) -> list[int]:
        return [rng.randrange(3, 300) for _ in range(count)]

    sequences = []
    for _ in range(2):
        prompt = new_ids(rng.randint(8, 30))
        for _ in range(3):
            first = prompt + new_ids(rng.randint(2, 10))
            context = first + new_ids(3)
            second = context + new_ids(rng.randint(2, 8))
            sequences += [(first, [0] * len(prompt) + [1] * (len(first) - len(prompt))),
                          (second, [0] * len(context) + [1] * (len(second) - len(context)))]
    prompt = new_ids(9)
    opening = new_ids(4)
    for _ in range(2):
        completion = opening + new_ids(rng.randint(2, 6))
        sequences.append((prompt + completion, [0] * len(prompt) + [1] * len(completion)))
    sequences.append((new_ids(30), [0] * 12 + [1] * 6 + [0] * 5 + [1] * 7))
    return sequences


def small_model(family: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_class, model_class = {"llama": (LlamaConfig, LlamaForCausalLM),
                                 "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[family]
    torch.manual_seed(0)
    return model_class(config_class(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2))


@pytest.fixture(params=["qwen2", "llama", "qwen3"])
def tail_model(request, tiny_model_dir):
    """spanrl's own model (Qwen2) and two other families (fewer key/value heads; Qwen3's head norms)."""
    if request.param == "qwen2":
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    else:
        model = small_model(request.param)
    assert enable_packing(model, 300, "cpu")
    assert enable_tail(model, 300, "cpu")
    return model


def test_the_tail_covers_every_scored_position_once_and_skips_the_rest():
    sequences = varied_sequences(1)
    batch = pack_batch(sequences, list(range(len(sequences))), "cpu", share_prefixes=True, tail=True)
    tail = batch.tail
    positions = tail.positions.tolist()
    assert len(set(positions)) == len(positions)
    assert torch.equal(tail.positions[tail.scored_index], batch.scored_positions)
    scored = set(batch.scored_positions.tolist())
    assert len(scored) < batch.scored_positions.numel()  # the completions that begin alike score one position twice
    # kept beyond the scored: only the gap's five positions, between two scored ones of one row
    assert len(set(positions) - scored) == 5
    assert len(positions) < batch.input_ids.numel()
    unscored = pack_batch([(ids, [0] * len(ids)) for ids, _ in sequences[:2]], [0, 1], "cpu", tail=True)
    assert unscored.tail is None  # nothing to run the last layer on: the whole layer, as without


def test_logprobs_and_gradients_with_the_tail_equal_the_whole_layers(tail_model):
    sequences = varied_sequences(2)
    batch = pack_batch(sequences, list(range(len(sequences))), "cpu", share_prefixes=True, tail=True)
    results = []
    for candidate in (batch, replace(batch, tail=None)):
        tail_model.zero_grad()
        values = token_logprobs(tail_model, candidate, nullcontext())
        (values * batch.response_mask * torch.linspace(0.5, 1.5, values.shape[1])).sum().backward()
        results.append((values.detach(), {name: p.grad.clone() for name, p in tail_model.named_parameters()}))
    (tail_values, tail_grads), (whole_values, whole_grads) = results
    assert tail_values.abs().sum() > 0
    assert torch.allclose(tail_values, whole_values, atol=1e-5)
    for name, grad in whole_grads.items():
        assert grad.abs().sum() > 0, name
        assert torch.allclose(tail_grads[name], grad, atol=1e-5, rtol=1e-4), name


@pytest.mark.parametrize("extra", [{}, {"gradient_checkpointing": True}, {"lora_rank": 4}],
                         ids=["full", "gradient-checkpointing", "lora"])
def test_a_grpo_step_with_the_tail_equals_one_without(tiny_model_dir, extra):
    rng = random.Random(4)
    samples = []
    for ids, mask in varied_sequences(4)[:-1]:  # (the gap's call is no TrainingSample: its mask is the response's)
        split = mask.index(1)
        samples.append(TrainingSample(ids[:split], ids[split:], rng.uniform(-1, 1)))
    trainers = [TorchTrainer(tiny_model_dir, TrainerConfig(learning_rate=1e-3, scored_tail=on, **extra))
                for on in (True, False)]
    assert [t.tail for t in trainers] == [True, False]
    stats = [t.grpo_step(samples) for t in trainers]
    assert stats[0]["loss"] == pytest.approx(stats[1]["loss"], rel=1e-5, abs=1e-7)
    assert stats[0]["grad_norm"] == pytest.approx(stats[1]["grad_norm"], rel=1e-4)
    with_tail, without = (t.model.state_dict() for t in trainers)
    for name, value in with_tail.items():
        assert torch.allclose(value, without[name], atol=1e-4), name


def test_a_layer_shaped_otherwise_is_left_as_it_was():
    """OLMo 2 normalises after attention and the MLP, under the same module names: the check
    at start finds that the tail would differ and keeps the whole layer."""
    from transformers import Olmo2Config, Olmo2ForCausalLM

    torch.manual_seed(0)
    model = Olmo2ForCausalLM(Olmo2Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, eos_token_id=2,
                                         pad_token_id=1, bos_token_id=0))
    assert enable_packing(model, 300, "cpu")
    assert not enable_tail(model, 300, "cpu")
    last = model.model.layers[-1]
    assert not hasattr(last, TAIL_FLAG) and "forward" not in vars(last)
