"""verl's machinery, started the way verl's own trainer starts it: Ray, the FSDP2 actor worker
group, the vLLM rollout replicas and the checkpoint engine that syncs weights into them.

``start_verl_workers(config, cpu_mode, ray_address, ray_num_cpus)`` returns ``VerlWorkers``;
the verl backend (``backend.py``) drives them one update at a time. This mirrors the setup part
of verl's ``RayPPOTrainer.init_workers`` (actor + rollout only: spanrl brings its own rollouts,
rewards and advantages, so verl's dataloader, reward loop and agent loop are not started).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# environment every verl process needs in CPU mode (the driver sets it too, before importing verl)
CPU_MODE_ENV = {
    "VERL_PLATFORM": "spanrl-cpu",
    # verl registers its FSDP engines for cuda/npu; the platform then supplies the CPU device
    "VERL_ENGINE_DEVICE": "cuda",
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}


@dataclass
class VerlWorkers:
    """The running verl parts: ``actor`` (worker group), ``llm_servers`` (vLLM replicas' manager),
    ``checkpoints`` (the checkpoint engine manager that pushes actor weights into vLLM)."""

    config: Any
    actor: Any
    llm_servers: Any
    checkpoints: Any
    owns_ray: bool

    @property
    def server_urls(self) -> list[str]:
        """Base URLs (``http://host:port``) of the vLLM replicas."""
        return [address if address.startswith("http") else f"http://{address}"
                for address in self.llm_servers.server_addresses]

    @property
    def data_parallel_size(self) -> int:
        """How many actor ranks a batch is split over (batches are padded to a multiple of it)."""
        mapping = self.actor._dispatch_info.get("actor")
        if mapping is None:
            mapping = self.actor._query_dispatch_info("actor")
            self.actor._dispatch_info["actor"] = mapping
        return max(mapping) + 1

    def sync_weights(self, version: int) -> None:
        """Push the actor's weights into every vLLM replica (they serve them from then on)."""
        self.checkpoints.update_weights(version)

    def shutdown(self) -> None:
        import ray

        if self.owns_ray and ray.is_initialized():
            ray.shutdown()


def apply_cpu_mode_environment() -> None:
    """Select spanrl's CPU platform in this process (before verl is imported) and its children."""
    for key, value in CPU_MODE_ENV.items():
        os.environ.setdefault(key, value)


def _start_ray(cpu_mode: bool, ray_address: str, ray_num_cpus: int) -> bool:
    """Start (or join) Ray with the environment verl's workers need; True if we started it."""
    import ray

    if ray.is_initialized():
        return False
    env = {"TOKENIZERS_PARALLELISM": "false", "RAY_DEDUP_LOGS": "0"}
    if cpu_mode:
        env.update(CPU_MODE_ENV)
    if ray_address:
        ray.init(address=ray_address, runtime_env={"env_vars": env})
        return True
    options: dict[str, Any] = {"runtime_env": {"env_vars": env}, "include_dashboard": False}
    if cpu_mode:
        # verl places workers on Ray "GPU" resources; CPU mode offers one per actor rank (a
        # label only: CPU torch ignores the CUDA_VISIBLE_DEVICES Ray sets) and enough CPUs for
        # the worker, the vLLM server and its engine processes on a small machine
        options["num_gpus"] = 1
        options["num_cpus"] = max(ray_num_cpus, 8)
    elif ray_num_cpus:
        options["num_cpus"] = ray_num_cpus
    ray.init(**options)
    return True


def start_verl_workers(config: Any, cpu_mode: bool, ray_address: str = "", ray_num_cpus: int = 0) -> VerlWorkers:
    """Ray, the actor worker group (model loaded), the vLLM replicas (serving), weights synced."""
    owns_ray = _start_ray(cpu_mode, ray_address, ray_num_cpus)
    import ray
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup
    from verl.single_controller.ray.base import create_colocated_worker_cls
    from verl.trainer.ppo.ray_trainer import ResourcePoolManager
    from verl.trainer.ppo.utils import Role
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.engine_workers import ActorRolloutRefWorker
    from verl.workers.rollout.llm_server import LLMServerManager

    if cpu_mode:
        from verl.workers.rollout.replica import RolloutReplicaRegistry

        from .cpu_rollout import cpu_vllm_replica

        RolloutReplicaRegistry.register("vllm", cpu_vllm_replica)

    # the reference policy (KL loss) lives in the same worker, as verl's trainer arranges it
    role: Any = Role.ActorRolloutRef if config.actor_rollout_ref.actor.use_kl_loss else Role.ActorRollout
    pools = ResourcePoolManager(
        resource_pool_spec={"global_pool": [config.trainer.n_gpus_per_node] * config.trainer.nnodes},
        mapping={role: "global_pool"},
    )
    pools.create_resource_pool()
    pool = pools.get_resource_pool(role)
    worker = RayClassWithInitArgs(cls=ray.remote(ActorRolloutRefWorker), config=config.actor_rollout_ref,
                                  role=str(role))
    group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=create_colocated_worker_cls({str(role): worker}),
                           device_name=config.trainer.device)
    actor = group.spawn(prefix_set=[str(role)])[str(role)]
    actor.init_model()
    logger.info("verl actor workers ready (%s ranks)", actor.world_size)

    llm_servers = LLMServerManager.create(config=config, worker_group=actor, rollout_resource_pool=pool)
    engine_config = omega_conf_to_dataclass(config.actor_rollout_ref.rollout.checkpoint_engine)
    checkpoints = CheckpointEngineManager(config=engine_config, actor_wg=actor, replicas=llm_servers.get_replicas())
    workers = VerlWorkers(config=config, actor=actor, llm_servers=llm_servers, checkpoints=checkpoints,
                          owns_ray=owns_ray)
    checkpoints.sleep_replicas()
    workers.sync_weights(0)
    logger.info("vLLM replicas serving at %s", ", ".join(workers.server_urls))
    return workers
