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
(``batching.pack_batch``). Each token's output is taken from one row that holds it; the other
rows' outputs for it are dropped, so its keys and values get the gradients of every row that
reads them, as if each sequence had been run on its own.

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
class PackedLayout:
    """Where each packed sequence's tokens go for attention.

    ``buckets``: one ``[rows, width]`` tensor per bucket, each row the packed positions one
    sequence reads, in order, right-padded with its first position. ``unpack_index`` ``[N]``: for
    each packed token, its row in the buckets' outputs laid end to end (``rows * width`` each).
    """

    buckets: list[torch.Tensor]
    unpack_index: torch.Tensor


def row_layout(rows: Sequence[Sequence[int]], token_count: int, device: torch.device | str = "cpu") -> PackedLayout:
    """The attention layout of ``rows``, each the packed positions one sequence reads, in order.

    Rows may share positions, but only as a common beginning (a token holds the same place in
    every row that reads it, after the same tokens), so any row that holds a token gives the same
    output for it. Every one of the ``token_count`` positions must be in some nonempty row.
    """
    lengths = [len(row) for row in rows]
    order = sorted(range(len(rows)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    for index in order:
        if groups and lengths[index] <= BUCKET_GROWTH * lengths[groups[-1][0]]:
            groups[-1].append(index)
        else:
            groups.append([index])
    row_tensors = [torch.as_tensor(row, dtype=torch.long) for row in rows]
    owner_slot = torch.full((token_count,), -1, dtype=torch.long)
    buckets: list[torch.Tensor] = []
    offset = 0
    for group in groups:
        width = max(lengths[i] for i in group)
        bucket = torch.empty((len(group), width), dtype=torch.long)
        for slot_row, index in enumerate(group):
            positions, length = row_tensors[index], lengths[index]
            bucket[slot_row, :length] = positions
            bucket[slot_row, length:] = positions[0]
            free = owner_slot[positions] < 0
            owner_slot[positions[free]] = torch.arange(length)[free] + offset + slot_row * width
        buckets.append(bucket.to(device))
        offset += len(group) * width
    if bool((owner_slot < 0).any()):
        raise ValueError(f"{int((owner_slot < 0).sum())} of {token_count} packed tokens are in no row")
    return PackedLayout(buckets, owner_slot.to(device))


def packed_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, attention_mask: torch.Tensor | None,
                             scaling: float | None = None, dropout: float = 0.0, **kwargs: Any,
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' attention call. With ``spanrl_layout``: one packed row, ``query [1, H, N, D]``,
    ``key`` / ``value [1, H_kv, N, D]`` -> ``([1, N, H, D], None)`` (``attention_mask`` is
    ``PACKED_MASK``, ignored). Without: transformers' own SDPA attention, unchanged."""
    layout: PackedLayout | None = kwargs.pop("spanrl_layout", None)
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
        rows, width = bucket.shape
        flat = bucket.reshape(-1)

        def take(states: torch.Tensor, rows: int = rows, width: int = width, flat: torch.Tensor = flat):
            # [1, H, N, D] -> [rows, H, width, D]
            return states[0].index_select(1, flat).unflatten(1, (rows, width)).transpose(0, 1)

        out = torch.nn.functional.scaled_dot_product_attention(
            take(query), take(key), take(value), dropout_p=dropout, is_causal=True, scale=scaling,
            enable_gqa=grouped)
        outputs.append(out.transpose(1, 2).reshape(rows * width, out.shape[1], out.shape[3]))
    merged = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
    return merged.index_select(0, layout.unpack_index).unsqueeze(0), None


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
