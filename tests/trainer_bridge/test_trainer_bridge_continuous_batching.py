"""Continuous batching in the policy engine: rows join a running batch and leave it one by one.

Requests are injected from another request's ``on_token`` callback, which runs on the engine
thread between two decode steps: so "B arrives while A is at its 4th token" is exact, not a
matter of timing. Every check compares with a request decoded alone or with a forward pass.
"""

from __future__ import annotations

import random

import pytest
import torch

from spanrl.trainer_bridge.torch_backend.engine.policy_engine import SamplingParams
from spanrl.trainer_bridge.torch_backend.server.chat_format import render_chatml

GREEDY = dict(temperature=0.0)


def long_greedy_prompt(engine, tokens: int) -> list[int]:
    """A prompt whose greedy answer alone runs the full ``tokens`` (no early end of sequence)."""
    for number in range(40):
        prompt = engine.encode_chat([{"role": "user", "content": f"What is {number} + {number % 9}?"}])
        if len(engine.generate(prompt, SamplingParams(max_tokens=tokens, **GREEDY)).choices[0].token_ids) == tokens:
            return prompt
    raise AssertionError("no prompt ran to max_tokens")


def submit_at(engine, after_tokens: int, joiners: list):
    """An ``on_token`` callback that submits each (prompt, params) of ``joiners`` once the
    request it watches has ``after_tokens`` tokens; the submitted jobs are appended to ``joiners``."""
    pending = list(joiners)
    joiners.clear()
    seen = [0]

    def on_token(_event) -> None:
        seen[0] += 1
        if seen[0] == after_tokens:
            joiners.extend(engine.submit(prompt, params) for prompt, params in pending)

    return on_token


def test_a_request_admitted_mid_batch_gets_the_same_greedy_output_as_alone(engine, forward_logprobs):
    prompt_a = long_greedy_prompt(engine, 30)
    prompt_b = engine.encode_chat([{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "What is 7 + 5?"}])
    params_a = SamplingParams(max_tokens=30, logprobs=True, **GREEDY)
    params_b = SamplingParams(max_tokens=6, logprobs=True, **GREEDY)
    alone_a = engine.generate(prompt_a, params_a).choices[0]
    alone_b = engine.generate(prompt_b, params_b).choices[0]

    before = (engine.stats.batches, engine.stats.forward_passes)
    joiners = [(prompt_b, params_b)]
    job_a = engine.submit(prompt_a, params_a, on_token=submit_at(engine, 4, joiners))
    together_a = job_a.wait(60).choices[0]
    together_b = joiners[0].wait(60).choices[0]

    assert together_a.token_ids == alone_a.token_ids
    assert together_b.token_ids == alone_b.token_ids
    # B joined A's batch: its own prefill pass, then decoded in A's steps (no extra passes)
    assert engine.stats.batches - before[0] == 2
    assert engine.stats.forward_passes - before[1] == len(alone_a.token_ids) + 1
    assert engine.stats.max_rows_in_batch >= 2
    for prompt, choice in ((prompt_a, together_a), (prompt_b, together_b)):
        expected = forward_logprobs(engine.model, prompt, choice.token_ids)
        assert torch.allclose(torch.tensor(choice.logprobs), expected, atol=1e-4)


def test_rows_joining_at_different_steps_keep_logprobs_equal_to_a_forward_pass(engine, forward_logprobs):
    prompt_a = long_greedy_prompt(engine, 24)
    rng = random.Random(3)
    texts = ["Hi", "What is 12 + 7? Use CALC first.", "RESULT 19", "x " * 30, "ANSWER 4"]
    early = [(engine.encode_text(rng.choice(texts)), SamplingParams(max_tokens=rng.randint(3, 12), n=2,
                                                                   logprobs=True, top_logprobs=2))
             for _ in range(3)]
    late = [(engine.encode_chat([{"role": "user", "content": text}]),
             SamplingParams(max_tokens=10, logprobs=True, seed=5, temperature=0.8, top_k=20))
            for text in texts]
    late_jobs: list = list(late)
    early_jobs: list = list(early)
    watch_late = submit_at(engine, 9, late_jobs)
    watch_early = submit_at(engine, 2, early_jobs)

    def on_token(event) -> None:
        watch_early(event)
        watch_late(event)

    job_a = engine.submit(prompt_a, SamplingParams(max_tokens=24, logprobs=True, **GREEDY), on_token=on_token)
    results = [(job_a.prompt_ids, job_a.wait(60))]
    results += [(job.prompt_ids, job.wait(60)) for job in early_jobs + late_jobs]
    assert engine.stats.max_rows_in_batch >= 6
    for prompt, result in results:
        for choice in result.choices:
            expected = forward_logprobs(engine.model, prompt, choice.token_ids)
            assert torch.allclose(torch.tensor(choice.logprobs), expected, atol=1e-4), (prompt, choice)
            if choice.top_logprobs:
                assert all(len(top) == 2 for top in choice.top_logprobs)
    # a seeded request draws the same tokens inside a batch as alone
    for (prompt, params), job in zip(late, late_jobs, strict=True):
        alone = engine.generate(prompt, params).choices[0].token_ids
        assert job.result.choices[0].token_ids == alone


def test_a_cancelled_row_leaves_the_batch_and_the_others_are_unchanged(engine):
    prompt_a = long_greedy_prompt(engine, 20)
    params_a = SamplingParams(max_tokens=20, **GREEDY)
    alone = engine.generate(prompt_a, params_a).choices[0].token_ids
    joiners = [(engine.encode_text("CALC 12+"), SamplingParams(max_tokens=50, **GREEDY))]
    watch = submit_at(engine, 2, joiners)
    seen = [0]

    def on_token(event) -> None:
        watch(event)
        seen[0] += 1
        if seen[0] == 5:
            joiners[0].cancel()

    job_a = engine.submit(prompt_a, params_a, on_token=on_token)
    assert job_a.wait(60).choices[0].token_ids == alone
    cancelled = joiners[0].wait(60).choices[0]
    assert cancelled.finish_reason == "stop" and len(cancelled.token_ids) < 50


def test_newcomers_gather_before_joining_a_big_batch_unless_they_waited_long_enough(engine):
    prompt = long_greedy_prompt(engine, 20)
    params = SamplingParams(max_tokens=20, **GREEDY)
    newcomer = (engine.encode_text("hello"), SamplingParams(max_tokens=3, **GREEDY))

    def run(batch_wait_s: float) -> int:
        """7 rows decode together, one newcomer arrives at their 3rd token: most rows decoded together."""
        engine.batch_wait_s = batch_wait_s
        engine.stats.max_rows_in_batch = 0
        jobs: list = []
        seen = [0]

        def on_token(_event) -> None:
            seen[0] += 1
            if seen[0] == 1:
                jobs.extend(engine.submit(prompt, params) for _ in range(6))
            if seen[0] == 3:
                jobs.append(engine.submit(*newcomer))

        first = engine.submit(prompt, params, on_token=on_token)
        for job in [first, *jobs]:
            job.wait(60)
        return engine.stats.max_rows_in_batch

    # one newcomer is less than a quarter of 7 running rows: allowed to wait, it waits for
    # more newcomers (none come) and runs after the batch
    assert run(batch_wait_s=3600.0) == 7
    # once it has waited batch_wait_s it joins: 8 rows decode together
    assert run(batch_wait_s=0.0) == 8


def test_chatml_fast_path_equals_the_chat_template(engine):
    from spanrl.trainer_bridge.torch_backend.model_init import CHAT_TEMPLATE

    # `spanrl model init` wrote the template this path replaces
    assert engine.tokenizer.chat_template == CHAT_TEMPLATE
    rng = random.Random(0)
    pieces = ["", " ", "\n", "What is 37 + 45?", "CALC 12*3", "RESULT 36", "ANSWER 7", "  two  spaces ",
              "<|im_start|>", "<|im_end|>", "{{ not jinja }}", "{% raw %}", "ünïcödé ✓ 数字", "\t\r\n", "'\"\\"]
    roles = ["system", "user", "assistant", "tool", "developer", "x y"]
    for _ in range(300):
        messages = [{"role": rng.choice(roles),
                     "content": "".join(rng.choice(pieces) for _ in range(rng.randint(0, 4)))}
                    for _ in range(rng.randint(1, 6))]
        if rng.random() < 0.2:
            messages[0]["name"] = "extra keys are ignored"
        expected = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert render_chatml(messages) == expected, messages
        assert engine.encode_chat(messages) == list(engine.tokenizer.encode(expected, add_special_tokens=False))
    # content parts and empty chats are not the fast path's: the template renders or rejects them
    assert render_chatml([]) is None
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert render_chatml(parts) is None
    expected = engine.tokenizer.apply_chat_template(parts, add_generation_prompt=True, tokenize=False)
    assert engine.encode_chat(parts) == list(engine.tokenizer.encode(expected, add_special_tokens=False))


def test_sampling_draws_each_token_with_its_probability_and_never_a_truncated_one():
    from spanrl.trainer_bridge.torch_backend.engine.sampling import draw as _draw

    probs = torch.tensor([[0.0, 0.1, 0.0, 0.6, 0.3, 0.0], [0.25, 0.25, 0.25, 0.25, 0.0, 0.0]])
    generator = torch.Generator().manual_seed(0)
    draws = torch.stack([_draw(probs, generator) for _ in range(20000)])  # [draws, rows]
    for row in range(2):
        frequency = torch.bincount(draws[:, row], minlength=6).float() / len(draws)
        assert torch.allclose(frequency, probs[row], atol=0.015), (row, frequency)
        assert frequency[probs[row] == 0].sum() == 0
    again = torch.Generator().manual_seed(0)
    assert torch.equal(torch.stack([_draw(probs, again) for _ in range(100)]), draws[:100])  # seeded: reproducible


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_the_engines_own_attention_masks_equal_the_models_own(tiny_model_dir, forward_logprobs, attention):
    """Prompts of different lengths share a left-padded prefill and decode steps; the masks the
    engine builds (boolean for sdpa, additive for eager) give what transformers' masks give."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from spanrl.trainer_bridge.torch_backend.engine.policy_engine import PolicyEngine

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=attention)
    engine = PolicyEngine(model, AutoTokenizer.from_pretrained(tiny_model_dir)).start()
    try:
        prompts = [engine.encode_text(text) for text in ("Hi", "What is 12 + 7? Use CALC first.", "x " * 25)]
        params = SamplingParams(max_tokens=8, logprobs=True, **GREEDY)

        def run_together():
            jobs = [engine.submit(prompt, params) for prompt in prompts]
            return [job.wait(60).choices[0] for job in jobs]

        assert engine.own_masks
        ours = run_together()
        engine.own_masks = False  # transformers builds the masks from the 2D attention mask
        theirs = run_together()
    finally:
        engine.stop()
    assert engine.stats.max_rows_in_batch == 3
    for prompt, mine, reference in zip(prompts, ours, theirs, strict=True):
        assert mine.token_ids == reference.token_ids
        assert torch.allclose(torch.tensor(mine.logprobs), torch.tensor(reference.logprobs), atol=1e-5)
        expected = forward_logprobs(model, prompt, mine.token_ids)
        assert torch.allclose(torch.tensor(mine.logprobs), expected, atol=1e-4)


def test_a_prefill_without_padding_leaves_the_causal_mask_to_the_model(tiny_model_dir):
    """Prompts of one length need no mask (sdpa's causal kernel then never holds the scores);
    left padding does."""
    from transformers import AutoModelForCausalLM

    from spanrl.trainer_bridge.torch_backend.engine.kv_cache import AttentionMasks, left_padded_prompts

    masks = AttentionMasks(AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa"))
    _, same_length, _ = left_padded_prompts([[5, 6, 7], [8, 9, 10]], 0, torch.device("cpu"))
    assert masks.prefill(same_length) is None
    _, padded, _ = left_padded_prompts([[5, 6, 7], [8]], 0, torch.device("cpu"))
    mask = masks.prefill(padded)
    assert mask is not None and mask.shape == (2, 1, 3, 3)
    assert not mask[1, 0, 2, 0] and mask[1, 0, 2, 2] and mask[0, 0, 2, 0]
