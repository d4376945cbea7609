"""Several LoRA adapters served at once on the engine's base model, rows of different adapters in
one forward pass (segment-wise LoRA, as S-LoRA and vLLM's multi-LoRA do).

``ServedAdapters.attach(model, weights, agents)`` hooks every Linear an adapter targets. Each such
module keeps its adapters stacked: ``A`` [N+1, r, in] and ``scaling * B`` [N+1, out, r], slot 0
all zeros (the base model: a row without an adapter), ranks zero-padded to the largest (the
padding adds nothing). Before each forward pass the scheduler sets each row's slot
(``set_rows``); the hook then gathers each row's ``A`` and ``B`` and adds
``bmm(bmm(x, A_row^T), B_row^T)`` to the base layer's output: one batched matmul pair per module
for the whole batch, whatever mix of adapters it holds. A batch of base rows only skips the hooks'
work. Weight swaps replace the stacks' values in place (``load``): a swap of some adapters only
as soon as none of their rows decodes, the rows of the base and of other adapters going on
(``scheduler.py``). The weights come from the trainer (``multi_adapter.adapter_weights``):
adapter -> HF module path -> (``A`` [r, in], ``scaling * B`` [out, r]).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from spanrl.trainer_bridge.torch_backend.engine.requests import EngineError

AdapterWeights = Mapping[str, Mapping[str, tuple[torch.Tensor, torch.Tensor]]]


@dataclass(frozen=True)
class AdapterSwap:
    """New weights of the adapters, queued like a weight swap (``Scheduler.swap_weights``)."""

    weights: AdapterWeights


class ServedAdapters:
    """The adapters of one engine (module docstring): their slots, stacks, agents and hooks."""

    def __init__(self, names: list[str], agents: Mapping[str, tuple[str, ...]]):
        self.slots = {name: number for number, name in enumerate(names, start=1)}
        self.agents = {name: tuple(agents.get(name, ())) for name in names}
        self.stacks: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.rows: torch.Tensor | None = None  # each row's slot for the next forward pass; None: all base
        self._handles: list[Any] = []
        self.device: torch.device | None = None

    @classmethod
    def attach(cls, model: Any, weights: AdapterWeights, agents: Mapping[str, tuple[str, ...]]) -> ServedAdapters:
        """Hook ``model``'s adapted Linears and load ``weights`` (every adapter, every module)."""
        served = cls(list(weights), agents)
        modules = dict(model.named_modules())
        parameter = next(model.parameters())
        served.device = parameter.device
        paths = sorted({path for per_module in weights.values() for path in per_module})
        for path in paths:
            module = modules.get(path)
            if not isinstance(module, torch.nn.Linear):
                raise EngineError(f"the adapters adapt {path!r}, which is not a Linear layer of the served model")
            rank = max(per_module[path][0].shape[0] for per_module in weights.values() if path in per_module)
            slots = len(served.slots) + 1
            served.stacks[path] = (
                torch.zeros(slots, rank, module.in_features, dtype=parameter.dtype, device=parameter.device),
                torch.zeros(slots, module.out_features, rank, dtype=parameter.dtype, device=parameter.device))
            served._handles.append(module.register_forward_hook(served._hook(path)))
        served.load(weights)
        return served

    def _hook(self, path: str) -> Any:
        def add_lora(_module: Any, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
            slots = self.rows
            if slots is None:
                return None
            a, b = self.stacks[path]
            x = args[0]
            flat = x.dim() == 2  # [rows, in]: one token a row
            rows_x = x.unsqueeze(1) if flat else x
            delta = torch.bmm(torch.bmm(rows_x, a[slots].transpose(1, 2)), b[slots].transpose(1, 2))
            return output + (delta.squeeze(1) if flat else delta)

        return add_lora

    def load(self, weights: AdapterWeights) -> None:
        """Replace the adapters' values in place; the same adapters, modules and ranks as attached."""
        unknown = set(weights) - set(self.slots)
        if unknown:
            raise EngineError(f"weights of adapters the engine does not serve: {sorted(unknown)}")
        with torch.no_grad():
            for name, per_module in weights.items():
                slot = self.slots[name]
                for path, (a, b) in per_module.items():
                    if path not in self.stacks:
                        raise EngineError(f"adapter {name!r} adapts {path!r}, which it did not when it was attached")
                    stack_a, stack_b = self.stacks[path]
                    rank = a.shape[0]
                    stack_a[slot].zero_()
                    stack_b[slot].zero_()
                    stack_a[slot, :rank].copy_(a)
                    stack_b[slot, :, :rank].copy_(b)

    def slot(self, adapter: str | None) -> int:
        """The stack slot of ``adapter`` (0: the base model); ``EngineError`` for an unknown name."""
        if adapter is None:
            return 0
        found = self.slots.get(adapter)
        if found is None:
            raise EngineError(f"the engine serves no adapter {adapter!r} (it serves {sorted(self.slots)})", "model")
        return found

    def set_rows(self, adapters: list[str | None]) -> None:
        """The adapter of each row of the next forward pass, in the batch's row order."""
        slots = [self.slot(name) for name in adapters]
        self.rows = torch.tensor(slots, dtype=torch.long, device=self.device) if any(slots) else None

    def detach(self) -> None:
        """Remove the hooks: the model is the base model again."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.rows = None


__all__ = ["AdapterSwap", "AdapterWeights", "ServedAdapters"]
