"""The engine's growing KV-cache layers (``engine/growing_cache.py``): the same keys and values as
transformers' ``DynamicLayer`` through every change the running batch makes, the same logits from
a real model, and a decode step that writes in place instead of copying the cache."""

from __future__ import annotations

import random

import torch
from transformers import AutoModelForCausalLM
from transformers.cache_utils import DynamicLayer

from spanrl.trainer_bridge.torch_backend.engine.growing_cache import GrowingLayer, growing_layers
from spanrl.trainer_bridge.torch_backend.engine.kv_cache import fill_from_the_end, left_pad


def _columns(rows: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(rows, 2, count, 8), torch.randn(rows, 2, count, 8)


def test_a_growing_layer_holds_what_plain_tensors_hold_through_steps_leaves_cuts_and_joins():
    torch.manual_seed(0)
    rng = random.Random(0)
    keys, values = _columns(4, 5)
    layer = GrowingLayer(keys.clone(), values.clone())
    for step in range(120):
        action = rng.random()
        if action < 0.7:  # a decode step (past the spare room many times)
            new_keys, new_values = _columns(keys.shape[0], 1)
            got = layer.update(new_keys, new_values)
            keys, values = torch.cat([keys, new_keys], dim=2), torch.cat([values, new_values], dim=2)
            assert torch.equal(got[0], keys) and torch.equal(got[1], values)
        elif action < 0.8 and keys.shape[0] > 1:  # rows leave: the batch's order, or any order
            kept = sorted(rng.sample(range(keys.shape[0]), rng.randint(1, keys.shape[0] - 1)))
            index = torch.tensor(fill_from_the_end(kept) if rng.random() < 0.7 else rng.sample(kept, len(kept)))
            layer.batch_select_indices(index)
            keys, values = keys.index_select(0, index), values.index_select(0, index)
        elif action < 0.9 and keys.shape[2] > 2:  # leading columns cut
            count = rng.randint(1, keys.shape[2] - 1)
            layer.drop_leading_columns(count)
            keys, values = keys[:, :, count:], values[:, :, count:]
        else:  # newcomers join, shorter or longer (wider than the columns cut before them, too)
            joining_keys, joining_values = _columns(rng.randint(1, 3), rng.randint(1, keys.shape[2] + 20))
            layer.merge_rows(joining_keys, joining_values)
            width = max(keys.shape[2], joining_keys.shape[2])
            keys = torch.cat([left_pad(keys, width, 2), left_pad(joining_keys, width, 2)])
            values = torch.cat([left_pad(values, width, 2), left_pad(joining_values, width, 2)])
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values), step
        assert layer.get_seq_length() == keys.shape[2]


def _buffer_address(layer: GrowingLayer) -> int:
    return layer.keys.untyped_storage().data_ptr()


def test_rows_leave_and_join_in_place_moving_only_the_last_rows():
    keys, values = _columns(6, 10)
    layer = GrowingLayer(keys.clone(), values.clone())
    layer.update(*_columns(6, 1))  # into buffers with room
    held_keys = layer.keys.clone()
    address = _buffer_address(layer)
    order = fill_from_the_end([0, 2, 3, 5])  # rows 1 and 4 leave: row 5 takes row 1's place
    assert order == [0, 5, 2, 3]
    layer.batch_select_indices(torch.tensor(order))
    assert torch.equal(layer.keys, held_keys[order]) and _buffer_address(layer) == address
    layer.drop_leading_columns(3)  # 8 columns left of 11
    joining_keys, joining_values = _columns(2, 10)  # wider: the batch's rows get zeros before theirs
    layer.merge_rows(joining_keys, joining_values)
    assert _buffer_address(layer) == address  # the free rows took them, the cut columns came back
    assert torch.equal(layer.keys, torch.cat([left_pad(held_keys[order][:, :, 3:], 10, 2), joining_keys]))
    layer.merge_rows(*_columns(1, 3))  # no free row left: new buffers
    assert _buffer_address(layer) != address and layer.keys.shape[:3] == (7, 2, 10)


def test_tensors_set_from_outside_are_taken_as_they_are():
    keys, values = _columns(2, 3)
    layer = GrowingLayer(keys, values)
    layer.update(*_columns(2, 1))
    replaced_keys, replaced_values = _columns(2, 7)
    layer.keys, layer.values = replaced_keys, replaced_values  # what a DynamicLayer user may do
    new_keys, new_values = _columns(2, 1)
    got_keys, got_values = layer.update(new_keys, new_values)
    assert torch.equal(got_keys, torch.cat([replaced_keys, new_keys], dim=2))
    assert torch.equal(got_values, torch.cat([replaced_values, new_values], dim=2))


def _decode(model, prompt: torch.Tensor, steps: int, growing: bool) -> tuple[torch.Tensor, int]:
    """Greedy decoding of ``prompt``: the last step's logits and at how many steps the first
    layer's keys moved to new memory (a copy of the cache)."""
    with torch.inference_mode():
        output = model(input_ids=prompt, use_cache=True)
        cache = output.past_key_values
        if growing:
            growing_layers(cache)
        copies, previous_keys = 0, cache.layers[0].keys
        for step in range(steps):
            next_ids = output.logits[:, -1].argmax(-1, keepdim=True)
            positions = torch.full((prompt.shape[0], 1), prompt.shape[1] + step)
            output = model(input_ids=next_ids, position_ids=positions, past_key_values=cache, use_cache=True)
            cache = output.past_key_values
            keys = cache.layers[0].keys  # the previous keys are still held: new memory is a copy
            copies += keys.untyped_storage().data_ptr() != previous_keys.untyped_storage().data_ptr()
            previous_keys = keys
    return output.logits[:, -1], copies


def test_a_real_model_decodes_the_same_with_growing_layers_and_copies_its_cache_only_when_full(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa").eval()
    torch.manual_seed(1)
    prompt = torch.randint(3, model.config.vocab_size, (3, 20))
    plain_logits, plain_copies = _decode(model, prompt, 60, growing=False)
    growing_logits, growing_copies = _decode(model, prompt, 60, growing=True)
    torch.testing.assert_close(growing_logits, plain_logits, rtol=1e-5, atol=1e-5)
    assert plain_copies == 60  # a DynamicLayer copies the whole cache at every step
    assert growing_copies == 2  # 20 columns + room for 1 + 32, then 53 + room for 1 + 32
    cache_layers = model(input_ids=prompt, use_cache=True).past_key_values.layers
    assert all(type(layer) is DynamicLayer for layer in cache_layers)
