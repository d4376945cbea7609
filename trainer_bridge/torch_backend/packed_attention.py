"""Attention over packed sequences, so the torch trainer's forward pass has no padding.

The trainer lays a micro-batch's sequences end to end in one row (``[1, N]``, positions
restarting at 0 for each sequence): every linear layer, norm and activation then runs on real
tokens only. Attention is the one layer that must not look across sequences. This module
registers an attention function with transformers' ``AttentionInterface`` that, given a
``PackedLayout``, copies each sequence's queries, keys and values into length buckets (sequences
of similar length, right-padded to the bucket's longest), runs torch's SDPA with ``is_causal``
on each bucket and copies the results back in packed order. Right padding needs no mask: under
a causal mask a real token never sees the padding after it, and the padding's own outputs are
never copied back, so they get no gradient.

A row is a list of packed positions, so sequences that begin alike can share their beginning:
the shared tokens are packed once and their positions appear in every row that reads them
(``batching.pack_batch``). Only the first row that reads a token computes its output; a later
row's queries are its own tail alone, attending over the shared beginning as keys (a mask per
row: query ``i`` sees keys up to ``shared + i``). The shared tokens' keys and values get the
gradients of every row that reads them, as if each sequence had been run on its own, and a
group's prompt costs its attention once instead of once per member (an SFT batch of retrieval
demonstrations, a ~250-token instructions prompt in ~400: attention's time about halved).

This is what verl does with flash-attention's variable-length kernels on GPU; torch has no such
kernel on CPU, and the buckets keep SDPA's fast path (no mask tensor). A pass without a layout
is SDPA's as before. ``TorchTrainer`` switches its model to this attention and checks once that
it gives the same logprobs packed as padded (``batching.enable_packing``); a model whose
attention takes other inputs (a sliding window, logit soft-capping, attention sinks) raises
here, or a model that is not on SDPA is not switched, and either is trained padded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

PACKED_ATTENTION = "spanrl_packed"
# A bucket closes when its next sequence would be this much longer than its shortest: attention
# (quadratic in width) then does at most 2.25x a sequence's own work, and buckets stay few.
BUCKET_GROWTH = 1.5
# Given as a packed pass's attention mask: transformers takes a 4D mask as ready and builds none
# (it would build an N x N one from the packed positions), and the packed attention ignores it.
PACKED_MASK = torch.ones((1, 1, 1, 1), dtype=torch.bool)


@dataclass
class AttentionBucket:
    """Rows of similar lengths, as SDPA takes them.

    ``keys [rows, key_width]``: the packed positions each row reads, in order, right-padded with
    its first. ``queries [rows, query_width]``: the positions whose outputs the row computes, its
    tail after the beginning an earlier row already computed, right-padded likewise. ``mask
    [rows, 1, query_width, key_width]``: query ``i`` of a row that shares its first ``s`` positions
    sees keys ``0 .. s + i``; ``None`` when no row of the bucket shares (queries are keys: SDPA's
    causal path, with no mask tensor).
    """

    keys: torch.Tensor
    queries: torch.Tensor
    mask: torch.Tensor | None


@dataclass
class PackedLayout:
    """Where each packed sequence's tokens go for attention: its ``buckets``, and ``unpack_index``
    ``[N]``: for each packed token, its place in the buckets' outputs laid end to end (``rows *
    query_width`` each)."""

    buckets: list[AttentionBucket]
    unpack_index: torch.Tensor


def row_layout(rows: Sequence[Sequence[int]], token_count: int, device: torch.device | str = "cpu") -> PackedLayout:
    """The attention layout of ``rows``, each the packed positions one sequence reads, in order.

    Rows may share positions, but only as a common beginning (a token holds the same place in
    every row that reads it, after the same tokens), so the row that computes a token's output
    gives the one every other row would. Each token is computed by the first row (in the order
    given) that reads it; a later row computes only its own tail, with the shared beginning as
    keys alone. Every one of the ``token_count`` positions must be in some row.
    """
    shared = shared_beginnings(rows, token_count)
    tails = [torch.as_tensor(row[s:], dtype=torch.long) for row, s in zip(rows, shared, strict=True)]
    buckets, owner_slot = _buckets(rows, shared, tails, token_count, device)
    if bool((owner_slot < 0).any()):
        raise ValueError(f"{int((owner_slot < 0).sum())} of {token_count} packed tokens are in no row")
    return PackedLayout(buckets, owner_slot.to(device))


def query_layout(rows: Sequence[Sequence[int]], spans: Sequence[tuple[int, int]],
                 device: torch.device | str = "cpu") -> tuple[PackedLayout, torch.Tensor]:
    """Attention whose queries are some positions of each row: ``rows[r][start:end]`` for
    ``spans[r] = (start, end)`` (none when ``start == end``), each seeing the row's keys up to
    itself. The queries are numbered in row order: query states come as ``[1, H, Q, D]`` in that
    order, and the layout's ``unpack_index`` gives the outputs in it. Returns the layout and the
    ``[Q]`` packed positions of the queries (``scored_tail``: the last layer on scored positions)."""
    numbers, total = [], 0
    for start, end in spans:
        numbers.append(torch.arange(total, total + end - start))
        total += end - start
    buckets, slot_of = _buckets([row[:end] for row, (_, end) in zip(rows, spans, strict=True)],
                                [start for start, _ in spans], numbers, total, device)
    positions = [p for row, (start, end) in zip(rows, spans, strict=True) for p in row[start:end]]
    return PackedLayout(buckets, slot_of.to(device)), torch.tensor(positions, dtype=torch.long, device=device)


def _buckets(rows: Sequence[Sequence[int]], shared: Sequence[int], query_numbers: Sequence[torch.Tensor],
             query_count: int, device: torch.device | str) -> tuple[list[AttentionBucket], torch.Tensor]:
    """The buckets of ``rows`` on ``device`` (row ``r``'s queries: its positions after its first
    ``shared[r]``, their states at ``query_numbers[r]``), and, on the CPU, for each of the
    ``query_count`` queries its slot in the buckets' outputs (-1 for a number no row has)."""
    slot_of = torch.full((query_count,), -1, dtype=torch.long)
    buckets: list[AttentionBucket] = []
    offset = 0
    for group in _similar_rows([len(row) - s for row, s in zip(rows, shared, strict=True)],
                               [len(row) for row in rows]):
        bucket = _bucket([rows[i] for i in group], [shared[i] for i in group], [query_numbers[i] for i in group])
        query_rows, query_width = bucket.queries.shape
        for slot_row, index in enumerate(group):
            numbers = query_numbers[index]
            slot_of[numbers] = torch.arange(len(numbers)) + offset + slot_row * query_width
        offset += query_rows * query_width
        buckets.append(AttentionBucket(bucket.keys.to(device), bucket.queries.to(device),
                                       None if bucket.mask is None else bucket.mask.to(device)))
    return buckets, slot_of


def shared_beginnings(rows: Sequence[Sequence[int]], token_count: int) -> list[int]:
    """For each row, how many of its first positions an earlier row reads (a row shares only a
    beginning: no position after those may be an earlier row's)."""
    seen = bytearray(token_count)
    shared: list[int] = []
    for number, row in enumerate(rows):
        count = 0
        while count < len(row) and seen[row[count]]:
            count += 1
        tail = row[count:]
        if any(seen[position] for position in tail):
            raise ValueError(f"row {number} shares positions after its beginning with an earlier row")
        for position in tail:
            seen[position] = 1
        shared.append(count)
    return shared


def _similar_rows(query_lengths: Sequence[int], key_lengths: Sequence[int]) -> list[list[int]]:
    """Rows (those with a query) in groups whose query lengths, and within them key lengths, are
    each at most ``BUCKET_GROWTH`` times the group's shortest."""

    def split(indices: list[int], lengths: Sequence[int]) -> list[list[int]]:
        groups: list[list[int]] = []
        for index in sorted(indices, key=lambda i: lengths[i]):
            if groups and lengths[index] <= BUCKET_GROWTH * lengths[groups[-1][0]]:
                groups[-1].append(index)
            else:
                groups.append([index])
        return groups

    with_queries = [i for i, length in enumerate(query_lengths) if length > 0]
    return [group for by_query in split(with_queries, query_lengths) for group in split(by_query, key_lengths)]


def _bucket(rows: Sequence[Sequence[int]], shared: Sequence[int],
            query_numbers: Sequence[torch.Tensor]) -> AttentionBucket:
    """One bucket's index tensors and mask (on the CPU), its rows in the order given; a row's
    queries are its positions after its shared beginning, their states at ``query_numbers``."""
    key_width = max(len(row) for row in rows)
    query_width = max(len(row) - s for row, s in zip(rows, shared, strict=True))
    keys = torch.empty((len(rows), key_width), dtype=torch.long)
    queries = torch.empty((len(rows), query_width), dtype=torch.long)
    for slot_row, (row, numbers) in enumerate(zip(rows, query_numbers, strict=True)):
        positions = torch.as_tensor(row, dtype=torch.long)
        keys[slot_row, : len(row)] = positions
        keys[slot_row, len(row):] = positions[0]
        queries[slot_row, : len(numbers)] = numbers
        queries[slot_row, len(numbers):] = numbers[0]
    if not any(shared):
        return AttentionBucket(keys, queries, None)
    seen_up_to = torch.as_tensor(shared, dtype=torch.long)[:, None, None] + torch.arange(query_width)[None, :, None]
    mask = torch.arange(key_width)[None, None, :] <= seen_up_to  # padded queries see every key: no empty row
    return AttentionBucket(keys, queries, mask.unsqueeze(1))


def packed_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, attention_mask: torch.Tensor | None,
                             scaling: float | None = None, dropout: float = 0.0, **kwargs: Any,
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' attention call. With ``spanrl_layout``: one packed row, ``query [1, H, N, D]``,
    ``key`` / ``value [1, H_kv, N, D]`` -> ``([1, N, H, D], None)`` (``attention_mask`` is
    ``PACKED_MASK``, ignored). Without: transformers' own SDPA attention, unchanged."""
    layout: PackedLayout | None = kwargs.pop("spanrl_layout", None)
    kwargs.pop("spanrl_tail", None)  # for the last layer's own forward (scored_tail); passed on by every layer
    if layout is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"packed attention takes one packed row, got {query.shape[0]}")
    for unsupported in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(unsupported) is not None:
            raise ValueError(f"packed attention does not support {unsupported}")
    grouped = query.shape[1] != key.shape[1]
    outputs = []
    for bucket in layout.buckets:
        rows, width = bucket.queries.shape
        out = torch.nn.functional.scaled_dot_product_attention(
            _take(query, bucket.queries), _take(key, bucket.keys), _take(value, bucket.keys),
            attn_mask=bucket.mask, dropout_p=dropout, is_causal=bucket.mask is None, scale=scaling,
            enable_gqa=grouped)
        outputs.append(out.transpose(1, 2).reshape(rows * width, out.shape[1], out.shape[3]))
    merged = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
    return merged.index_select(0, layout.unpack_index).unsqueeze(0), None


def _take(states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``states [1, H, N, D]`` at ``positions [rows, width]`` -> ``[rows, H, width, D]``."""
    rows, width = positions.shape
    return states[0].index_select(1, positions.reshape(-1)).unflatten(1, (rows, width)).transpose(0, 1)


@cache
def _register() -> None:
    # imported on first use: transformers is slow to import
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
    AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)  # unpacked passes: SDPA's own masks


def use_packed_attention(model: Any) -> bool:
    """Give ``model`` (its config, shared by a PEFT wrapper) the packed attention, which is SDPA's
    for any pass without a layout. Only a model on SDPA is switched; ``False`` otherwise.

    Switched for good rather than per pass: gradient checkpointing runs the forward again inside
    ``backward()``, and it must take the same attention then.
    """
    config = model.config
    if config._attn_implementation == PACKED_ATTENTION:
        return True
    if config._attn_implementation != "sdpa":
        return False
    _register()
    config._attn_implementation = PACKED_ATTENTION
    return True


def use_sdpa_attention(model: Any) -> None:
    """Undo ``use_packed_attention``."""
    if model.config._attn_implementation == PACKED_ATTENTION:
        model.config._attn_implementation = "sdpa"
