"""Grammar-constrained decoding for the policy engine: token masks from llguidance.

Used by ``scheduler.py``. A request whose ``SamplingParams.grammar`` is set (the HTTP server
builds one for ``response_format``, ``text.format``, strict tools and forced ``tool_choice``:
``server/structured_output.py``) gets one ``llguidance.LLMatcher`` per choice when it is queued
(``Grammars.matchers``). At each step ``Grammars.mask`` takes the token bitmask of the batch's
constrained rows only (llguidance's executor, in parallel, GIL released; computed by
``Grammars.prefetch`` during the forward pass) and returns a copy of the logits with every
disallowed token at ``-inf``; the scheduler samples from that copy, and ``advance`` moves each
row's matcher over its sampled token. Rows without a grammar cost nothing: a batch with none
never calls in here.

The logprobs the engine returns stay those of the raw logits (docs/policy.md, "Structured
outputs"): the mask decides what may be sampled, not the probabilities reported.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from spanrl.trainer_bridge.torch_backend.engine.detokenize import Detokenizer
from spanrl.trainer_bridge.torch_backend.engine.requests import EngineError


class Grammars:
    """Compiles grammars against the engine's tokenizer and masks a batch's logits.

    The llguidance tokenizer is built on first use (a few ms for a small vocabulary, about a
    second for a large one), so an engine that never sees a grammar never builds it.
    """

    def __init__(self, tokenizer: Any, detokenizer: Detokenizer):
        self.tokenizer = tokenizer
        self.detokenizer = detokenizer  # its eos_ids end a sequence (replaceable: tests forbid them)
        self._ll_tokenizer: Any = None
        self._executor: Any = None  # llguidance's parallel executor
        self._worker: ThreadPoolExecutor | None = None  # computes prefetched masks
        self._lock = threading.Lock()
        self._in_flight: list[Future] = []  # prefetches not waited for yet

    def _ensure_tokenizer(self) -> Any:
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance
                import llguidance.hf

                eos = sorted(i for i in self.detokenizer.eos_ids if i < len(self.tokenizer)) or None
                self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, eos_token=eos)
                self._executor = llguidance.LLExecutor()
            return self._ll_tokenizer

    def matchers(self, grammar: str, count: int) -> list[Any]:
        """``count`` fresh matchers of ``grammar`` (one per choice); ``EngineError`` for a grammar
        llguidance refuses."""
        import llguidance

        matcher = llguidance.LLMatcher(self._ensure_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise EngineError(f"the output constraint cannot be compiled: {matcher.get_error()}", "response_format")
        return [matcher] + [matcher.deep_copy() for _ in range(count - 1)]

    def prefetch(self, matchers: list[Any]) -> PrefetchedMasks:
        """Start computing the next bitmask of ``matchers`` (just advanced over their sampled
        tokens) in a worker thread, while the engine thread runs the next forward pass: llguidance
        releases the GIL, so free rows wait for no grammar work (as vLLM overlaps its bitmasks with
        the forward). ``mask`` takes the result when the batch's constrained rows are the same."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="spanrl-grammar-masks")
        future = self._worker.submit(self._bitmask, list(matchers))
        self._in_flight.append(future)
        return PrefetchedMasks(tuple(matchers), future)

    def mask(self, logits: torch.Tensor, constrained: list[tuple[int, Any]],
             prefetched: PrefetchedMasks | None = None) -> torch.Tensor:
        """A copy of ``logits`` [rows, vocab] where each constrained row (its index, its matcher)
        keeps only the tokens its grammar allows. A row whose matcher allows nothing (an error
        state) keeps only its end-of-sequence tokens, so it ends instead of sampling garbage."""
        matchers = [matcher for _, matcher in constrained]
        self._settle_in_flight()  # from here on the engine thread alone uses the matchers and the executor
        if prefetched is not None and prefetched.covers(matchers):
            bitmask = prefetched.future.result()
        else:  # rows joined or left since the prefetch (or none was made): compute now
            bitmask = self._bitmask(matchers)
        allowed = unpack_bitmask(bitmask, logits.shape[1]).to(logits.device)
        stuck = ~allowed.any(dim=1)
        if bool(stuck.any()):
            for eos in self.detokenizer.eos_ids:
                if eos < logits.shape[1]:
                    allowed[stuck, eos] = True
        rows = torch.tensor([index for index, _ in constrained], dtype=torch.long, device=logits.device)
        masked = logits.clone()
        masked[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
        return masked

    def _bitmask(self, matchers: list[Any]) -> torch.Tensor:
        """llguidance's next-token bitmask of each matcher [len(matchers), words], computed in
        parallel by its executor (what llguidance.torch.fill_next_token_bitmask_par does, without
        importing that module's torch.compile'd helpers)."""
        words = (self._ensure_tokenizer().vocab_size + 31) // 32
        bitmask = torch.zeros((len(matchers), words), dtype=torch.int32)
        self._executor.unsafe_compute_mask_ptr([(matcher, slot) for slot, matcher in enumerate(matchers)],
                                               bitmask.data_ptr(), words * 4, len(matchers))
        return bitmask

    def _settle_in_flight(self) -> None:
        """Wait for every prefetch still running (another batch's, e.g. rows that just joined:
        their matchers are about to be used and advanced here)."""
        for future in self._in_flight:
            future.exception()  # waits; a failed prefetch is recomputed, or raises, when used
        self._in_flight = []

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None


@dataclass(frozen=True)
class PrefetchedMasks:
    """The bitmask of ``matchers`` (in this order), being computed by ``Grammars.prefetch``."""

    matchers: tuple[Any, ...]
    future: Future

    def covers(self, matchers: list[Any]) -> bool:
        return len(matchers) == len(self.matchers) and all(a is b for a, b in zip(matchers, self.matchers, strict=True))


def unpack_bitmask(bitmask: torch.Tensor, width: int) -> torch.Tensor:
    """llguidance's bitmask [rows, words] (bit j of word w: token 32 w + j) as a boolean mask
    [rows, width]; tokens past the tokenizer's vocabulary (padding of the logits) are not allowed."""
    bits = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(2) >> bits) & 1).bool().reshape(bitmask.shape[0], -1)
    if allowed.shape[1] >= width:
        return allowed[:, :width]
    return torch.cat([allowed, allowed.new_zeros((allowed.shape[0], width - allowed.shape[1]))], dim=1)


def advance(matcher: Any, token_id: int) -> None:
    """Move ``matcher`` over the token its row sampled (always one its mask allowed)."""
    matcher.consume_token(token_id)


__all__ = ["Grammars", "PrefetchedMasks", "advance", "unpack_bitmask"]
