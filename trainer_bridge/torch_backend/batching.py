"""Batching for the torch trainer: token sequences -> micro-batches -> token logprobs.

Used by ``trainer.TorchTrainer`` (GRPO) and ``sft`` (supervised warm start). A sequence is
``(ids, loss_mask)``: the prompt and response ids of one transition (or one chat example) and
a 0/1 mask of the tokens whose logprob is scored. A micro-batch's sequences are **packed** end
to end in one row, so the model runs on real tokens only (``packed_attention`` keeps attention
inside each sequence), or, for a model that cannot be packed, right-padded to its longest.
Packed sequences that begin alike (a GRPO group's shared prompt, an agent's later call that
carries its earlier turns) can **share** that beginning: it is packed and run once, and each of
them reads it, which gives the same logprobs and gradients as running each on its own.
Micro-batches are cut by a token budget (real tokens packed, ``rows * longest`` padded) so the
loss of a large batch is taken in pieces that fit in memory. Either way the LM head runs on the
scored positions only and the logprobs come back as ``[B, T]``: each row's scored tokens, in
order, right-padded.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from spanrl.trainer_bridge.backend import TrainingSample
from spanrl.trainer_bridge.torch_backend.packed_attention import (
    PACKED_ATTENTION,
    PACKED_MASK,
    PackedLayout,
    row_layout,
    use_packed_attention,
    use_sdpa_attention,
)
from spanrl.trainer_bridge.torch_backend.scored_tail import ScoredTail, enable_scored_tail, scored_tail, tail_enabled

logger = logging.getLogger(__name__)

# A micro-batch with shared beginnings may read this many times its token budget through them:
# attention keeps a copy of the keys and values each row reads (~2 hidden sizes a token read;
# queries and outputs only for the row's own tokens, packed_attention) where the rest of a layer
# keeps ~15-20 hidden sizes per packed token. (Set when every row also copied its queries and
# outputs over what it read, ~4 hidden sizes; kept, so a micro-batch now needs less than then.)
SHARED_READS_PER_TOKEN = 4

# (token ids, 0/1 mask of the tokens whose logprob is scored)
MaskedSequence = tuple[list[int], list[int]]


@dataclass
class TokenBatch:
    """A micro-batch as the model takes it, and where its scored tokens are.

    Packed: ``input_ids`` / ``position_ids`` are ``[1, N]`` and ``layout`` says where attention
    looks. Padded: ``input_ids`` / ``attention_mask`` are ``[B, L]``. ``scored_positions`` are
    flat positions in ``input_ids`` whose next token is scored (``targets``), row by row;
    ``response_mask [B, T]`` is 1.0 on each row's first (number of its scored tokens) columns.
    """

    input_ids: torch.Tensor
    scored_positions: torch.Tensor  # [n]
    targets: torch.Tensor           # [n]
    response_mask: torch.Tensor     # [B, T] float
    rows: list[int] = field(default_factory=list)  # indices into the caller's list
    position_ids: torch.Tensor | None = None   # packed
    layout: PackedLayout | None = None         # packed
    tail: ScoredTail | None = None             # packed, the last layer on scored positions only
    attention_mask: torch.Tensor | None = None  # padded


def sample_sequences(samples: Sequence[TrainingSample]) -> list[MaskedSequence]:
    """``prompt + response`` ids of each sample with its loss tokens masked in: every response
    token, or for a merged row (``trajectory_merge``) the calls' own response tokens."""
    sequences = []
    for number, sample in enumerate(samples):
        prompt, response = list(sample.prompt_token_ids), list(sample.response_token_ids)
        if not prompt or not response or not sample.loss_token_count:
            raise ValueError(f"sample {number} has an empty prompt or response")
        if len(sample.loss_mask) != len(response):
            raise ValueError(f"sample {number}: response_loss_mask has {len(sample.loss_mask)} entries "
                             f"for {len(response)} response tokens")
        sequences.append((prompt + response, [0] * len(prompt) + sample.loss_mask))
    return sequences


def loss_token_values(sample: TrainingSample, values: Sequence[float]) -> list[float]:
    """Of ``values`` (one per response token), those of the tokens the loss is taken on, in
    order: the columns of the sample's row in ``TokenBatch.response_mask``."""
    return [float(v) for v, m in zip(values, sample.loss_mask, strict=True) if m]


def usable_old_logprobs(samples: Sequence[TrainingSample]) -> list[Sequence[float] | None]:
    """Each sample's given old logprobs, or ``None`` (recompute) where their count does not
    match its response: agent data from another engine must not stop training."""
    usable: list[Sequence[float] | None] = []
    mismatched: list[str] = []
    for number, sample in enumerate(samples):
        given = sample.old_logprobs
        if given is not None and len(given) != len(sample.response_token_ids):
            mismatched.append(f"sample {number}: {len(given)} for {len(sample.response_token_ids)} tokens")
            given = None
        usable.append(given)
    if mismatched:
        logger.warning("%d of %d samples have a different number of old logprobs than response "
                       "tokens (%s%s): their old logprobs are recomputed with the current weights",
                       len(mismatched), len(samples), "; ".join(mismatched[:3]),
                       ", ..." if len(mismatched) > 3 else "")
    return usable


def micro_batches(sequences: Sequence[MaskedSequence], token_budget: int, packed: bool = False,
                  share_prefixes: bool = False) -> list[list[int]]:
    """Indices grouped so each group's cost stays within ``token_budget``: its tokens when
    ``packed``, ``rows * longest`` when padded (shortest first). With ``share_prefixes`` (packed
    only) sequences go in sorted order, so those that begin alike are neighbours; a beginning
    shared with the group's previous sequence is not counted again, but attention's reads of it
    are, at ``1 / SHARED_READS_PER_TOKEN`` each."""
    share = packed and share_prefixes
    if share:
        order = sorted(range(len(sequences)), key=lambda i: sequences[i][0])
    else:
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i][0]))
    groups: list[list[int]] = []
    current: list[int] = []
    longest = total = read = 0
    previous: list[int] = []
    for index in order:
        ids = sequences[index][0]
        length = len(ids)
        new = length - common_length(previous, ids) if share and current else length
        if packed:
            cost = max(total + new, (read + length) / SHARED_READS_PER_TOKEN) if share else total + new
        else:
            cost = (len(current) + 1) * max(longest, length)
        if current and cost > token_budget:
            groups.append(current)
            current, longest, total, read, new = [], 0, 0, 0, length
        current.append(index)
        longest, total, read, previous = max(longest, length), total + new, read + length, ids
    if current:
        groups.append(current)
    return groups


def common_length(first: Sequence[int], second: Sequence[int]) -> int:
    """How many tokens ``first`` and ``second`` have in common from the start."""
    for index, (a, b) in enumerate(zip(first, second, strict=False)):
        if a != b:
            return index
    return min(len(first), len(second))


def _scored(chosen: Sequence[MaskedSequence], paths: Sequence[Sequence[int]],
            ) -> tuple[list[int], list[int], torch.Tensor]:
    """Flat positions whose next token is scored (``paths[b][t]``: where token ``t`` of sequence
    ``b`` is in the input), those tokens, and the ``[B, T]`` response mask."""
    positions: list[int] = []
    targets: list[int] = []
    counts: list[int] = []
    for (ids, mask), path in zip(chosen, paths, strict=True):
        scored = [t for t in range(1, len(ids)) if mask[t]]
        positions += [path[t - 1] for t in scored]
        targets += [ids[t] for t in scored]
        counts.append(len(scored))
    response_mask = torch.zeros((len(chosen), max(1, *counts)), dtype=torch.float32)
    for b, count in enumerate(counts):
        response_mask[b, :count] = 1.0
    return positions, targets, response_mask


def _packed_paths(chosen: Sequence[MaskedSequence], share_prefixes: bool,
                  ) -> tuple[list[list[int]], list[int], list[int], list[list[int]]]:
    """Where each sequence's tokens go in one packed row: each sequence's path (packed position of
    each of its tokens), the packed ids and their position ids, and the rows attention reads (the
    paths that brought new tokens). With ``share_prefixes`` sequences are taken in sorted order
    and each one's beginning in common with the one before reuses that one's positions."""
    order = sorted(range(len(chosen)), key=lambda b: chosen[b][0]) if share_prefixes else range(len(chosen))
    paths: list[list[int]] = [[] for _ in chosen]
    packed_ids: list[int] = []
    position_ids: list[int] = []
    reading_rows: list[list[int]] = []
    previous_ids: list[int] = []
    previous_path: list[int] = []
    for b in order:
        ids = chosen[b][0]
        shared = common_length(previous_ids, ids) if share_prefixes else 0
        start = len(packed_ids)
        path = previous_path[:shared] + list(range(start, start + len(ids) - shared))
        packed_ids += ids[shared:]
        position_ids += range(shared, len(ids))
        if len(ids) > shared:  # a repeat of the one before brings nothing to attend over
            reading_rows.append(path)
        paths[b], previous_ids, previous_path = path, ids, path
    return paths, packed_ids, position_ids, reading_rows


def pack_batch(sequences: Sequence[MaskedSequence], rows: list[int], device: torch.device | str,
               share_prefixes: bool = False, tail: bool = False) -> TokenBatch:
    """``rows``' sequences in one row, no padding, positions restarting at each. With
    ``share_prefixes`` a beginning that sequences have in common (a GRPO group's prompt, an
    agent's earlier turns) is packed once and read by each of them (``packed_attention``). With
    ``tail``, the batch says where a model with ``scored_tail`` on runs its last layer."""
    chosen = [sequences[i] for i in rows]
    paths, packed_ids, position_ids, reading_rows = _packed_paths(chosen, share_prefixes)
    positions, targets, response_mask = _scored(chosen, paths)
    last_layer = scored_tail(reading_rows, len(packed_ids), positions, device) if tail and positions else None
    return TokenBatch(torch.tensor([packed_ids], dtype=torch.long, device=device),
                      torch.tensor(positions, dtype=torch.long, device=device),
                      torch.tensor(targets, dtype=torch.long, device=device), response_mask.to(device), rows,
                      position_ids=torch.tensor([position_ids], dtype=torch.long, device=device),
                      layout=row_layout(reading_rows, len(packed_ids), device), tail=last_layer)


def pad_batch(sequences: Sequence[MaskedSequence], rows: list[int], pad_id: int,
              device: torch.device | str) -> TokenBatch:
    """``rows``' sequences right-padded with ``pad_id`` to the longest."""
    chosen = [sequences[i] for i in rows]
    width = max(len(ids) for ids, _ in chosen)
    input_ids = torch.full((len(chosen), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(chosen), width), dtype=torch.long)
    for b, (ids, _) in enumerate(chosen):
        input_ids[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention[b, : len(ids)] = 1
    positions, targets, response_mask = _scored(chosen, [range(b * width, b * width + len(ids))
                                                         for b, (ids, _) in enumerate(chosen)])
    return TokenBatch(input_ids.to(device), torch.tensor(positions, dtype=torch.long, device=device),
                      torch.tensor(targets, dtype=torch.long, device=device), response_mask.to(device), rows,
                      attention_mask=attention.to(device))


def token_logprobs(model: Any, batch: TokenBatch,
                   autocast: AbstractContextManager) -> torch.Tensor:
    """``log p(target | prefix)`` of every scored token, ``[B, T]`` float32 (0 off the mask).

    The LM head runs only on the scored positions (not on prompt tokens, not on padding): the
    decoder's hidden states are gathered first, which saves most of the head's work and memory
    for large vocabularies.
    """
    decoder, head = decoder_and_head(model)
    with autocast:
        if batch.layout is not None:
            if decoder is None or head is None or model.config._attn_implementation != PACKED_ATTENTION:
                raise ValueError("a packed batch needs a model with a separate decoder and LM head "
                                 "switched to packed attention (enable_packing)")
            tail = batch.tail if batch.tail is not None and tail_enabled(decoder) else None
            hidden = decoder(input_ids=batch.input_ids, position_ids=batch.position_ids,
                             attention_mask=PACKED_MASK.to(batch.input_ids.device),
                             spanrl_layout=batch.layout, spanrl_tail=tail).last_hidden_state
            picked = head(hidden.flatten(0, 1).index_select(0, batch.scored_positions if tail is None
                                                            else tail.scored_index))
        elif decoder is None or head is None:
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
            picked = logits.flatten(0, 1).index_select(0, batch.scored_positions)
        else:
            hidden = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
            picked = head(hidden.flatten(0, 1).index_select(0, batch.scored_positions))  # [n, V]
    values = grpo_logprobs(picked, batch.targets)
    return torch.zeros_like(batch.response_mask).masked_scatter(batch.response_mask.bool(), values)


def enable_packing(model: Any, vocab_size: int, device: torch.device | str, tolerance: float = 1e-4) -> bool:
    """Switch ``model`` to packed attention if it then gives the same logprobs packed as padded,
    on three short random sequences, two of them sharing a beginning (the masked path of
    ``packed_attention``); otherwise leave it as it was and return ``False``."""
    if decoder_and_head(model) == (None, None) or not use_packed_attention(model):
        return False
    generator = torch.Generator().manual_seed(0)
    first, second, third = (torch.randint(0, vocab_size, (length,), generator=generator).tolist()
                            for length in (5, 11, 4))
    sequences = [(ids, [0, *[1] * (len(ids) - 1)]) for ids in (first, second, second[:6] + third)]
    try:
        with torch.no_grad():
            packed = token_logprobs(model, pack_batch(sequences, [0, 1, 2], device, share_prefixes=True), nullcontext())
            padded = token_logprobs(model, pad_batch(sequences, [0, 1, 2], 0, device), nullcontext())
        matches = bool(torch.allclose(packed, padded, atol=tolerance, rtol=0))
    except (ValueError, TypeError, RuntimeError, KeyError):
        matches = False
    if not matches:
        use_sdpa_attention(model)
    return matches


def enable_tail(model: Any, vocab_size: int, device: torch.device | str, tolerance: float = 1e-5) -> bool:
    """Run a packed model's last layer on the scored positions only (``scored_tail``) if that gives
    the same logprobs as the whole layer, on three short random sequences, two sharing a
    beginning; otherwise leave it as it was and return ``False``."""
    decoder, _ = decoder_and_head(model)
    if decoder is None or model.config._attn_implementation != PACKED_ATTENTION:
        return False
    generator = torch.Generator().manual_seed(1)
    first, second, third = (torch.randint(0, vocab_size, (length,), generator=generator).tolist()
                            for length in (7, 12, 5))
    sequences = [(ids, [0, 0, 0, *[1] * (len(ids) - 3)]) for ids in (first, second, second[:8] + third)]
    batch = pack_batch(sequences, [0, 1, 2], device, share_prefixes=True, tail=True)
    whole = replace(batch, tail=None)

    def same_logprobs() -> bool:
        with torch.no_grad():
            return bool(torch.allclose(token_logprobs(model, batch, nullcontext()),
                                       token_logprobs(model, whole, nullcontext()), atol=tolerance, rtol=0))
    return enable_scored_tail(decoder, same_logprobs)


def grpo_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)[targets]`` in float32 without materialising the full softmax twice.

    ``logits [..., V]``, ``targets [...]`` -> ``[...]``.
    """
    logits = logits.float()
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def decoder_and_head(model: Any) -> tuple[torch.nn.Module | None, torch.nn.Module | None]:
    """The decoder stack and LM head of a plain or PEFT-wrapped HF causal LM, or ``(None, None)``.

    ``(None, None)`` (use the full forward) for models whose logits are post-processed after
    the head (e.g. Gemma's soft-capping).
    """
    base: Any = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(base.config, "final_logit_softcapping", None):
        return None, None
    decoder = getattr(base, "model", None)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if decoder is None or head is None or not hasattr(decoder, "forward"):
        return None, None
    return decoder, head


@dataclass
class PreparedUpdate:
    """What a GRPO update consumes, per micro-batch, computed before it (``TorchTrainer._prepare``)."""

    samples: Sequence[TrainingSample]
    sequences: list[MaskedSequence]
    batches: list[TokenBatch]
    total_tokens: float  # response tokens of the whole batch the loss is taken on
    old: list[torch.Tensor] = field(default_factory=list)  # old logprobs (0 where recomputed in the loop)
    missing_rows: list[torch.Tensor] = field(default_factory=list)  # rows whose old logprobs are the pass's own
    engine_old: list[torch.Tensor] = field(default_factory=list)  # the engine's logprobs (truncated IS)
    advantages: list[torch.Tensor] = field(default_factory=list)
    ref: list[torch.Tensor] = field(default_factory=list)  # the reference's logprobs (KL penalty)
