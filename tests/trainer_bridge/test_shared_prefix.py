"""Decode steps that read a prompt beginning all rows share once (``engine/shared_prefix.py``):
the split attention equals attention over every column, rows of a real batch sharing a long
prompt get a forward pass's log-probs, and rows that share too little, or differ in adapter,
are not split."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from spanrl.trainer_bridge.torch_backend.engine.policy_engine import SamplingParams
from spanrl.trainer_bridge.torch_backend.engine.shared_prefix import (
    MIN_SHARED_TOKENS,
    SharedPrefix,
    common_prefix_length,
    shared_length,
    shared_prefix_attention,
)

from .engine_steps import submit_at_one_step


@pytest.mark.parametrize(("groups", "queries"), [(1, 1), (2, 1), (2, 3)])
def test_the_split_equals_attention_over_every_column(groups, queries):
    """Left-padded rows whose first ``length`` real columns hold the same keys and values; one
    query a row (a decode step) or several, causal among themselves (a prefill pass after cached
    tokens)."""
    torch.manual_seed(0)
    rows, kv_heads, head_dim, columns, length = 5, 2, 8, 40, 20
    first = torch.tensor([0, 3, 7, 1, 12])  # the last row's own columns start past others' shared ones
    shared_keys, shared_values = torch.randn(kv_heads, length, head_dim), torch.randn(kv_heads, length, head_dim)
    key, value = torch.randn(rows, kv_heads, columns, head_dim), torch.randn(rows, kv_heads, columns, head_dim)
    attention = torch.zeros(rows, columns, dtype=torch.long)
    for row, start in enumerate(first.tolist()):
        key[row, :, start:start + length], value[row, :, start:start + length] = shared_keys, shared_values
        attention[row, start:] = 1
    query = torch.randn(rows, kv_heads * groups, queries, head_dim)
    module = SimpleNamespace(num_key_value_groups=groups, is_causal=True, training=False)
    causal = torch.ones(columns, columns, dtype=torch.bool).tril()[columns - queries:]
    mask = (causal.unsqueeze(0) & attention.bool().unsqueeze(1)).unsqueeze(1)  # [rows, 1, queries, columns]
    expected, _ = shared_prefix_attention(module, query, key, value, mask)  # no split: sdpa
    split = SharedPrefix.for_step(length, attention, queries)
    assert split.start == int(first.min()) + length and split.first_of_row_0 == 0
    got, _ = shared_prefix_attention(module, query, key, value, mask, shared_prefix=split)
    assert got.shape == (rows, queries, kv_heads * groups, head_dim)
    assert torch.allclose(got, expected, atol=1e-5)
    key[4, :, 0] += 100.0  # a padding column of the last row: masked in both
    got, _ = shared_prefix_attention(module, query, key, value, mask, shared_prefix=split)
    assert torch.allclose(got, expected, atol=1e-5)


def _row(prompt: list[int], adapter: str | None = None) -> SimpleNamespace:
    return SimpleNamespace(request=SimpleNamespace(prompt_ids=prompt, params=SimpleNamespace(adapter=adapter)))


def test_the_shared_length_is_the_rows_common_prompt_beginning():
    base = list(range(100))
    assert common_prefix_length(base, base[:70] + [7, 7], 100) == 70
    assert common_prefix_length(base, base, 30) == 30
    assert common_prefix_length([1], [2], 5) == 0
    same = _row(base)
    assert shared_length([same, same]) == 100  # one request's choices: its whole prompt
    assert shared_length([_row(base), _row(base[:80] + [1, 2, 3]), _row(base[:90])]) == 80
    assert shared_length([_row(base), _row(base[:MIN_SHARED_TOKENS - 1] + [5] * 40)]) == 0  # too little
    assert shared_length([_row(base), _row(base, adapter="solver")]) == 0  # another adapter's keys


def _long_chat(engine, question: str) -> list[int]:
    instructions = "You add numbers. Answer with ANSWER followed by the sum and nothing else. " * 8
    return engine.encode_chat([{"role": "system", "content": instructions}, {"role": "user", "content": question}])


def test_rows_sharing_a_long_prompt_decode_split_and_get_a_forward_passes_logprobs(engine, forward_logprobs):
    assert engine.model.config._attn_implementation == "spanrl_shared_prefix"
    prompts = [_long_chat(engine, question) for question in ("What is 1 + 2?", "And 30 + 12?", "Sum 5 and 6.")]
    assert len(prompts[0]) > 2 * MIN_SHARED_TOKENS
    splits: list[SharedPrefix] = []
    handle = engine.model.register_forward_pre_hook(
        lambda module, args, kwargs: splits.append(kwargs["shared_prefix"]) if "shared_prefix" in kwargs else None,
        with_kwargs=True)
    try:
        jobs = [engine.submit(prompt, SamplingParams(max_tokens=8, n=2, logprobs=True, temperature=1.0, seed=i))
                for i, prompt in enumerate(prompts)]
        results = [job.wait(60) for job in jobs]
    finally:
        handle.remove()
    assert splits and all(split.length >= MIN_SHARED_TOKENS for split in splits)
    for prompt, result in zip(prompts, results, strict=True):
        for choice in result.choices:
            expected = forward_logprobs(engine.model, prompt, choice.token_ids)
            assert torch.allclose(torch.tensor(choice.logprobs), expected, atol=1e-4)


def test_prompts_after_a_cached_beginning_are_prefilled_split_and_get_a_forward_passes_logprobs(engine,
                                                                                                 forward_logprobs):
    """Three prompts whose cached beginning is the same join a running batch at one step: their
    prefill pass reads that beginning once too."""
    engine.generate(_long_chat(engine, "What is 9 + 9?"), SamplingParams(max_tokens=2, temperature=0.0))
    prompts = [_long_chat(engine, question) for question in ("What is 1 + 2?", "And 30 + 12?", "Sum 5 and 6.")]
    passes: list[tuple[int, SharedPrefix | None]] = []
    results = submit_at_one_step(
        engine, prompts, lambda i: SamplingParams(max_tokens=6, logprobs=True, temperature=1.0, seed=i),
        lambda kwargs: passes.append((kwargs["input_ids"].shape[1], kwargs.get("shared_prefix"))))
    split_prefills = [split for width, split in passes if width > 1 and split is not None]
    assert len(split_prefills) == 1 and split_prefills[0].length >= MIN_SHARED_TOKENS
    for prompt, result in zip(prompts, results, strict=True):
        expected = forward_logprobs(engine.model, prompt, result.choices[0].token_ids)
        assert torch.allclose(torch.tensor(result.choices[0].logprobs), expected, atol=1e-4)
