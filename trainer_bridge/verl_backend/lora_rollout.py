"""verl's vLLM rollout replica with vLLM's own LoRA adapter loading, for per-agent adapters.

verl 0.9.1 replaces vLLM's adapter loader (``LRUCacheWorkerLoRAManager._load_adapter``) in every
vLLM worker with its own, which calls ``WeightsMapper.get_unstacked_mapper``, a method vLLM 0.32 no
longer has: every adapter load then fails. Per-agent adapters (``adapters.py``) are loaded by path
over HTTP, as vLLM documents, so the worker extension here puts vLLM's loader back.
``CPUWorkerExtension`` (``cpu_rollout.py``) builds on it; on a GPU, ``start_verl_workers``
registers ``adapter_vllm_replica`` as verl's ``vllm`` rollout when the run has adapters.
"""

from __future__ import annotations

from typing import Any

from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica


class VLLMLoRALoaderExtension(vLLMColocateWorkerExtension):
    """verl's colocated worker extension, with vLLM's own LoRA loader kept (module docstring)."""

    def __new__(cls, **kwargs: Any) -> Any:
        from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager

        own_loader = LRUCacheWorkerLoRAManager.__dict__.get("_load_adapter")
        instance = super().__new__(cls, **kwargs)  # verl patches the loader here
        if own_loader is not None:
            LRUCacheWorkerLoRAManager._load_adapter = own_loader
        elif "_load_adapter" in LRUCacheWorkerLoRAManager.__dict__:
            delattr(LRUCacheWorkerLoRAManager, "_load_adapter")  # the inherited one is vLLM's
        return instance


class AdapterVLLMHttpServer(vLLMHttpServer):
    """verl's vLLM server actor, starting vLLM with ``VLLMLoRALoaderExtension``."""

    def _get_worker_extension_cls(self) -> str:
        return f"{VLLMLoRALoaderExtension.__module__}.{VLLMLoRALoaderExtension.__qualname__}"


class AdapterVLLMReplica(vLLMReplica):
    """verl's vLLM replica whose server actor is ``AdapterVLLMHttpServer``."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        import ray

        self.server_class = ray.remote(AdapterVLLMHttpServer)


def adapter_vllm_replica() -> type[vLLMReplica]:
    """The loader verl's ``RolloutReplicaRegistry`` calls for ``vllm`` on a GPU with adapters."""
    return AdapterVLLMReplica
