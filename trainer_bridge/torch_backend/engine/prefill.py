"""The scheduler's prefill passes: which newcomers go in which pass, and each pass's inputs.

New rows are prefilled in at most two forward passes (``group_by_prefix``): one over the prompts
that start with no cached prefix (``prefix_cache.py``), left-padded, and one over what follows
each cached prefix of the others. The second is what an agent's traffic mostly needs: 16 clients
whose prompts share ~850 tokens of instructions and history, and whose rows end together, send 16
new prompts that each compute ~20 new tokens; one pass for all of them costs about what one pass
for one of them does. Uncached prompts that share a long beginning (a GRPO step's first calls,
after a weight swap emptied the cache) get a one-row pass over it first, which the cache keeps,
and then count among the others. Rows sharing a prompt (a request's ``n`` choices, a GRPO group's
first calls) share one row of either pass (``distinct_prompts``); after the pass
``store_prompts`` keeps every prompt's keys and values for later prompts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import DynamicCache

from spanrl.trainer_bridge.torch_backend.engine.growing_cache import GrowingLayer, spare_columns
from spanrl.trainer_bridge.torch_backend.engine.kv_cache import (
    AttentionMasks,
    cache_is_joinable,
    left_padded_prompts,
    output_cache,
)
from spanrl.trainer_bridge.torch_backend.engine.prefix_cache import BLOCK, MIN_REUSED_TOKENS, PrefixCache, PrefixHit
from spanrl.trainer_bridge.torch_backend.engine.shared_prefix import MIN_SHARED_TOKENS, SharedPrefix, shared_length

# a prefill group: its rows, and (for the pass after cached prefixes) each request's hit by id(request)
PrefillGroup = tuple[list, dict[int, PrefixHit] | None]


def group_by_prefix(rows: list, cache: PrefixCache | None,
                    keep_beginning: Callable[[list[int], Any], bool] | None = None) -> list[PrefillGroup]:
    """The prefill passes for ``rows`` (a request's choices are contiguous, from choice 0): the
    requests whose prompt starts with no stored prefix, then those whose prompt does. When the
    former share a long beginning (a GRPO step's first calls after a weight swap emptied the
    cache: every task's prompt starts with the same instructions), ``keep_beginning(tokens,
    adapter)`` prefills it once and stores it, and they join the latter."""
    if cache is None:
        return [(rows, None)]
    plain, after_prefix, hits = _look_up(rows, cache)
    beginning = shared_beginning(plain)
    if beginning is not None and keep_beginning is not None and keep_beginning(beginning,
                                                                                plain[0].request.params.adapter):
        plain, now_cached, more_hits = _look_up(plain, cache)
        after_prefix, hits = after_prefix + now_cached, {**hits, **more_hits}
    groups: list[PrefillGroup] = [(plain, None)] if plain else []
    return groups + ([(after_prefix, hits)] if after_prefix else [])


def _look_up(rows: list, cache: PrefixCache) -> tuple[list, list, dict[int, PrefixHit]]:
    """``rows`` whose requests' prompts start with no stored prefix, those whose prompts do, and
    the latter's hits by id(request)."""
    plain: list = []
    after_prefix: list = []
    hits: dict[int, PrefixHit] = {}
    for row in rows:
        if row.choice != 0:
            continue
        request_rows = [r for r in rows if r.request is row.request]
        hit = cache.longest(row.request.prompt_ids, row.request.params.adapter)
        if hit is None:
            plain.extend(request_rows)
        else:
            after_prefix.extend(request_rows)
            hits[id(row.request)] = hit
    return plain, after_prefix, hits


def shared_beginning(rows: list) -> list[int] | None:
    """The whole blocks that at least two distinct prompts of ``rows`` (one adapter) all start
    with, short of each prompt's end, when they are enough to be reused; else None."""
    distinct, _ = distinct_prompts(rows)
    if len(distinct) < 2:
        return None
    length = min(shared_length(distinct), min(len(row.request.prompt_ids) for row in distinct) - 1)
    length = length // BLOCK * BLOCK
    return distinct[0].request.prompt_ids[:length] if length >= MIN_REUSED_TOKENS else None


def prefill_and_keep(model: Any, cache: PrefixCache, tokens: list[int], adapter: object, device: torch.device) -> bool:
    """Prefill ``tokens`` alone (the model routed to ``adapter`` already) and keep their keys and
    values in ``cache``; False when the model's cache cannot be kept (sliding-window layers)."""
    output = model(input_ids=torch.tensor([tokens], dtype=torch.long, device=device), use_cache=True, logits_to_keep=1)
    kept = output_cache(output)
    if not cache_is_joinable(kept):
        return False
    cache.store(tokens, adapter, [(layer.keys, layer.values) for layer in kept.layers])
    return True


def distinct_prompts(rows: list) -> tuple[list, list[int]]:
    """One row per distinct (adapter, prompt) of ``rows``, and for each row the index of its
    representative: a request's choices, and the requests of a GRPO group arriving together,
    share one prefill row (its keys, values and logits are then copied to the others)."""
    representatives: list = []
    seen: dict[tuple[object, tuple[int, ...]], int] = {}
    index = []
    for row in rows:
        key = (row.request.params.adapter, tuple(row.request.prompt_ids))
        if key not in seen:
            seen[key] = len(representatives)
            representatives.append(row)
        index.append(seen[key])
    return representatives, index


def prefill_inputs(prompts: list[list[int]], hits: list[PrefixHit] | None, pad_id: int, masks: AttentionMasks,
                   device: torch.device, shared: int = 0,
                   cache_argument: str = "past_key_values") -> tuple[dict, torch.Tensor]:
    """The model's inputs for a prefill pass, and the pass's attention ``[rows, columns]``:
    ``prompts`` left-padded, or (with ``hits``, one a prompt) what follows their cached prefixes;
    ``shared``: how many tokens all the prompts start with, when the model's attention can read
    them once (``shared_prefix.py``), else 0; ``cache_argument``: the model's name for its cache
    (``kv_cache.cache_keyword``)."""
    if hits is None:
        input_ids, attention, positions = left_padded_prompts(prompts, pad_id, device)
        plain: dict[str, Any] = {"input_ids": input_ids, "attention_mask": masks.prefill(attention),
                                 "position_ids": positions}
        return plain, attention
    return inputs_after_prefixes(prompts, hits, pad_id, masks, device, shared, cache_argument)


def inputs_after_prefixes(prompts: list[list[int]], hits: list[PrefixHit], pad_id: int, masks: AttentionMasks,
                          device: torch.device, shared: int = 0,
                          cache_argument: str = "past_key_values") -> tuple[dict, torch.Tensor]:
    """One pass over the tokens that follow each prompt's cached prefix. The prompts are
    left-padded as in a plain pass; the pass computes the last ``new`` columns, as many as the
    longest uncached part, and a cache of the columns before them holds the cached keys and
    values (each row's first ``length - new`` tokens, no more than its prefix). A row whose
    uncached part is shorter recomputes a few of its cached tokens, which gives the same keys."""
    lengths = [len(prompt) for prompt in prompts]
    width = max(lengths)
    new = max(length - hit.length for length, hit in zip(lengths, hits, strict=True))
    past = width - new
    input_ids = torch.full((len(prompts), new), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    cached = [max(0, length - new) for length in lengths]
    for i, prompt in enumerate(prompts):
        attention[i, width - lengths[i]:] = 1
        fresh = prompt[cached[i]:]
        input_ids[i, new - len(fresh):] = torch.tensor(fresh, dtype=torch.long)
    attention = attention.to(device)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)[:, past:]
    cache = DynamicCache()
    for layer in range(len(hits[0].layers)):
        rows = [(hit.layers[layer][0][:, :, :tokens], hit.layers[layer][1][:, :, :tokens])
                for hit, tokens in zip(hits, cached, strict=True)]
        cache.layers.append(GrowingLayer.left_padded(rows, past, new + spare_columns(width)))
    inputs: dict[str, Any] = {"input_ids": input_ids.to(device), "position_ids": positions, cache_argument: cache,
                              "attention_mask": masks.prefill(attention, new)}
    split = min(shared, *cached)  # the shared tokens every row has before the pass's first query
    if split >= MIN_SHARED_TOKENS and len(prompts) > 1:
        inputs["shared_prefix"] = SharedPrefix.for_step(split, attention, new)
    return inputs, attention


def store_prompts(cache: PrefixCache | None, batch) -> None:
    """Keep each request's prompt keys and values from a prefill pass's batch (left-padded:
    a prompt is the last columns of its row)."""
    if cache is None or not batch.joinable:
        return
    width = batch.attention.shape[1]
    for index, row in enumerate(batch.rows):
        if row.choice != 0:
            continue
        start = width - len(row.request.prompt_ids)
        layers = [(layer.keys[index:index + 1, :, start:], layer.values[index:index + 1, :, start:])
                  for layer in batch.cache.layers]
        cache.store(row.request.prompt_ids, row.request.params.adapter, layers)
