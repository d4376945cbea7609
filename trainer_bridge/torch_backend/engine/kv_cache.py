"""The running batch of the policy engine: its rows, their KV cache, attention masks and positions.

Used by ``scheduler.py`` (which prefills rows, decodes them step by step and lets rows join and
leave between steps). A ``Row`` is one sequence being decoded (one choice of one request); a
``RunningBatch`` holds the rows decoding together with their KV cache, left-padded, and merges
or drops rows with the cache surgery that continuous batching needs; its full-attention layers
are ``growing_cache.GrowingLayer``s, which a decode step extends in place. ``AttentionMasks``
builds the 4D masks the engine hands the model where its attention takes one.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch

from spanrl.trainer_bridge.torch_backend.engine.growing_cache import GrowingLayer, growing_layers
from spanrl.trainer_bridge.torch_backend.engine.requests import ChoiceResult, GenerationRequest
from spanrl.trainer_bridge.torch_backend.engine.sampling import BatchSampling
from spanrl.trainer_bridge.torch_backend.engine.shared_prefix import ATTENTION, shared_length


@dataclass
class Row:
    """One sequence being decoded (one choice of one request)."""

    request: GenerationRequest
    choice: int
    generator: torch.Generator | None  # its own random stream when the request has a seed
    queued_at: float = 0.0  # time.monotonic() when it started waiting
    matcher: Any = None  # its grammar's llguidance matcher when the request constrains its output (grammar.py)
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    emitted_chars: int = 0  # how much of ``text`` its token events have handed out
    text: str = ""
    finished: bool = False
    finish_reason: str = "length"

    def choice_result(self) -> ChoiceResult:
        params = self.request.params
        return ChoiceResult(
            index=self.choice, token_ids=list(self.ids), text=self.text, finish_reason=self.finish_reason,
            logprobs=list(self.logprobs) if params.logprobs else None,
            top_logprobs=list(self.top_logprobs) if params.top_logprobs else None)


def requests_of(rows: list[Row]) -> list[GenerationRequest]:
    """The distinct requests of ``rows``, in order."""
    return list({id(r.request): r.request for r in rows}.values())


def fail_rows(rows: list[Row], error: BaseException) -> None:
    """Fail every request with a row among ``rows``."""
    for request in requests_of(rows):
        request.fail(error)


class RunningBatch:
    """The rows decoding together: their KV cache and per-row tensors (index i is ``rows[i]``).

    Rows are left-padded: each row's tokens are the last columns of ``attention`` (1 = a real
    token) and of the cache. Rows leave (``without_finished``) and join (``merge``) between
    steps (a leaver's place goes to one of the last rows: ``fill_from_the_end``); columns that
    are padding for every row are cut off, so the cache stays as wide as its longest row, not as
    long as the batch has been running. ``joinable`` is False for a
    cache this class cannot re-pack (sliding-window layers): such a batch takes no new rows.
    ``sampling`` holds the rows' sampling tensors, rebuilt only when rows join or leave;
    ``shared_length`` how many prompt tokens all rows start with (``shared_prefix.py``), likewise.
    """

    def __init__(self, rows: list[Row], cache: Any, attention: torch.Tensor, positions: torch.Tensor):
        self.rows = rows
        self.cache = cache  # a transformers DynamicCache, tensors [rows, heads, columns, head_dim]
        growing_layers(cache)
        self.joinable = cache_is_joinable(cache)
        self.attention = attention  # [rows, columns]
        self.positions = positions  # [rows]: position id of each row's next input token
        self.next_ids = torch.empty(0, dtype=torch.long)  # [rows]: each row's last sampled token, once sampled
        self.sampling = BatchSampling.for_rows(rows, attention.device)
        self.shared_length = shared_length(rows)
        self.prefetched_masks: Any = None  # the constrained rows' next masks (grammar.PrefetchedMasks)

    def append_column(self) -> torch.Tensor:
        """One more real column for every row (the token a decode step feeds); the new mask."""
        self.attention = torch.cat([self.attention, self.attention.new_ones((len(self.rows), 1))], dim=1)
        return self.attention

    def without_finished(self) -> RunningBatch | None:
        """This batch without its finished rows (None when none is left)."""
        keep = [i for i, row in enumerate(self.rows) if not row.finished]
        if len(keep) == len(self.rows):
            return self
        if not keep:
            return None
        order = fill_from_the_end(keep)
        index = torch.tensor(order, device=self.attention.device)
        self.rows = [self.rows[i] for i in order]
        self.attention = self.attention.index_select(0, index)
        self.positions = self.positions.index_select(0, index)
        self.next_ids = self.next_ids.index_select(0, index)
        self.cache.batch_select_indices(index)
        if self.joinable:
            self._cut_unused_columns()
        self.sampling = BatchSampling.for_rows(self.rows, self.attention.device)
        self.shared_length = shared_length(self.rows)
        return self

    def _cut_unused_columns(self) -> None:
        used = self.attention.any(dim=0).nonzero()
        first = int(used[0]) if len(used) else 0
        if first:
            self.attention = self.attention[:, first:]
            for layer in self.cache.layers:
                if isinstance(layer, GrowingLayer):
                    layer.drop_leading_columns(first)
                else:
                    layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]

    def merge(self, other: RunningBatch) -> RunningBatch:
        """This batch followed by ``other``'s rows, both left-padded to the wider one's columns."""
        mine, theirs = self.attention.shape[1], other.attention.shape[1]
        width = max(mine, theirs)
        for layer, joining in zip(self.cache.layers, other.cache.layers, strict=True):
            if isinstance(layer, GrowingLayer):
                layer.merge_rows(joining.keys, joining.values)
                continue
            layer.keys = torch.cat([left_pad(layer.keys, width, 2), left_pad(joining.keys, width, 2)])
            layer.values = torch.cat([left_pad(layer.values, width, 2), left_pad(joining.values, width, 2)])
        self.attention = torch.cat([left_pad(self.attention, width, 1), left_pad(other.attention, width, 1)])
        self.positions = torch.cat([self.positions, other.positions])
        self.next_ids = torch.cat([self.next_ids, other.next_ids])
        self.rows = self.rows + other.rows
        self.sampling = BatchSampling.for_rows(self.rows, self.attention.device)
        self.shared_length = shared_length(self.rows)
        return self


def fill_from_the_end(kept: list[int]) -> list[int]:
    """The order of a batch's rows once only ``kept`` (ascending) stay: each kept row keeps its
    place, except those at or after ``len(kept)``, which move to the places left free before it.
    A ``GrowingLayer`` then copies only the rows that move, not all of them."""
    count = len(kept)
    movers = [row for row in kept if row >= count]
    staying = set(kept)
    return [place if place in staying else movers.pop() for place in range(count)]


def left_padded_prompts(prompts: list[list[int]], pad_id: int,
                        device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A prefill pass's inputs for ``prompts``: ids and attention [rows, longest], each prompt
    in its row's last columns, and position ids counting each row's real tokens from 0."""
    lengths = [len(prompt) for prompt in prompts]
    width = max(lengths)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        input_ids[i, width - lengths[i]:] = torch.tensor(prompt, dtype=torch.long)
        attention[i, width - lengths[i]:] = 1
    input_ids, attention = input_ids.to(device), attention.to(device)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    return input_ids, attention, positions


def left_pad(tensor: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """``tensor`` with zeros prepended along ``dim`` up to ``width`` (masked columns)."""
    missing = width - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


def cache_is_joinable(cache: Any) -> bool:
    """Whether rows of two batches can be merged: every layer a plain, full-attention cache
    of ``keys``/``values`` tensors (a sliding window is not re-packed by this engine)."""
    layers = getattr(cache, "layers", None)
    if not layers:
        return False
    return all(not getattr(layer, "is_sliding", False) and isinstance(getattr(layer, "keys", None), torch.Tensor)
               for layer in layers)


class AttentionMasks:
    """The engine's own 4D masks where the model's attention takes one.

    transformers builds a padded batch's mask in Python each pass (~0.1-0.3 ms at 16 rows;
    nothing at 1 row). sdpa takes a boolean mask (True: attend; a quarter of a float mask's
    memory), eager an additive one; any other attention gets the 2D mask and builds its own.
    ``own`` may be turned off to compare with transformers' masks.
    """

    def __init__(self, model: Any):
        attention_kind = getattr(model.config, "_attn_implementation", None)
        self.own = attention_kind in ("sdpa", "eager", ATTENTION)
        self.additive = attention_kind == "eager"
        self.dtype = next(model.parameters()).dtype

    def decode(self, attention: torch.Tensor) -> torch.Tensor:
        """What one decode step attends to, every row's real columns ([rows, 1, 1, columns]), or
        the 2D mask when the model builds its own."""
        if not self.own:
            return attention
        return self._as_model_mask(attention.bool()[:, None, None, :])

    def prefill(self, attention: torch.Tensor, new_columns: int | None = None) -> torch.Tensor | None:
        """Causal and left-padding mask of a prefill pass ([rows, 1, new, columns]) whose queries
        are the last ``new_columns`` of ``attention``'s columns (all of them by default; fewer
        when the first ones are cached already). A padding query may see every column (its output
        is never used): with older torch a query that sees none gives NaN, which would reach real
        rows through the values. None when no row has padding (one prompt, or prompts of one
        length): the model's attention is then plainly causal, which sdpa computes without a mask,
        in a kernel that never holds the columns x columns scores (a 4,000-token prompt: 1.2 s
        instead of 1.9)."""
        if bool(attention.all()):
            return None
        if not self.own:
            return attention
        width = attention.shape[1]
        new = width if new_columns is None else new_columns
        real = attention.bool()
        causal = torch.ones((width, width), dtype=torch.bool, device=attention.device).tril()[width - new:]
        allowed = (causal.unsqueeze(0) & real.unsqueeze(1)) | ~real[:, width - new:].unsqueeze(2)
        return self._as_model_mask(allowed.unsqueeze(1))

    def _as_model_mask(self, allowed: torch.Tensor) -> torch.Tensor:
        if not self.additive:
            return allowed
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device)
        return mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)


def cache_keyword(model: Any) -> str:
    """The name of the model's KV-cache argument: ``cache`` in newer transformers (5.2x, where
    ``past_key_values`` is deprecated, to be removed in 5.40), ``past_key_values`` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def output_cache(output: Any) -> Any:
    """The KV cache a forward pass returned, under either name."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values
