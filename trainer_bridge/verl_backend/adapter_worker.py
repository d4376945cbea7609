"""verl's actor worker with one more call, for per-agent adapters: write the LoRA it trains now in
peft's format (``adapter_model.safetensors`` + ``adapter_config.json``), which vLLM loads by path
(``/v1/load_lora_adapter``) and ``peft`` loads as any adapter.

verl trains one LoRA (peft's ``default``) and syncs it into vLLM itself, under a fixed id that only
its own generation path uses, not vLLM's HTTP server (and its sync fails with vLLM 0.32: verl
0.9.1 calls a ``WeightsMapper.get_unstacked_mapper`` vLLM no longer has). The adapters backend
(``adapters.py``) therefore writes each adapter with this call and has every replica load it by
name. The tensors come from verl's own engine call (``get_per_tensor_param`` with the base already
served), which gathers FSDP's shards: every rank takes part, rank 0 writes.
"""

from __future__ import annotations

import enum
import json
import os
from typing import Any

import torch
from verl.single_controller.base.decorator import Dispatch, register
from verl.workers.engine_workers import ActorRolloutRefWorker

ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"


class AdapterActorWorker(ActorRolloutRefWorker):
    """``ActorRolloutRefWorker`` that can write its LoRA in peft's format (module docstring)."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)  # type: ignore[attr-defined]  # verl's enum, built at runtime
    def save_lora_adapter(self, path: str) -> None:
        from safetensors.torch import save_file

        assert self.actor is not None, "the actor is not initialised (init_model first)"
        # the FSDP engine's signature (the base class declares none of its keywords)
        params, peft_config = self.actor.engine.get_per_tensor_param(base_sync_done=True)  # type: ignore[call-arg]
        if peft_config is None:
            raise RuntimeError("the actor trains no LoRA adapter (actor_rollout_ref.model.lora_rank is 0)")
        tensors = {name: _full(tensor) for name, tensor in params}
        config = peft_config.to_dict() if hasattr(peft_config, "to_dict") else dict(peft_config)
        if torch.distributed.get_rank() == 0:
            os.makedirs(path, exist_ok=True)
            save_file(tensors, os.path.join(path, ADAPTER_WEIGHTS_FILE))
            with open(os.path.join(path, ADAPTER_CONFIG_FILE), "w") as f:  # peft's own file, from its config
                json.dump(config, f, indent=2, default=_json_value)


def _json_value(value: Any) -> Any:
    """What peft's config holds that JSON does not: sets (target modules), enums (task type)."""
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, enum.Enum):
        return value.value
    raise TypeError(f"{type(value).__name__} in the LoRA config is not JSON")


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A plain, contiguous CPU copy (gathered when it is a sharded DTensor)."""
    full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return full.detach().to("cpu", copy=True).contiguous()
