"""The policy engine's pending weight swap: queued by callers, taken by the engine thread.

Owned by ``scheduler.Scheduler``. One swap waits at a time; a newer one supersedes it (its caller
gets ``EngineError`` at once). A swap is applied when nothing it changes is decoding: a whole
model's weights when no row decodes, some adapters' (``multi_lora.AdapterSwap``) as soon as no
row of those adapters does (``sparing``), the other rows decoding on. While it waits, the rows it
would change do not join the running batch (``held``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch

from spanrl.trainer_bridge.torch_backend.engine.multi_lora import AdapterSwap, ServedAdapters
from spanrl.trainer_bridge.torch_backend.engine.requests import EngineError

ALL = object()  # in ``held``: a whole-model swap holds every row back


class PendingSwap(NamedTuple):
    """Weights waiting for their safe moment; ``outcome`` receives the error, if any."""

    state_dict: dict | AdapterSwap  # a model's weights, or its adapters' (multi_lora.py)
    version: int
    done: threading.Event
    outcome: list[BaseException]


class SwapSlot:
    """The one pending swap (thread-safe: callers put, the engine thread takes)."""

    def __init__(self) -> None:
        self.pending: PendingSwap | None = None
        self._lock = threading.Lock()

    def put(self, state_dict: dict | AdapterSwap, version: int) -> PendingSwap:
        """Queue a swap, superseding the one not applied yet (its caller gets the error now)."""
        swap = PendingSwap(state_dict, int(version), threading.Event(), [])
        with self._lock:
            superseded, self.pending = self.pending, swap
        if superseded is not None:
            superseded.outcome.append(EngineError(
                f"the weight swap to version {superseded.version} was superseded by version {swap.version} "
                f"before it was applied"))
            superseded.done.set()
        return swap

    def take(self, expected: PendingSwap | None = None) -> PendingSwap | None:
        """The pending swap, removed; with ``expected``, only if that is still the pending one (a
        swap that superseded it after it was checked waits for its own safe moment)."""
        with self._lock:
            if expected is not None and self.pending is not expected:
                return None
            swap, self.pending = self.pending, None
        return swap

    def held(self) -> frozenset[object] | None:
        """What the pending swap holds back from joining: None (nothing pending), the adapters an
        adapter-only swap changes, or everything (a ``frozenset`` containing ``ALL``)."""
        swap = self.pending
        if swap is None:
            return None
        if isinstance(swap.state_dict, AdapterSwap):
            return frozenset(swap.state_dict.weights)
        return frozenset([ALL])

    def sparing(self, running_adapters: Iterable[str | None]) -> PendingSwap | None:
        """The pending swap when it changes only adapters none of the running rows uses (it may be
        applied now, those rows decoding on); else None."""
        swap = self.pending
        if swap is None or not isinstance(swap.state_dict, AdapterSwap):
            return None
        changed = swap.state_dict.weights
        return None if any(adapter in changed for adapter in running_adapters) else swap


def load_swap(swap: PendingSwap, model: Any, adapters: ServedAdapters | None) -> None:
    """Load the swap's weights into ``model`` (or its served ``adapters``); ``EngineError`` when
    they do not match."""
    missing: list[str] = []
    unexpected: list[str] = []
    if isinstance(swap.state_dict, AdapterSwap):  # the adapters' new weights, the base unchanged
        if adapters is None:
            raise EngineError("adapter weights for an engine that serves no adapters")
        adapters.load(swap.state_dict.weights)
    else:
        with torch.no_grad():
            missing, unexpected = model.load_state_dict(swap.state_dict, strict=False)
    missing = [k for k in missing if not k.endswith("lm_head.weight")]
    if missing or unexpected:
        raise EngineError(f"the new weights do not match the model: missing {missing[:3]}, "
                          f"unexpected {list(unexpected)[:3]}")


__all__ = ["ALL", "PendingSwap", "SwapSlot", "load_swap"]
