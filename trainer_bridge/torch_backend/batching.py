"""Batching for the torch trainer: token sequences -> padded micro-batches -> token logprobs.

Used by ``trainer.TorchTrainer`` (GRPO) and ``sft`` (supervised warm start). A sequence is
``(ids, loss_mask)``: the prompt and response ids of one transition (or one chat example) and
a 0/1 mask of the tokens whose logprob is scored. Micro-batches are cut by a padded-token
budget so the loss of a large batch is taken in pieces that fit in memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from spanrl.trainer_bridge.backend import TrainingSample

# (token ids, 0/1 mask of the tokens whose logprob is scored)
MaskedSequence = tuple[list[int], list[int]]


@dataclass
class PaddedBatch:
    """A padded micro-batch: ``input_ids [B, L]`` and response positions ``[B, T]``."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    gather_index: torch.Tensor      # [B, T] position in the next-token logprob row
    targets: torch.Tensor           # [B, T] response token ids
    response_mask: torch.Tensor     # [B, T] float
    rows: list[int] = field(default_factory=list)  # indices into the caller's list


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
    order: the columns of the sample's row in ``PaddedBatch.targets``."""
    return [float(v) for v, m in zip(values, sample.loss_mask, strict=True) if m]


def micro_batches(sequences: Sequence[MaskedSequence], token_budget: int) -> list[list[int]]:
    """Indices grouped so ``rows * longest`` stays within ``token_budget``, shortest first."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i][0]))
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for index in order:
        length = len(sequences[index][0])
        if current and (len(current) + 1) * max(longest, length) > token_budget:
            groups.append(current)
            current, longest = [], 0
        current.append(index)
        longest = max(longest, length)
    if current:
        groups.append(current)
    return groups


def pad_batch(sequences: Sequence[MaskedSequence], rows: list[int], pad_id: int,
              device: torch.device) -> PaddedBatch:
    """Right-padded ``ids`` of ``rows`` with the positions of their loss tokens (mask 1)."""
    chosen = [sequences[i] for i in rows]
    width = max(len(ids) for ids, _ in chosen)
    targets_width = max(max(1, sum(mask)) for _, mask in chosen)
    batch = len(chosen)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    attention = torch.zeros((batch, width), dtype=torch.long)
    gather_index = torch.zeros((batch, targets_width), dtype=torch.long)
    targets = torch.zeros((batch, targets_width), dtype=torch.long)
    response_mask = torch.zeros((batch, targets_width), dtype=torch.float32)
    for b, (ids, mask) in enumerate(chosen):
        input_ids[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention[b, : len(ids)] = 1
        positions = [t for t in range(1, len(ids)) if mask[t]]
        if positions:
            gather_index[b, : len(positions)] = torch.tensor(positions) - 1
            targets[b, : len(positions)] = torch.tensor([ids[t] for t in positions])
            response_mask[b, : len(positions)] = 1.0
    return PaddedBatch(input_ids.to(device), attention.to(device), gather_index.to(device),
                       targets.to(device), response_mask.to(device), rows)


def token_logprobs(model: torch.nn.Module, batch: PaddedBatch,
                   autocast: AbstractContextManager) -> torch.Tensor:
    """``log p(target | prefix)`` of every loss token, ``[B, T]`` float32.

    The LM head runs only on the positions that are scored (not on prompt tokens): the
    decoder's hidden states are gathered first, which saves most of the head's work and
    memory for large vocabularies.
    """
    rows = torch.arange(batch.input_ids.shape[0], device=batch.input_ids.device).unsqueeze(1)
    decoder, head = decoder_and_head(model)
    with autocast:
        if decoder is None or head is None:
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
            picked = logits[rows, batch.gather_index]
        else:
            hidden = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
            picked = head(hidden[rows, batch.gather_index])  # [B, T, V]
    return grpo_logprobs(picked, batch.targets)


def grpo_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)[targets]`` in float32 without materialising the full softmax twice.

    ``logits [B, T, V]``, ``targets [B, T]`` -> ``[B, T]``.
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
    batches: list[PaddedBatch]
    total_tokens: float  # response tokens of the whole batch the loss is taken on
    old: list[torch.Tensor] = field(default_factory=list)  # old logprobs (0 where recomputed in the loop)
    missing_rows: list[torch.Tensor] = field(default_factory=list)  # rows whose old logprobs are the pass's own
    engine_old: list[torch.Tensor] = field(default_factory=list)  # the engine's logprobs (truncated IS)
    advantages: list[torch.Tensor] = field(default_factory=list)
    ref: list[torch.Tensor] = field(default_factory=list)  # the reference's logprobs (KL penalty)
