"""verl's vLLM rollout replica on CPU: the same replica, with a weight update vLLM's CPU build takes
and vLLM's own LoRA adapter loading.

verl pushes new weights into its colocated vLLM through a worker extension that calls the
model's ``load_weights`` on each received bucket. vLLM's CPU backend repacks linear weights after
loading, so loading into the repacked parameters fails, and the received tensors are views of
a shared-memory buffer that is closed after each bucket. On CPU the extension here copies every
bucket out of the buffer and, once the last one arrived, hands the whole set to vLLM's own
``reload_weights`` (which reloads layer by layer and re-runs the post-load repacking).

``cpu_platform.load()`` registers ``cpu_vllm_replica`` as verl's ``vllm`` rollout in CPU mode
only; on a GPU machine verl's own classes run unchanged (with per-agent adapters,
``lora_rollout.py``'s).
"""

from __future__ import annotations

import logging
from typing import Any

from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica

from .lora_rollout import VLLMLoRALoaderExtension

logger = logging.getLogger(__name__)


class CPUWorkerExtension(VLLMLoRALoaderExtension):
    """verl's colocated worker extension with a CPU-safe full-model weight update, and vLLM's own
    LoRA loading (``lora_rollout.py``: per-agent adapters are loaded by path over HTTP)."""

    def update_weights_from_ipc(self, peft_config: dict | None = None, base_sync_done: bool = False,
                                use_shm: bool = False) -> None:
        if peft_config and base_sync_done:  # LoRA adapters: verl's own path
            super().update_weights_from_ipc(peft_config, base_sync_done, use_shm)
            return
        import torch
        from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver

        received: list[tuple[str, torch.Tensor]] = []

        def keep_bucket(weights: list[tuple[str, torch.Tensor]], is_last: bool) -> None:
            # the bucket's tensors are views of a buffer that is reused and then closed
            received.extend((name, tensor.detach().clone()) for name, tensor in weights)

        receiver = BucketedWeightReceiver(zmq_handle=self._get_zmq_handle(), device=torch.device("cpu"),
                                          use_shm=use_shm)
        receiver.receive_weights(on_bucket_received=keep_bucket)
        self.model_runner.reload_weights(weights_iterator=iter(received))  # type: ignore[attr-defined]
        logger.info("reloaded %d tensors into vLLM (CPU)", len(received))


class CPUvLLMHttpServer(vLLMHttpServer):
    """verl's vLLM server actor, starting vLLM with ``CPUWorkerExtension``."""

    def _get_worker_extension_cls(self) -> str:
        return f"{CPUWorkerExtension.__module__}.{CPUWorkerExtension.__qualname__}"


class CPUvLLMReplica(vLLMReplica):
    """verl's vLLM replica whose server actor is ``CPUvLLMHttpServer``."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        import ray

        self.server_class = ray.remote(CPUvLLMHttpServer)


def cpu_vllm_replica() -> type[vLLMReplica]:
    """The loader verl's ``RolloutReplicaRegistry`` calls for ``vllm`` in CPU mode."""
    return CPUvLLMReplica
