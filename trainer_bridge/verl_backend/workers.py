"""verl's machinery, started the way verl's own trainer starts it: Ray, the FSDP2 actor worker
group, the vLLM rollout replicas and the checkpoint engine that syncs weights into them.

``start_verl_workers(config, cpu_mode, ray_address, ray_num_cpus)`` returns ``VerlWorkers``;
the verl backend (``backend.py``) drives them one update at a time. This mirrors the setup part
of verl's ``RayPPOTrainer.init_workers`` (actor + rollout only: spanrl brings its own rollouts,
rewards and advantages, so verl's dataloader, reward loop and agent loop are not started).

Nothing listens beyond loopback unless the user asks for a cluster: without ``ray_address``,
Ray starts a local cluster whose node address is 127.0.0.1 (``bind_ray_to_loopback``), so its
GCS, raylet, workers and agents and the vLLM replicas (which bind the node's address) listen on
loopback only; verl's process group meets through a file instead of a TCP store (which would
listen on every address) and gloo and vLLM use the loopback interface (``local_cluster_env``).
The replicas also take an API key (``VLLM_API_KEY``, made per run, held by the gateway), so even
on a cluster (``verl.ray_address``, docs/verl.md) only the gateway reaches them.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import tempfile
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# Ray takes its node address from the route to other machines, turning even 127.0.0.1 given to
# ray.init into that address; with this (read by ray._private.ray_constants) its node address is
# 127.0.0.1, and every server of the cluster binds it. It also means "no other node can join".
RAY_LOCAL_ONLY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
# Ray's raylet starts idle Python workers ahead of tasks (up to one per CPU it offers); verl runs
# actors only, so on the local cluster they are start-up CPU spent for nothing (measured: 4 idle
# workers, ~8 CPU-seconds of an update test's ~80 on 2 cores). Read by the raylet from its
# environment, which it takes from this process.
RAY_NO_PRESTART_ENV = {"RAY_prestart_worker_first_driver": "0", "RAY_enable_worker_prestart": "0"}
REPLICA_KEY_ENV = "VLLM_API_KEY"  # vLLM's own: its OpenAI routes then require 'Bearer <key>'
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's own: /v1/load_lora_adapter exists

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
    ``checkpoints`` (the checkpoint engine manager that pushes actor weights into vLLM),
    ``replica_api_key`` (the bearer token the replicas require; only the gateway holds it)."""

    config: Any
    actor: Any
    llm_servers: Any
    checkpoints: Any
    owns_ray: bool
    replica_api_key: str | None = None
    env: dict[str, str] | None = None  # what Ray's workers were started with (local_cluster_env)

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
        rendezvous = (self.env or {}).get("DIST_INIT_METHOD", "").removeprefix("file://")
        if rendezvous and os.path.exists(rendezvous):  # torch removes it when every rank closed it cleanly
            os.remove(rendezvous)


def apply_cpu_mode_environment() -> None:
    """Select spanrl's CPU platform in this process (before verl is imported) and its children."""
    for key, value in CPU_MODE_ENV.items():
        os.environ.setdefault(key, value)


def bind_ray_to_loopback() -> None:
    """Make the local Ray cluster this process starts use 127.0.0.1 as its node address: in this
    process (Ray reads the flag when it picks the address) and in the processes it starts."""
    os.environ.update(RAY_LOCAL_ONLY_ENV)
    from ray._private import ray_constants  # imported by ray itself: set what it already read

    ray_constants.ENABLE_RAY_CLUSTER = False


def local_cluster_env() -> dict[str, str]:
    """What verl's workers need on a one-machine cluster so that none listens beyond loopback:
    their process group meets through a file (``DIST_INIT_METHOD``, read by verl; torch's TCP
    store would listen on every address), gloo pairs and vLLM's own groups on loopback."""
    rendezvous = os.path.join(tempfile.gettempdir(), f"spanrl-verl-pg-{os.getpid()}-{secrets.token_hex(8)}")
    env = {**RAY_LOCAL_ONLY_ENV, "DIST_INIT_METHOD": f"file://{rendezvous}", "VLLM_HOST_IP": "127.0.0.1"}
    if "lo" in {name for _, name in socket.if_nameindex()}:  # Linux's loopback interface
        env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


def _start_ray(cpu_mode: bool, ray_address: str, ray_num_cpus: int, replica_api_key: str,
               adapters: bool = False) -> dict[str, str] | None:
    """Start (or join) Ray with the environment verl's workers need; returns that environment
    if we started (or joined) it, None when Ray was already running in this process.

    Without ``ray_address`` the cluster is local and bound to loopback; with one, the cluster
    is the user's (its binding and access are set where it was started: ``ray start``)."""
    import ray

    if ray.is_initialized():
        return None
    env = {"TOKENIZERS_PARALLELISM": "false", "RAY_DEDUP_LOGS": "0", REPLICA_KEY_ENV: replica_api_key}
    if adapters:  # the replicas load each adapter by name over HTTP (adapters.py); only the gateway holds their key
        env[RUNTIME_LORA_ENV] = "True"
    if cpu_mode:
        env.update(CPU_MODE_ENV)
    if ray_address:
        ray.init(address=ray_address, runtime_env={"env_vars": env})
        return env
    bind_ray_to_loopback()
    os.environ.update(RAY_NO_PRESTART_ENV)
    env.update(local_cluster_env())
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
    return env


def start_verl_workers(config: Any, cpu_mode: bool, ray_address: str = "", ray_num_cpus: int = 0,
                       adapters: bool = False) -> VerlWorkers:
    """Ray, the actor worker group (model loaded), the vLLM replicas (serving), weights synced.
    ``adapters``: the actor can write its LoRA for vLLM (``adapter_worker.py``), the replicas load
    adapters by name, and no weights are synced (the base is frozen and the replicas loaded it)."""
    replica_api_key = secrets.token_urlsafe(32)
    env = _start_ray(cpu_mode, ray_address, ray_num_cpus, replica_api_key, adapters)
    import ray
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup
    from verl.single_controller.ray.base import create_colocated_worker_cls
    from verl.trainer.ppo.ray_trainer import ResourcePoolManager
    from verl.trainer.ppo.utils import Role
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.engine_workers import ActorRolloutRefWorker
    from verl.workers.rollout.llm_server import LLMServerManager

    if cpu_mode or adapters:
        from verl.workers.rollout.replica import RolloutReplicaRegistry

        if cpu_mode:
            from .cpu_rollout import cpu_vllm_replica

            RolloutReplicaRegistry.register("vllm", cpu_vllm_replica)
        else:  # a GPU: verl's replica, with vLLM's own LoRA loader (lora_rollout.py)
            from .lora_rollout import adapter_vllm_replica

            RolloutReplicaRegistry.register("vllm", adapter_vllm_replica)

    # the reference policy (KL loss) lives in the same worker, as verl's trainer arranges it
    role: Any = Role.ActorRolloutRef if config.actor_rollout_ref.actor.use_kl_loss else Role.ActorRollout
    pools = ResourcePoolManager(
        resource_pool_spec={"global_pool": [config.trainer.n_gpus_per_node] * config.trainer.nnodes},
        mapping={role: "global_pool"},
    )
    pools.create_resource_pool()
    pool = pools.get_resource_pool(role)
    worker_class: Any = ActorRolloutRefWorker
    if adapters:
        from .adapter_worker import AdapterActorWorker

        worker_class = AdapterActorWorker
    worker = RayClassWithInitArgs(cls=ray.remote(worker_class), config=config.actor_rollout_ref, role=str(role))
    group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=create_colocated_worker_cls({str(role): worker}),
                           device_name=config.trainer.device)
    actor = group.spawn(prefix_set=[str(role)])[str(role)]
    actor.init_model()
    logger.info("verl actor workers ready (%s ranks)", actor.world_size)

    llm_servers = LLMServerManager.create(config=config, worker_group=actor, rollout_resource_pool=pool)
    engine_config = omega_conf_to_dataclass(config.actor_rollout_ref.rollout.checkpoint_engine)
    checkpoints = CheckpointEngineManager(config=engine_config, actor_wg=actor, replicas=llm_servers.get_replicas())
    workers = VerlWorkers(config=config, actor=actor, llm_servers=llm_servers, checkpoints=checkpoints,
                          owns_ray=env is not None, replica_api_key=replica_api_key if env is not None else None,
                          env=env)
    if not adapters:
        checkpoints.sleep_replicas()
        workers.sync_weights(0)
    logger.info("vLLM replicas serving at %s", ", ".join(workers.server_urls))
    return workers
