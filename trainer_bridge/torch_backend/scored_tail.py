"""The last decoder layer run on the scored positions only, for the torch trainer's packed passes.

A loss is taken on the response tokens; the logprob of token ``t`` reads the last layer's output
at position ``t - 1``. Every other position of the last layer needs only its keys and values (the
scored positions attend over them): its query, attention output, output projection, MLP and
final norm feed nothing the loss reads. A GRPO or SFT batch is mostly prompt (an agent's
instructions, tools and earlier turns), so this skips most of the last layer's work; on a model
of two layers (the ``tiny`` preset) about a third of the decoder's matrix products. The results
are the same: the positions kept go through the same operations, and the ones dropped never
reached the loss, so they got no gradient either.

The layer's own forward is replaced on the instance (its weights, names and checkpoints are
untouched) by one that takes ``spanrl_tail`` (a ``ScoredTail``) and otherwise runs the original.
It is written for the decoder layer most causal LMs share (Llama, Qwen2/3, Mistral: pre-norm,
``q/k/v/o_proj`` with optional ``q_norm``/``k_norm``, rotary embedding by halves, a gated MLP), and
``enable_scored_tail`` switches it on only where it gives the same logprobs as the whole layer.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from spanrl.trainer_bridge.torch_backend.packed_attention import (
    PackedLayout,
    packed_attention_forward,
    query_layout,
    shared_beginnings,
)

TAIL_FLAG = "_spanrl_scored_tail"  # set on a layer whose forward takes ``spanrl_tail``


@dataclass
class ScoredTail:
    """What the last layer computes: its ``positions [Q]`` (packed positions, each once: every
    scored position, and the unscored ones between two of a row's, which are cheaper to keep than
    to cut out), their attention ``layout``, and ``scored_index [n]``: for each of the batch's
    scored positions, in order, its row in the layer's output."""

    positions: torch.Tensor
    layout: PackedLayout
    scored_index: torch.Tensor


def scored_tail(reading_rows: Sequence[Sequence[int]], token_count: int, scored_positions: Sequence[int],
                device: torch.device | str) -> ScoredTail:
    """The ``ScoredTail`` of a packed batch: ``reading_rows`` over ``token_count`` positions as
    ``packed_attention.row_layout`` takes them (each position computed by the one row whose tail
    holds it), ``scored_positions`` as ``TokenBatch`` has them (a position may be scored for
    several rows)."""
    scored = set(scored_positions)
    spans = []
    for row, start in zip(reading_rows, shared_beginnings(reading_rows, token_count), strict=True):
        own = [j for j in range(start, len(row)) if row[j] in scored]
        spans.append((own[0], own[-1] + 1) if own else (start, start))
    layout, positions = query_layout(reading_rows, spans, device)
    index_of = {position: number for number, position in enumerate(positions.tolist())}
    scored_index = torch.tensor([index_of[p] for p in scored_positions], dtype=torch.long, device=device)
    return ScoredTail(positions, layout, scored_index)


def _rotate_half(states: torch.Tensor) -> torch.Tensor:
    half = states.shape[-1] // 2
    return torch.cat((-states[..., half:], states[..., :half]), dim=-1)


def _heads(projection: torch.nn.Module, norm: Any, states: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``[1, N, hidden] -> [1, heads, N, head_dim]`` through ``projection`` (and the head ``norm``)."""
    out = projection(states).view(*states.shape[:-1], -1, head_dim)
    return (out if norm is None else norm(out)).transpose(1, 2)


def _tail_forward(layer: Any, hidden_states: torch.Tensor, tail: ScoredTail,
                  position_embeddings: tuple[torch.Tensor, torch.Tensor], attention_mask: Any) -> torch.Tensor:
    """The layer on ``tail.positions`` only: ``[1, N, hidden] -> [1, Q, hidden]``."""
    attn = layer.self_attn
    head_dim = attn.head_dim
    normed = layer.input_layernorm(hidden_states)
    picked = normed.index_select(1, tail.positions)
    query = _heads(attn.q_proj, getattr(attn, "q_norm", None), picked, head_dim)
    key = _heads(attn.k_proj, getattr(attn, "k_norm", None), normed, head_dim)
    value = _heads(attn.v_proj, None, normed, head_dim)
    cos, sin = (e.unsqueeze(1) for e in position_embeddings)
    query_cos, query_sin = cos.index_select(2, tail.positions), sin.index_select(2, tail.positions)
    query = query * query_cos + _rotate_half(query) * query_sin
    key = key * cos + _rotate_half(key) * sin
    out, _ = packed_attention_forward(attn, query, key, value, attention_mask, scaling=attn.scaling,
                                      dropout=getattr(attn, "attention_dropout", 0.0) if attn.training else 0.0,
                                      spanrl_layout=tail.layout)
    hidden = hidden_states.index_select(1, tail.positions) + attn.o_proj(out.reshape(*picked.shape[:-1], -1))
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


def _install(layer: torch.nn.Module) -> None:
    """``layer.forward`` takes ``spanrl_tail``; without it, the original forward."""
    original = layer.forward

    def forward(self: Any, hidden_states: torch.Tensor, *args: Any, spanrl_tail: ScoredTail | None = None,
                **kwargs: Any) -> torch.Tensor:
        if spanrl_tail is None:
            return original(hidden_states, *args, **kwargs)
        return _tail_forward(self, hidden_states, spanrl_tail, kwargs["position_embeddings"],
                             kwargs.get("attention_mask"))

    layer.forward = types.MethodType(forward, layer)
    setattr(layer, TAIL_FLAG, original)


def _uninstall(layer: torch.nn.Module) -> None:
    original = getattr(layer, TAIL_FLAG, None)
    if original is not None:
        layer.forward = original
        delattr(layer, TAIL_FLAG)


def last_layer(decoder: torch.nn.Module) -> torch.nn.Module | None:
    """The decoder's last layer when it has the shape ``_tail_forward`` reads, else None."""
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        return None
    layer = layers[-1]
    attn = getattr(layer, "self_attn", None)
    needed = ((layer, ("input_layernorm", "post_attention_layernorm", "mlp")),
              (attn, ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")))
    if attn is None or not all(hasattr(owner, name) for owner, names in needed for name in names):
        return None
    return layer


def tail_enabled(decoder: torch.nn.Module | None) -> bool:
    layer = last_layer(decoder) if decoder is not None else None
    return layer is not None and hasattr(layer, TAIL_FLAG)


def enable_scored_tail(decoder: torch.nn.Module, same_logprobs: Any) -> bool:
    """Give ``decoder``'s last layer the scored-positions forward if ``same_logprobs()`` (a check
    the caller runs with it on: logprobs with and without the tail) says it changes nothing;
    otherwise leave the layer as it was. True when on."""
    layer = last_layer(decoder)
    if layer is None:
        return False
    if not hasattr(layer, TAIL_FLAG):
        _install(layer)
    try:
        matches = bool(same_logprobs())
    except (ValueError, TypeError, RuntimeError, KeyError, AttributeError, IndexError):
        matches = False
    if not matches:
        _uninstall(layer)
    return matches
