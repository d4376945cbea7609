"""Packed micro-batches: the torch trainer's sequences end to end in one row, no padding.

Packing must change nothing but speed: the same logprobs, gradients and GRPO update as padded
batches, on a model whose attention spanrl's packed attention can take; a model it cannot take
(here a sliding window) is found out at start and trained padded. Sequences that begin alike
(a group's prompt, an agent's earlier turns) may share that beginning in the packed row: that
too must give what running each on its own gives.
"""

from __future__ import annotations

import json
import random
import shutil
from contextlib import nullcontext

import pytest
import torch
from transformers import AutoModelForCausalLM

from spanrl.trainer_bridge.backend import TrainingSample
from spanrl.trainer_bridge.torch_backend.batching import (
    SHARED_READS_PER_TOKEN,
    enable_packing,
    micro_batches,
    pack_batch,
    pad_batch,
    token_logprobs,
)
from spanrl.trainer_bridge.torch_backend.config import TrainerConfig
from spanrl.trainer_bridge.torch_backend.packed_attention import row_layout
from spanrl.trainer_bridge.torch_backend.trainer import TorchTrainer


def random_sequences(seed: int, count: int, longest: int) -> list[tuple[list[int], list[int]]]:
    """Sequences of 2..longest ids; the mask scores a random tail (a response) of each."""
    rng = random.Random(seed)
    sequences = []
    for _ in range(count):
        length = rng.randint(2, longest)
        prompt = rng.randint(1, length - 1)
        sequences.append(([rng.randrange(3, 300) for _ in range(length)], [0] * prompt + [1] * (length - prompt)))
    return sequences


def grouped_sequences(seed: int, groups: int, group_size: int) -> list[tuple[list[int], list[int]]]:
    """GRPO-shaped sequences: each group's prompt then one response per member; a member's second
    call carries its first call (prompt, response, a tool result) before a new response; and one
    exact repeat."""
    rng = random.Random(seed)
    sequences = []
    for _ in range(groups):
        prompt = [rng.randrange(3, 300) for _ in range(rng.randint(3, 40))]
        for _ in range(group_size):
            first = prompt + [rng.randrange(3, 300) for _ in range(rng.randint(1, 12))]
            sequences.append((first, [0] * len(prompt) + [1] * (len(first) - len(prompt))))
            if rng.random() < 0.5:
                context = first + [rng.randrange(3, 300) for _ in range(rng.randint(1, 5))]
                second = context + [rng.randrange(3, 300) for _ in range(rng.randint(1, 9))]
                sequences.append((second, [0] * len(context) + [1] * (len(second) - len(context))))
    sequences.append(sequences[1])
    rng.shuffle(sequences)
    return sequences


def test_the_layout_puts_every_packed_token_back_where_it_was():
    lengths = [1, 7, 3, 40, 41, 2, 90, 13, 13]
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    layout = row_layout([range(start, start + n) for start, n in zip(starts, lengths, strict=True)], sum(lengths))
    positions = torch.arange(sum(lengths))
    bucketed = torch.cat([positions[bucket.queries].reshape(-1) for bucket in layout.buckets])
    assert torch.equal(bucketed[layout.unpack_index], positions)
    assert len(layout.buckets) > 1  # lengths 1..90 do not share one bucket
    for bucket in layout.buckets:  # nothing shared: each row is one sequence from its start, in order, unmasked
        assert bucket.mask is None and torch.equal(bucket.queries, bucket.keys)
        for row in bucket.keys.tolist():
            start = row[0]
            length = lengths[starts.index(start)]
            assert row[:length] == list(range(start, start + length))


def test_rows_that_share_a_beginning_compute_only_their_own_tails():
    rows = [[0, 1, 2, 3], [0, 1, 4], [0, 1, 2, 5, 6, 7, 8, 9, 10], [11, 12], [0, 1, 2]]
    layout = row_layout(rows, 13)
    bucketed = torch.cat([bucket.queries.reshape(-1) for bucket in layout.buckets])
    assert torch.equal(bucketed[layout.unpack_index], torch.arange(13))
    found = []
    for bucket in layout.buckets:  # each row's keys as given, its queries its own tail, both right-padded
        for slot, (keys, queries) in enumerate(zip(bucket.keys.tolist(), bucket.queries.tolist(), strict=True)):
            given = next(r for r in rows if keys[: len(r)] == r and set(keys[len(r):]) <= {r[0]})
            shared = {0: 0, 1: 2, 2: 3, 3: 0}[rows.index(given)]
            tail = given[shared:]
            assert queries[: len(tail)] == tail and set(queries[len(tail):]) <= {given[0]}
            if bucket.mask is not None:  # query i sees the keys up to its own place in the row
                seen = bucket.mask[slot, 0].sum(dim=1).tolist()  # how many keys each query sees
                assert seen[: len(tail)] == [shared + i + 1 for i in range(len(tail))]
            else:
                assert shared == 0
            found.append(rows.index(given))
    assert sorted(found) == [0, 1, 2, 3]  # a row that brings nothing new ([0, 1, 2]) computes nothing
    with pytest.raises(ValueError, match="1 of 14 packed tokens are in no row"):
        row_layout(rows, 14)
    with pytest.raises(ValueError, match="row 1 shares positions after its beginning"):
        row_layout([[0, 1, 2], [3, 1]], 4)


def test_shared_beginnings_are_packed_once_and_read_by_every_sequence():
    sequences = grouped_sequences(6, 3, 4)
    rows = list(range(len(sequences)))
    shared, plain = pack_batch(sequences, rows, "cpu", share_prefixes=True), pack_batch(sequences, rows, "cpu")
    assert plain.input_ids.shape[1] == sum(len(ids) for ids, _ in sequences)
    assert shared.input_ids.shape[1] < plain.input_ids.shape[1] - 3 * 2 * 3  # each group's prompt, at least
    for batch in (shared, plain):  # every scored token is predicted from the token before it
        flat = batch.input_ids[0]
        for (ids, mask), b in zip(sequences, rows, strict=True):
            picked = batch.scored_positions[batch.response_mask[:b].sum().long():][: sum(mask[1:])]
            scored = [t for t in range(1, len(ids)) if mask[t]]
            assert flat[picked].tolist() == [ids[t - 1] for t in scored]
            assert batch.position_ids[0, picked].tolist() == [t - 1 for t in scored]


def test_packed_micro_batches_keep_within_the_budget_in_real_tokens():
    sequences = random_sequences(1, 40, 30)
    groups = micro_batches(sequences, 64, packed=True)
    assert sorted(i for group in groups for i in group) == list(range(40))
    for group in groups:
        tokens = sum(len(sequences[i][0]) for i in group)
        assert tokens <= 64 or len(group) == 1
    padded = micro_batches(sequences, 64)
    assert len(groups) < len(padded)  # padding costs budget that packing does not


def test_shared_micro_batches_count_a_shared_beginning_once():
    sequences = grouped_sequences(7, 4, 6)
    budget = 120
    groups = micro_batches(sequences, budget, packed=True, share_prefixes=True)
    assert sorted(i for group in groups for i in group) == list(range(len(sequences)))
    for group in groups:
        packed = pack_batch(sequences, group, "cpu", share_prefixes=True).input_ids.shape[1]
        read = sum(len(sequences[i][0]) for i in group)  # what attention reads, shared tokens each time
        assert (packed <= budget and read <= SHARED_READS_PER_TOKEN * budget) or len(group) == 1
    assert len(groups) < len(micro_batches(sequences, budget, packed=True))


def test_shared_micro_batches_bound_what_attention_reads():
    prompt = list(range(3, 103))  # one long prompt, many short answers: few packed tokens, many reads
    sequences = [(prompt + [200 + i], [0] * 100 + [1]) for i in range(40)]
    groups = micro_batches(sequences, 200, packed=True, share_prefixes=True)
    assert [len(group) for group in groups] == [7, 7, 7, 7, 7, 5]  # 7 x 101 <= 4 x 200 < 8 x 101


@pytest.mark.parametrize("share", [False, True], ids=["end-to-end", "shared-beginnings"])
def test_packed_logprobs_and_gradients_equal_padded_ones(tiny_model_dir, share):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert enable_packing(model, 300, "cpu")
    sequences = grouped_sequences(2, 3, 5) if share else random_sequences(2, 12, 70)
    rows = list(range(len(sequences)))
    results = []
    for batch in (pack_batch(sequences, rows, "cpu", share_prefixes=share), pad_batch(sequences, rows, 0, "cpu")):
        model.zero_grad()
        values = token_logprobs(model, batch, nullcontext())
        (values * batch.response_mask * torch.linspace(0.5, 1.5, values.shape[1])).sum().backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        results.append((values.detach(), grads))
    (packed, packed_grads), (padded, padded_grads) = results
    assert packed.shape == padded.shape
    assert torch.allclose(packed, padded, atol=1e-5)
    assert packed.abs().sum() > 0
    for name, grad in packed_grads.items():
        assert torch.allclose(grad, padded_grads[name], atol=1e-5, rtol=1e-4), name


@pytest.mark.parametrize("extra", [{}, {"gradient_checkpointing": True}, {"lora_rank": 4}],
                         ids=["full", "gradient-checkpointing", "lora"])
def test_a_grpo_step_packed_equals_one_padded(tiny_model_dir, extra):
    """Packed with shared beginnings (the default) against padded, on groups' calls."""
    rng = random.Random(3)
    samples = []
    for ids, mask in grouped_sequences(3, 3, 5):
        split = mask.index(1)
        samples.append(TrainingSample(ids[:split], ids[split:], rng.uniform(-1, 1)))
    trainers = [TorchTrainer(tiny_model_dir, TrainerConfig(learning_rate=1e-3, pack_sequences=pack, **extra))
                for pack in (True, False)]
    assert [t.packed for t in trainers] == [True, False]
    assert trainers[0].config.share_prefixes
    stats = [t.grpo_step(samples) for t in trainers]
    assert stats[0]["model_tokens"] < stats[0]["tokens"] <= stats[1]["model_tokens"]
    assert stats[0]["loss"] == pytest.approx(stats[1]["loss"], rel=1e-5, abs=1e-7)
    assert stats[0]["grad_norm"] == pytest.approx(stats[1]["grad_norm"], rel=1e-4)
    packed_weights, padded_weights = (t.model.state_dict() for t in trainers)
    for name, value in packed_weights.items():  # Adam's first step is ~lr * sign(grad): 1e-3 where it differs
        assert torch.allclose(value, padded_weights[name], atol=1e-4), name
    packed_logprobs, padded_logprobs = (t.sequence_logprobs(samples[:4]) for t in trainers)
    for packed_row, padded_row in zip(packed_logprobs, padded_logprobs, strict=True):
        assert packed_row == pytest.approx(padded_row, abs=1e-4)


def test_a_model_with_a_sliding_window_is_trained_padded(tiny_model_dir, tmp_path):
    windowed = tmp_path / "windowed"
    shutil.copytree(tiny_model_dir, windowed)
    config = json.loads((windowed / "config.json").read_text())
    layers = config["num_hidden_layers"]
    config.update(use_sliding_window=True, sliding_window=4, max_window_layers=0,
                  layer_types=["sliding_attention"] * layers)
    (windowed / "config.json").write_text(json.dumps(config))
    model = AutoModelForCausalLM.from_pretrained(windowed, dtype=torch.float32)
    assert not enable_packing(model, 300, "cpu")
    trainer = TorchTrainer(windowed, TrainerConfig(learning_rate=1e-3))
    assert not trainer.packed
    sequences = random_sequences(4, 4, 20)
    samples = [TrainingSample(ids[:2], ids[2:], 1.0) for ids, _ in sequences if len(ids) > 3]
    stats = trainer.grpo_step(samples)
    assert stats["micro_batches"] >= 1 and torch.isfinite(torch.tensor(stats["loss"]))
    assert stats["grad_norm"] > 0


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_other_families_with_grouped_query_attention_pack_the_same(family):
    """Llama builds its causal mask itself (no precomputed masks); both use fewer key/value heads."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    families = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
    config_class, model_class = families[family]
    torch.manual_seed(0)
    model = model_class(config_class(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2)).eval()
    assert enable_packing(model, 300, "cpu")
    for sequences, share in ((random_sequences(5, 9, 60), False), (grouped_sequences(5, 3, 4), True)):
        rows = list(range(len(sequences)))
        with torch.no_grad():
            packed = token_logprobs(model, pack_batch(sequences, rows, "cpu", share_prefixes=share), nullcontext())
            padded = token_logprobs(model, pad_batch(sequences, rows, 0, "cpu"), nullcontext())
        assert torch.allclose(packed, padded, atol=1e-5), share
