"""Sampling for the policy engine: one token per row, each row with its own parameters and seed.

Used by ``scheduler.py`` once per forward pass. ``BatchSampling`` holds the rows' parameters
as tensors (temperature, top-k, top-p, who is greedy, who has a seed), rebuilt only when rows
join or leave a batch; ``Sampler.sample`` draws the next token of every row; ``sampled_logprobs``
gives the logprobs (and top logprobs) the rows asked for.

Logprobs are ``log_softmax`` of the model's raw logits (temperature 1, no top-k/top-p) at the
sampled token: they equal a forward pass of the same model over prompt + response, which is
what the trainer's importance ratio needs, whatever temperature the request sampled with.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from spanrl.trainer_bridge.torch_backend.engine.requests import SamplingParams

if TYPE_CHECKING:
    from spanrl.trainer_bridge.torch_backend.engine.kv_cache import Row

# what ``sampled_logprobs`` gives: the sampled tokens' logprobs, and the top (values, token ids)
TopLogprobs = tuple[list[list[float]], list[list[int]]]


@dataclass(frozen=True)
class BatchSampling:
    """The sampling parameters of a batch's rows (index i is row i), as the sampler uses them."""

    temperature: torch.Tensor  # [rows] float32
    top_p: torch.Tensor  # [rows] float32
    top_k: torch.Tensor  # [rows] long, 0: off
    greedy: torch.Tensor  # [rows] bool: temperature 0
    all_greedy: bool
    any_greedy: bool
    truncating: torch.Tensor | None  # indices of sampled rows with top-k or top-p
    only_shared: bool  # every row draws from the engine's shared generator (the usual case)
    shared: torch.Tensor | None  # indices of sampled rows without a seed
    seeded: list[tuple[int, torch.Generator]]  # (index, its generator) of sampled rows with a seed
    want_logprobs: bool  # some row asked for logprobs
    want_top: int  # the most top logprobs a row asked for
    constrained: list[tuple[int, Any]]  # (index, its grammar matcher) of rows whose output is constrained

    @classmethod
    def for_rows(cls, rows: list[Row], device: torch.device) -> BatchSampling:
        params = [r.request.params for r in rows]
        greedy = [p.temperature == 0 for p in params]
        truncating = [i for i, p in enumerate(params) if not greedy[i] and (p.top_k > 0 or p.top_p < 1.0)]
        shared = [i for i, r in enumerate(rows) if not greedy[i] and r.generator is None]
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor([max(p.top_k, 0) for p in params], dtype=torch.long, device=device),
            greedy=torch.tensor(greedy, device=device),
            all_greedy=all(greedy), any_greedy=any(greedy),
            truncating=torch.tensor(truncating, dtype=torch.long, device=device) if truncating else None,
            only_shared=len(shared) == len(rows),
            shared=torch.tensor(shared, dtype=torch.long, device=device) if shared else None,
            seeded=[(i, r.generator) for i, r in enumerate(rows) if not greedy[i] and r.generator is not None],
            want_logprobs=any(p.logprobs for p in params),
            want_top=max(p.top_logprobs for p in params),
            constrained=[(i, r.matcher) for i, r in enumerate(rows) if r.matcher is not None])


class Sampler:
    """Draws tokens on ``device``: rows without a seed share one generator (seeded from the
    clock), a seeded request's choice *i* has its own, seeded with seed + *i*."""

    def __init__(self, device: torch.device):
        self.device = device
        self.shared_generator = torch.Generator(device=device)
        self.shared_generator.manual_seed(int(time.time_ns()) & 0xFFFFFFFF)

    def generator_for(self, params: SamplingParams, choice: int) -> torch.Generator | None:
        if params.seed is None:
            return None
        generator = torch.Generator(device=self.device)
        generator.manual_seed(int(params.seed) + choice)
        return generator

    def sample(self, logits: torch.Tensor, batch: BatchSampling) -> torch.Tensor:
        """One token per row of ``logits`` [rows, vocab] (float32): greedy at temperature 0, else
        from softmax(logits / T) truncated by the row's top-k / top-p. Always sampled in
        vocabulary order, so a seeded row draws the same token whatever else shares its batch;
        the sort is paid only by truncating rows."""
        if batch.all_greedy:
            return logits.argmax(dim=-1)
        scaled = logits / batch.temperature.clamp(min=1e-5).unsqueeze(1)
        probs = torch.softmax(scaled, dim=-1)
        if batch.truncating is not None:
            which = batch.truncating
            sorted_logits, sorted_index = scaled[which].sort(dim=-1, descending=True)
            rank = torch.arange(scaled.shape[-1], device=scaled.device).unsqueeze(0)
            k = batch.top_k[which].unsqueeze(1)
            remove = (k > 0) & (rank >= k)
            sorted_probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
            before = sorted_probs.cumsum(-1) - sorted_probs  # probability mass ranked above each token
            remove |= (before >= batch.top_p[which].unsqueeze(1)) & (rank > 0)
            sorted_probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
            probs[which] = torch.zeros_like(sorted_probs).scatter(1, sorted_index, sorted_probs)
        if batch.only_shared:  # the usual case: one draw for the whole batch
            return draw(probs, self.shared_generator)
        picks = torch.zeros(logits.shape[0], dtype=torch.long, device=scaled.device)
        if batch.shared is not None:
            picks[batch.shared] = draw(probs[batch.shared], self.shared_generator)
        for i, generator in batch.seeded:
            picks[i] = draw(probs[i:i + 1], generator)[0]
        if batch.any_greedy:
            picks = torch.where(batch.greedy, logits.argmax(dim=-1), picks)
        return picks


def draw(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of ``probs`` [rows, vocab]: the first whose cumulative probability
    exceeds a uniform draw (scaled to the row's total, so rounding never overshoots). One
    random number per row, in vocabulary order: on CPU ~10x cheaper than torch.multinomial
    for a batch, and a zero-probability (truncated) token is never picked."""
    cdf = probs.cumsum(dim=-1)
    u = torch.rand((probs.shape[0], 1), generator=generator, device=probs.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def sampled_logprobs(logits: torch.Tensor, next_ids: torch.Tensor,
                     batch: BatchSampling) -> tuple[list[float] | None, TopLogprobs | None]:
    """Each row's logprob of its sampled token, and the batch's top logprobs (values, ids) when
    a row asked for them; (None, None) when no row asked: a log_softmax over the vocabulary
    per step is skipped."""
    if not batch.want_logprobs:
        return None, None
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, next_ids.unsqueeze(1)).squeeze(1).tolist()
    if not batch.want_top:
        return chosen, None
    top_values, top_indices = logprobs.topk(batch.want_top, dim=-1)
    return chosen, (top_values.tolist(), top_indices.tolist())


def row_top_logprobs(top: TopLogprobs, row: int, count: int) -> list[tuple[int, float]]:
    """Row ``row``'s ``count`` most likely tokens as (token id, logprob), most likely first."""
    return [(int(t), float(v)) for v, t in zip(top[0][row][:count], top[1][row][:count], strict=True)]
