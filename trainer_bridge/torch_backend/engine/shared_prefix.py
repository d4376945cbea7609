"""Attention that reads a prompt beginning shared by every row of a batch once, not once per row.

An agent's rows share long prompt beginnings (instructions, tool schemas, a GRPO group's task). The
running batch keeps each row's keys and values whole (``kv_cache.py``), so a decode step's
attention reads the shared beginning once per row from memory: 16 rows over ~900 columns, ~850 of
them shared, spend most of a step there (sdpa, ~3.5 ms a layer of a ~21 ms step, preset ``small``).
vLLM's paged cache shares those blocks, which then stay in the CPU's caches.

When every row's prompt starts with the same ``length`` tokens (same adapter; ``SharedPrefix``),
a decode step, or a prefill pass over the tokens after cached ones (``prefill.py``), splits each
row's attention in two: over the shared keys, taken once from one row
(a view) for all the rows' queries together, and over each row's columns after its shared part;
the two are combined as flash attention combines blocks (each part's sums rescaled to the larger
of their largest scores). The result
equals attention over all the columns (1e-6). Rows are left-padded, so row ``i``'s shared part is
its columns ``[first_i, first_i + length)``; the second part covers the columns from the smallest
``first_i + length`` on, each row masking the shared columns it has there.

``use_shared_prefix_attention`` registers the function with transformers' attention interface
under its own name (``ATTENTION``), for a model that uses sdpa; it calls sdpa whenever the model
call passes no ``shared_prefix`` (prefill passes, training, any other caller).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

ATTENTION = "spanrl_shared_prefix"
MIN_SHARED_TOKENS = 64  # below this the split's own fixed cost outweighs what it saves


@dataclass(frozen=True)
class SharedPrefix:
    """A forward pass's shared prompt beginning: ``length`` tokens from row 0's column
    ``first_of_row_0`` (each row's first real column), before every query of the pass; the second
    part's columns start at ``start``, where ``rest_mask`` (``[rows, 1, queries, columns - start]``,
    True: attend) leaves each query its own row's columns it may see."""

    length: int
    first_of_row_0: int
    start: int
    rest_mask: torch.Tensor

    @classmethod
    def for_step(cls, length: int, attention: torch.Tensor, queries: int = 1) -> SharedPrefix:
        """The split of a pass whose queries are the last ``queries`` columns of rows left-padded
        in ``attention`` ``[rows, columns]`` (1 = real): a decode step's one, or a prefill pass's
        tokens after cached ones (causal among them; a padding query may see every column, as in
        ``AttentionMasks.prefill``). ``length`` must end before the first query's column."""
        columns = attention.shape[1]
        real = attention.bool()
        first = columns - attention.sum(dim=1)
        start = int(first.min()) + length
        column = torch.arange(start, columns, device=attention.device)
        own = (column.unsqueeze(0) >= (first + length).unsqueeze(1)) & real[:, start:]  # [rows, rest]
        query_column = torch.arange(columns - queries, columns, device=attention.device)
        causal = column.unsqueeze(0) <= query_column.unsqueeze(1)  # [queries, rest]
        padding_query = ~real[:, columns - queries:]  # [rows, queries]
        allowed = (own.unsqueeze(1) & causal.unsqueeze(0)) | padding_query.unsqueeze(2)
        return cls(length, int(first[0]), start, allowed.unsqueeze(1))


def shared_length(rows: list) -> int:
    """How many prompt tokens every row's request starts with (0 under ``MIN_SHARED_TOKENS``, or
    when the rows' adapters differ: their keys differ)."""
    first = rows[0].request
    length = len(first.prompt_ids)
    for row in rows[1:]:
        request = row.request
        if request is first:
            continue
        if request.params.adapter != first.params.adapter:
            return 0
        length = common_prefix_length(first.prompt_ids, request.prompt_ids, length)
        if length < MIN_SHARED_TOKENS:
            return 0
    return length if length >= MIN_SHARED_TOKENS else 0


def common_prefix_length(a: list[int], b: list[int], limit: int) -> int:
    """The number of leading tokens ``a`` and ``b`` share, at most ``limit``."""
    limit = min(limit, len(a), len(b))
    if a[:limit] == b[:limit]:
        return limit
    low, high = 0, limit  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle
    return low


def shared_prefix_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None,
                            shared_prefix: SharedPrefix | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention function: sdpa, or the split over ``shared_prefix``. Returns
    ``[rows, queries, heads, head_dim]`` as sdpa's does."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if shared_prefix is None or kwargs.get("sliding_window") is not None:  # a window: its mask says which keys
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    rows, query_heads, queries, head_dim = query.shape
    kv_heads = key.shape[1]
    groups = query_heads // kv_heads
    scale = head_dim**-0.5 if scaling is None else scaling
    grouped = query.reshape(rows, kv_heads, groups * queries, head_dim)  # a head's groups, then its queries
    shared = _over_shared(grouped, key, value, shared_prefix, scale)
    rest = _over_rest(grouped, key, value, shared_prefix, scale, groups)
    top = torch.maximum(shared.top, rest.top)
    shared_weight, rest_weight = torch.exp(shared.top - top), torch.exp(rest.top - top)
    combined = (shared.weighted * shared_weight.unsqueeze(-1) + rest.weighted * rest_weight.unsqueeze(-1)) / (
        shared.total * shared_weight + rest.total * rest_weight).unsqueeze(-1)
    return combined.reshape(rows, query_heads, queries, head_dim).transpose(1, 2).to(query.dtype), None


@dataclass(frozen=True)
class PartialAttention:
    """One part of a query's attention, not normalised: ``weighted`` = sum of exp(score - top) x
    value, ``total`` = sum of exp(score - top), ``top`` the part's largest score (a part's softmax
    output is weighted / total; two parts combine by rescaling both to the larger top)."""

    weighted: torch.Tensor
    total: torch.Tensor
    top: torch.Tensor


def _partial(scores: torch.Tensor, values: torch.Tensor) -> PartialAttention:
    top = scores.amax(dim=-1)
    weights = torch.exp(scores - top.unsqueeze(-1))
    return PartialAttention(torch.matmul(weights.to(values.dtype), values).float(), weights.sum(dim=-1), top)


def _over_shared(grouped: torch.Tensor, key: torch.Tensor, value: torch.Tensor, shared: SharedPrefix,
                 scale: float) -> PartialAttention:
    """Every row's queries against the shared keys of row 0 (one matrix product a head), as
    ``[rows, kv_heads, queries, ...]``."""
    rows, kv_heads, queries, head_dim = grouped.shape
    first = shared.first_of_row_0
    keys = key[0, :, first:first + shared.length]  # [kv_heads, length, head_dim], a view
    values = value[0, :, first:first + shared.length]
    flat = grouped.permute(1, 0, 2, 3).reshape(kv_heads, rows * queries, head_dim)
    part = _partial(torch.matmul(flat, keys.transpose(1, 2)).float() * scale, values)
    back = (kv_heads, rows, queries)
    return PartialAttention(part.weighted.reshape(*back, head_dim).permute(1, 0, 2, 3),
                            part.total.reshape(back).permute(1, 0, 2), part.top.reshape(back).permute(1, 0, 2))


def _over_rest(grouped: torch.Tensor, key: torch.Tensor, value: torch.Tensor, shared: SharedPrefix,
               scale: float, groups: int) -> PartialAttention:
    """Each row's queries against its own columns after the shared part (a query's own column
    among them, so no query's set is empty)."""
    keys, values = key[:, :, shared.start:], value[:, :, shared.start:]  # [rows, kv_heads, rest, head_dim]
    scores = torch.matmul(grouped, keys.transpose(2, 3)).float() * scale  # [rows, kv_heads, queries, rest]
    mask = shared.rest_mask if groups == 1 else shared.rest_mask.repeat(1, 1, groups, 1)
    return _partial(scores.masked_fill(~mask, float("-inf")), values)


def use_shared_prefix_attention(model: Any) -> bool:
    """Register ``shared_prefix_attention`` and switch ``model`` to it when the model runs sdpa
    through transformers' attention interface; False (the model left as it was) otherwise."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask

        AttentionInterface.register(ATTENTION, shared_prefix_attention)
        AttentionMaskInterface.register(ATTENTION, sdpa_mask)
        model.set_attn_implementation(ATTENTION)
    except Exception:  # an older or different transformers: plain sdpa is as correct
        logger.warning("shared-prefix attention is unavailable; the engine uses sdpa", exc_info=True)
        return False
    return getattr(model.config, "_attn_implementation", None) == ATTENTION
