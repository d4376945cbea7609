"""The engine's prefix cache (``engine/prefix_cache.py``): a prompt that starts like a recent one
is prefilled only from where they part, with the log-probs a forward pass gives; never across
adapters or weight versions; bounded in memory."""

from __future__ import annotations

import torch

from spanrl.trainer_bridge.torch_backend.engine.policy_engine import PolicyEngine, SamplingParams
from spanrl.trainer_bridge.torch_backend.engine.prefix_cache import BLOCK, MIN_REUSED_TOKENS, PrefixCache

from .engine_steps import submit_at_one_step

GREEDY = dict(temperature=0.0)


def _layers(tokens: int, fill: float = 0.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.full((1, 2, tokens, 4), fill), torch.full((1, 2, tokens, 4), fill + 1)) for _ in range(2)]


def test_the_longest_stored_prefix_is_found_in_whole_blocks_and_short_of_the_prompt():
    cache = PrefixCache(max_bytes=10**8, min_reused_tokens=BLOCK)
    stored = list(range(3 * BLOCK + 5))
    cache.store(stored, None, _layers(len(stored), fill=7.0))
    assert cache.longest(list(range(BLOCK - 1)), None) is None  # less than a block in common
    hit = cache.longest(stored[:2 * BLOCK + 3] + [999, 998], None)
    assert hit is not None and hit.length == 2 * BLOCK
    assert all(keys.shape[2] == 2 * BLOCK and float(keys[0, 0, 0, 0]) == 7.0 for keys, _ in hit.layers)
    assert cache.longest(stored, None).length == 3 * BLOCK  # its own prompt: one token left to compute
    assert cache.longest(stored[:3 * BLOCK], None).length == 2 * BLOCK  # never the whole prompt
    assert cache.longest(stored, "solver") is None  # another adapter's prompts are another cache
    assert cache.longest([5] + stored[1:], None) is None  # a difference in the first block
    assert PrefixCache(10**8, min_reused_tokens=3 * BLOCK).longest(stored, None) is None  # empty
    at_least_three = PrefixCache(10**8, min_reused_tokens=3 * BLOCK)
    at_least_three.store(stored, None, _layers(len(stored)))
    assert at_least_three.longest(stored[:2 * BLOCK + 3] + [999], None) is None  # too little to reuse
    assert at_least_three.longest(stored, None).length == 3 * BLOCK
    cache.clear()
    assert cache.longest(stored, None) is None and cache.bytes == 0


def test_the_least_recently_used_prompts_go_first_beyond_the_memory_bound():
    one_prompt = sum(k.nbytes + v.nbytes for k, v in _layers(2 * BLOCK))
    cache = PrefixCache(max_bytes=2 * one_prompt, min_reused_tokens=BLOCK)
    prompts = [[number] * (2 * BLOCK) for number in range(3)]
    cache.store(prompts[0], None, _layers(2 * BLOCK))
    cache.store(prompts[1], None, _layers(2 * BLOCK))
    assert cache.longest(prompts[0], None) is not None  # now the more recently used
    cache.store(prompts[2], None, _layers(2 * BLOCK))
    assert len(cache) == 2 and cache.bytes <= cache.max_bytes
    assert cache.longest(prompts[1], None) is None
    assert cache.longest(prompts[0], None) is not None and cache.longest(prompts[2], None) is not None


def _chat(engine, turns: int) -> list[int]:
    messages = [{"role": "system", "content": "You add numbers and answer with ANSWER n. " * 6}]
    for turn in range(turns):
        messages += [{"role": "user", "content": f"What is {turn} + {turn + 5}?"},
                     {"role": "assistant", "content": f"ANSWER {2 * turn + 5}"}]
    return engine.encode_chat(messages + [{"role": "user", "content": "And 12 + 30?"}])


def test_a_longer_prompt_reuses_a_cached_one_and_gets_a_forward_passes_logprobs(engine, forward_logprobs):
    cache = engine._scheduler.prefix_cache
    assert cache is not None
    first, second = _chat(engine, 1), _chat(engine, 3)  # the second: the first's history, then more
    shared = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    assert shared > MIN_REUSED_TOKENS + BLOCK
    params = SamplingParams(max_tokens=8, logprobs=True, n=3, temperature=1.0, seed=3)
    engine.generate(first, params)
    hits, reused = cache.hits, cache.tokens_reused
    result = engine.generate(second, params)
    assert cache.hits == hits + 1 and shared - BLOCK < cache.tokens_reused - reused <= shared
    for choice in result.choices:  # the n choices share the cached prefix
        expected = forward_logprobs(engine.model, second, choice.token_ids)
        assert torch.allclose(torch.tensor(choice.logprobs), expected, atol=1e-4)


def test_new_weights_empty_the_cache_so_no_prompt_is_continued_from_old_keys(tiny_model_dir, forward_logprobs):
    engine = PolicyEngine.from_pretrained(tiny_model_dir, dtype="float32").start()
    try:
        prompt = _chat(engine, 2)
        params = SamplingParams(max_tokens=6, logprobs=True, **GREEDY)
        engine.generate(prompt, params)
        cache = engine._scheduler.prefix_cache
        assert len(cache) == 1
        changed = {name: value + 0.05 * torch.randn_like(value) for name, value in engine.model.state_dict().items()}
        engine.swap_weights(changed, 1)
        assert len(cache) == 0
        choice = engine.generate(prompt, params).choices[0]
        expected = forward_logprobs(engine.model, prompt, choice.token_ids)
        assert torch.allclose(torch.tensor(choice.logprobs), expected, atol=1e-4)
    finally:
        engine.stop()


def test_a_zero_budget_turns_the_cache_off(tiny_model_dir):
    engine = PolicyEngine.from_pretrained(tiny_model_dir, dtype="float32", prefix_cache_mb=0)
    assert engine._scheduler.prefix_cache is None


def test_choices_and_requests_that_share_a_prompt_share_one_prefill_row(tiny_model_dir, forward_logprobs):
    engine = PolicyEngine.from_pretrained(tiny_model_dir, dtype="float32", prefix_cache_mb=0).start()
    passes: list[tuple[int, ...]] = []
    handle = engine.model.register_forward_pre_hook(
        lambda module, args, kwargs: passes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    try:
        prompt, other = _chat(engine, 1), _chat(engine, 2)
        sampled = SamplingParams(max_tokens=4, n=4, logprobs=True, temperature=1.0, seed=5)
        result = engine.generate(prompt, sampled)
        assert passes[0] == (1, len(prompt))  # four choices, one prefill row
        joiners: list = []

        def two_more(event) -> None:  # on the engine thread: both join at the same next step
            if event.choice == 0 and not joiners:
                joiners.extend(engine.submit(other, SamplingParams(max_tokens=3, logprobs=True, **GREEDY))
                               for _ in range(2))

        passes.clear()
        engine.submit(prompt, SamplingParams(max_tokens=6, **GREEDY), on_token=two_more).wait(60)
        replies = [job.wait(60).choices[0] for job in joiners]
        assert (1, len(other)) in passes and (2, len(other)) not in passes
        assert replies[0].token_ids == replies[1].token_ids
    finally:
        handle.remove()
        engine.stop()
    for asked, choice in [*((prompt, c) for c in result.choices), *((other, r) for r in replies)]:
        expected = forward_logprobs(engine.model, asked, choice.token_ids)
        assert torch.allclose(torch.tensor(choice.logprobs), expected, atol=1e-4)


def _chat_asking(engine, turns: int, question: str) -> list[int]:
    messages = [{"role": "system", "content": "You add numbers and answer with ANSWER n. " * 6}]
    for turn in range(turns):
        messages += [{"role": "user", "content": f"What is {turn} + {turn + 5}?"},
                     {"role": "assistant", "content": f"ANSWER {2 * turn + 5}"}]
    return engine.encode_chat(messages + [{"role": "user", "content": question}])


def _pass(kwargs: dict) -> tuple[tuple[int, ...], bool]:
    """A forward pass's input shape, and whether it was given a cache (the argument's new name
    in transformers, or its old one)."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    return tuple(kwargs["input_ids"].shape), cache is not None


def test_prompts_arriving_together_are_prefilled_after_their_cached_prefixes_in_one_pass(engine, forward_logprobs):
    """Three prompts with cached prefixes of different lengths, and uncached parts of different
    lengths (the longest longer than the shortest prompt, which then has no cached column in the
    pass), join a running batch at one step: one forward pass computes what follows their prefixes,
    and every choice gets a forward pass's log-probs."""
    cache = engine._scheduler.prefix_cache
    engine.generate(_chat_asking(engine, 1, "And 12 + 30?"), SamplingParams(max_tokens=2, **GREEDY))
    engine.generate(_chat_asking(engine, 4, "And 12 + 30?"), SamplingParams(max_tokens=2, **GREEDY))
    prompts = [_chat_asking(engine, 1, "And 1 + 2?"), _chat_asking(engine, 4, "And 7 + 70?"),
               _chat_asking(engine, 12, "And 3 + 4?")]
    passes: list[tuple[tuple[int, ...], bool]] = []
    hits = cache.hits
    results = submit_at_one_step(
        engine, prompts, lambda i: SamplingParams(max_tokens=5, logprobs=True, n=1 + (i == 1), temperature=1.0, seed=i),
        lambda kwargs: passes.append(_pass(kwargs)))
    assert cache.hits == hits + 3
    prefills = [shape for shape, with_cache in passes if with_cache and shape[1] > 1]
    assert len(prefills) == 1 and prefills[0][0] == 3  # one pass, one row per distinct prompt
    uncached = prefills[0][1]
    assert uncached < len(prompts[2]) - MIN_REUSED_TOKENS and uncached > len(prompts[0])
    for prompt, result in zip(prompts, results, strict=True):
        for choice in result.choices:
            expected = forward_logprobs(engine.model, prompt, choice.token_ids)
            assert torch.allclose(torch.tensor(choice.logprobs), expected, atol=1e-4)


def test_uncached_prompts_sharing_a_long_beginning_prefill_it_once(engine, forward_logprobs):
    """A cold cache (as after a weight swap) and three new prompts with the same instructions: a
    one-row pass over their shared whole blocks, kept, then one pass over what follows it."""
    cache = engine._scheduler.prefix_cache
    prompts = [_chat_asking(engine, 2, question) for question in ("And 1 + 2?", "And 30 + 12?", "Sum 5 and 6.")]
    shared = next(i for i, (a, b) in enumerate(zip(prompts[0], prompts[1], strict=False)) if a != b)
    assert shared >= MIN_REUSED_TOKENS + BLOCK
    passes: list[tuple[tuple[int, ...], bool]] = []
    assert len(cache) == 0
    results = submit_at_one_step(
        engine, prompts, lambda i: SamplingParams(max_tokens=5, logprobs=True, temperature=1.0, seed=i),
        lambda kwargs: passes.append(_pass(kwargs)))
    prefills = [(shape, cached) for shape, cached in passes if shape[1] > 1]
    beginning = shared // BLOCK * BLOCK
    assert ((1, beginning), False) in prefills  # the shared blocks, alone
    assert [shape[0] for shape, cached in prefills if cached] == [3]  # then the three prompts, one pass
    assert not any(shape[0] == 3 and not cached for shape, cached in prefills)
    for prompt, result in zip(prompts, results, strict=True):
        expected = forward_logprobs(engine.model, prompt, result.choices[0].token_ids)
        assert torch.allclose(torch.tensor(result.choices[0].logprobs), expected, atol=1e-4)
