"""The verl backend behind ``backend.PolicyBackend``: verl's FSDP2 workers update, vLLM serves.

``start_backend(run)`` is what ``backend.make_backend`` calls for ``backend: verl``, with a
``BackendRun`` whose ``options`` are the ``verl:`` block. It composes verl's own config from the
run (``config.py``: the neutral algorithm config mapped onto verl's actor), starts
Ray, verl's actor workers and vLLM replicas (``workers.py``) and the gateway that gives agents
one stable URL in front of the replicas (``gateway.py``). Each ``update``:

1. builds verl's batch from spanrl's samples (``batch.py``; advantages already computed by
   spanrl, so both backends train on the same numbers),
2. holds new agent requests at the gateway and puts the replicas to sleep (they share the GPUs),
3. recomputes the old log-probs (and the reference's, with a KL loss), weighs late rollouts'
   tokens by verl's truncated importance sampling when asked (``off_policy.py``) and runs
   verl's actor update (its PPO/GRPO loss, optimizer and clipping),
4. syncs the new weights into vLLM through verl's checkpoint engine, bumps the policy version
   and lets requests through again.

With per-agent adapters (``adapters:``) steps 3-4 run once per adapter whose agents sent
transitions, that adapter's state loaded into verl's LoRA actor, and vLLM loads each new adapter
by name instead of a weight sync (``adapters.py``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from spanrl.errors import UserError
from spanrl.trainer_bridge.backend import (
    BackendRun,
    BackendUnavailable,
    TrainingSample,
    UpdateStats,
    make_owner_only_dir,
)

from .checkpoints import ADAPTERS_FOLDER, latest_checkpoint, prune_checkpoints, write_version
from .metrics import flatten_metrics

if TYPE_CHECKING:
    from .adapters import VerlAdapters
    from .config import VerlConfig
    from .gateway import GatewayConfig

logger = logging.getLogger(__name__)

INSTALL_HINT = ("install the verl backend: pip install 'spanrl[verl-cpu]' (no GPU) or 'spanrl[verl]' (GPU), then "
                "pip install --no-deps verl==0.9.1 (README: 'Training with verl')")


def check_verl_installed() -> None:
    """One clear line when verl or vLLM is missing (instead of an import traceback)."""
    import importlib.util

    missing = [name for name in ("verl", "vllm", "ray") if importlib.util.find_spec(name) is None]
    if missing:
        raise BackendUnavailable(f"backend 'verl' needs {', '.join(missing)}, not installed here: {INSTALL_HINT}")


class VerlWorkerFailed(UserError):
    """A verl worker or vLLM replica died during an update (one line, not a hang)."""


class VerlBackend:
    """A ``PolicyBackend`` over verl's workers and vLLM replicas, behind one gateway URL."""

    def __init__(self, run: BackendRun, workers: Any, gateway: Any, tokenizer: Any,
                 policy_version: int = 0, step: int = 0, adapters: VerlAdapters | None = None) -> None:
        self.run = run
        self.adapters = adapters  # per-agent LoRA adapters (adapters.py); None: one policy
        self.verl: VerlConfig = run.options
        self.workers = workers
        self.gateway = gateway
        self.tokenizer = tokenizer
        self._policy_version = policy_version
        self.step = step
        self._sft_loss_set = False  # the actor's loss is verl's sft_loss (algorithm: sft) once set
        gateway.set_policy_version(policy_version)

    @property
    def policy_version(self) -> int:
        return self._policy_version

    @property
    def endpoint_url(self) -> str:
        return str(self.gateway.url)

    # ------------------------------------------------------------------ update

    @property
    def _correcting(self) -> bool:
        """Whether updates weigh off-policy tokens by verl's truncated IS (``off_policy.py``)."""
        return self.run.algorithm.rollout_is_cap > 0

    def _batch(self, samples: Sequence[TrainingSample], correct: bool = False) -> Any:
        """verl's batch of ``samples``, padded with the tokenizer's pad id (eos when it has none)."""
        from .batch import build_verl_batch

        verl = self.verl
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        correct_before = self._policy_version if correct and self._correcting else None
        return build_verl_batch(samples, pad_token_id=int(pad_id), max_prompt_length=verl.max_prompt_length,
                                max_response_length=verl.max_response_length, temperature=verl.temperature,
                                correct_before=correct_before)

    def update(self, samples: Sequence[TrainingSample]) -> UpdateStats:
        if self._sft_loss_set:
            raise UserError("this verl backend trains with the SFT loss (algorithm: sft); a GRPO update needs a "
                            "fresh backend")
        return self._update(samples, sft=False)

    def sft_update(self, samples: Sequence[TrainingSample]) -> UpdateStats:
        """One supervised (NLL) update with verl's ``sft_loss`` (``sft_update.py``), published."""
        return self._update(samples, sft=True)

    @contextmanager
    def _paused(self) -> Iterator[None]:
        """New agent requests wait at the gateway meanwhile; a dead worker or replica is one
        clear error (``VerlWorkerFailed``), not a hang."""
        self.gateway.pause()
        try:
            yield
        except Exception as exc:
            if type(exc).__module__.startswith("ray."):
                raise VerlWorkerFailed(f"verl backend: a worker or vLLM replica failed during update "
                                       f"{self.step + 1} ({type(exc).__name__}: {str(exc).splitlines()[0][:300]}); "
                                       "its log is in Ray's session logs (/tmp/ray/session_latest/logs)") from exc
            raise
        finally:
            self.gateway.resume()

    def _update(self, samples: Sequence[TrainingSample], sft: bool) -> UpdateStats:
        if self.adapters is not None:
            if sft:
                raise UserError("adapters: (one LoRA per agent) trains with algorithm grpo only")
            return self._adapters_update(samples)
        started = time.perf_counter()
        batch = self._batch(samples, correct=not sft)
        data = pad_to_multiple(batch.data, self.workers.data_parallel_size)
        timings: dict[str, float] = {"batch_s": time.perf_counter() - started}
        with self._paused():
            metrics = self._train_and_sync(data, timings, sft)
        self._checkpoint_if_due()
        seconds = time.perf_counter() - started
        details = {**metrics, **timings, "dropped_overlong": float(batch.dropped_overlong),
                   "samples": float(len(samples) - batch.dropped_overlong - batch.dropped_empty
                                    - batch.dropped_no_logprobs)}
        if self._correcting and not sft:  # off_policy_rollouts: correct (off_policy.py)
            details.update(late_rollouts_corrected=float(batch.late_rollouts),
                           dropped_no_logprobs=float(batch.dropped_no_logprobs))
        loss = metrics.get("loss", 0.0) if sft else metrics.get("pg_loss", 0.0)
        return UpdateStats(policy_version=self._policy_version, step=self.step, loss=float(loss),
                           grad_norm=float(metrics.get("grad_norm", 0.0)), seconds=seconds, details=details)

    def _checkpoint_if_due(self) -> None:
        every = self.run.checkpoint_every
        if every and self.step % every == 0:
            self.save_checkpoint(self.run.checkpoint_dir)

    def _adapters_update(self, samples: Sequence[TrainingSample]) -> UpdateStats:
        """One update of every adapter whose agents sent transitions, each on its own (adapters.py),
        replicas asleep meanwhile; then each trained adapter is served. One new policy version."""
        assert self.adapters is not None
        started = time.perf_counter()

        def train(group: Sequence[TrainingSample]) -> dict[str, float]:
            batch = self._batch(group, correct=True)
            data, correction = self._add_log_probs(pad_to_multiple(batch.data, self.workers.data_parallel_size))
            return {**self._update_actor(data), **correction, "dropped_overlong": float(batch.dropped_overlong)}

        with self._paused():
            self.workers.checkpoints.sleep_replicas()
            per_adapter = self.adapters.update(samples, train)
            if self.workers.config.actor_rollout_ref.rollout.free_cache_engine:  # they slept (never in CPU mode)
                self.workers.checkpoints.wake_up_replicas()
            for name, metrics in per_adapter.items():
                mark = time.perf_counter()
                self.adapters.publish(name)
                metrics["publish_s"] = time.perf_counter() - mark
            self._policy_version += 1
            self.step += 1
            self.gateway.set_policy_version(self._policy_version)
        self._checkpoint_if_due()
        from .adapters import adapter_details

        details = adapter_details(per_adapter)
        return UpdateStats(policy_version=self._policy_version, step=self.step, loss=details["pg_loss"],
                           grad_norm=details["grad_norm"], seconds=time.perf_counter() - started, details=details)

    def _train_and_sync(self, data: Any, timings: dict[str, float], sft: bool = False) -> dict[str, float]:
        """Old log-probs, verl's actor update (or its SFT step) and the weight sync, replicas
        asleep meanwhile; the update's metrics."""
        self.workers.checkpoints.sleep_replicas()
        if sft:
            from .sft_update import sft_actor_update, use_sft_loss

            if not self._sft_loss_set:
                use_sft_loss(self.workers)
                self._sft_loss_set = True
            mark = time.perf_counter()
            metrics = sft_actor_update(self.workers, data)
        else:
            mark = time.perf_counter()
            data, correction = self._add_log_probs(data)
            timings["old_log_prob_s"] = time.perf_counter() - mark
            mark = time.perf_counter()
            metrics = {**self._update_actor(data), **correction}
        timings["update_s"] = time.perf_counter() - mark
        mark = time.perf_counter()
        self.workers.sync_weights(self._policy_version + 1)
        timings["weight_sync_s"] = time.perf_counter() - mark
        self._policy_version += 1
        self.step += 1
        self.gateway.set_policy_version(self._policy_version)
        return metrics

    def log_probs(self, samples: Sequence[TrainingSample], adapter: str | None = None) -> list[list[float]]:
        """The actor's log-prob of each response token of ``samples`` (verl's own forward pass);
        with per-agent adapters, under ``adapter`` (its state loaded into the actor first)."""
        if self.adapters is not None:
            if adapter is None:
                raise UserError("this verl backend trains per-agent adapters: name the adapter to score with")
            self.adapters.activate(adapter)
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import no_padding_2_padding

        from .batch import to_worker_tensordict

        data = pad_to_multiple(self._batch(samples).data, self.workers.data_parallel_size)
        td = to_worker_tensordict(data, calculate_entropy=False, compute_loss=False)
        values = no_padding_2_padding(tu.get(self.workers.actor.compute_log_prob(td), "log_probs"), td)
        return [values[i, : len(sample.response_token_ids)].tolist() for i, sample in enumerate(samples)]

    def _add_log_probs(self, data: Any) -> tuple[Any, dict[str, float]]:
        """``old_log_probs``: the engine's when every sample has them (and no correction), else
        recomputed by verl's workers as verl's trainer does; ``ref_log_prob`` too with a KL loss;
        with the correction, verl's ``rollout_is_weights`` (``off_policy.py``) and its statistics."""
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import no_padding_2_padding

        from .batch import to_worker_tensordict

        correction: dict[str, float] = {}
        if "rollout_log_probs" in data.batch.keys() and not self._correcting:
            # the engine's log-probs are the old policy's, as the embedded trainer takes them
            # (verl's "bypass" mode): no recomputation
            data.batch["old_log_probs"] = data.batch["rollout_log_probs"].clone()
        else:
            td = to_worker_tensordict(data, calculate_entropy=True, compute_loss=False)
            output = self.workers.actor.compute_log_prob(td)
            data.batch["old_log_probs"] = no_padding_2_padding(tu.get(output, "log_probs"), td).float()
        if self._correcting:
            from .off_policy import correct_off_policy

            data, correction = correct_off_policy(data, self.workers.config.algorithm.rollout_correction)
        if self.workers.config.actor_rollout_ref.actor.use_kl_loss:
            td = to_worker_tensordict(data, calculate_entropy=False, compute_loss=False)
            output = self.workers.actor.compute_ref_log_prob(td)
            data.batch["ref_log_prob"] = no_padding_2_padding(tu.get(output, "log_probs"), td).float()
        return data, correction

    def _update_actor(self, data: Any) -> dict[str, float]:
        """verl's actor update on the whole batch as one mini-batch (one optimizer step per
        ppo_epoch, as the embedded trainer does); its metrics averaged over micro-batches."""
        from verl.utils import tensordict_utils as tu

        from .batch import to_worker_tensordict

        actor_config = self.workers.config.actor_rollout_ref.actor
        size = len(data)
        td = to_worker_tensordict(
            data, calculate_entropy=False, distillation_use_topk=False, distillation_only=False,
            global_batch_size=size, mini_batch_size=size, epochs=actor_config.ppo_epochs,
            seed=actor_config.data_loader_seed, dataloader_kwargs={"shuffle": False}, compute_loss=True,
        )
        output = self.workers.actor.update_actor(td)
        return flatten_metrics(tu.get(output, "metrics"))

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, root: str) -> str:
        """verl's checkpoint of the actor (model, optimizer, RNG; resumable) under
        ``root/step-N/actor``; returns the Hugging Face model verl writes inside it."""
        path = os.path.join(os.path.abspath(root), f"step-{self.step:06d}")
        make_owner_only_dir(path)  # verl writes inside: weights and optimizer state stay the user's
        if self.adapters is not None:  # the adapters in peft's format (+ their verl state); the base is the run's
            self.adapters.save(os.path.join(path, ADAPTERS_FOLDER))
            write_version(path, self._policy_version, self.step)
            prune_checkpoints(root, self.verl.keep_checkpoints)
            return os.path.join(path, ADAPTERS_FOLDER)
        keep = self.verl.keep_checkpoints or None
        self.workers.actor.save_checkpoint(os.path.join(path, "actor"), None, self.step, keep)
        write_version(path, self._policy_version, self.step)
        return os.path.join(path, "actor", "huggingface")


    def close(self) -> None:
        try:
            self.gateway.stop()
        finally:
            self.workers.shutdown()
        if self.adapters is not None:
            from spanrl.trainer_bridge.adapter_specs import warn_unseen_agents

            warn_unseen_agents(self.adapters.specs, self.adapters.agents_seen, self.step)


def pad_to_multiple(data: Any, multiple: int) -> Any:
    """``data`` with copies of its first rows appended until its length divides ``multiple``
    (verl splits a batch evenly over the actor ranks); copies weigh nothing: response_mask 0."""
    import torch
    from verl.protocol import DataProto

    missing = (-len(data)) % multiple
    if missing == 0:
        return data
    filler = data[list(range(missing))] if len(data) >= missing else data[[0] * missing]
    filler.batch["response_mask"] = torch.zeros_like(filler.batch["response_mask"])
    filler.batch["advantages"] = torch.zeros_like(filler.batch["advantages"])
    return DataProto.concat([data, filler])


def check_backend(run: BackendRun) -> bool:
    """What can be known before starting anything: a model directory, CPU mode possible or a
    GPU there, verl and vLLM installed (one line each). Returns whether CPU mode is on."""
    from .config import resolve_cpu_mode

    if not os.path.isfile(os.path.join(run.model, "config.json")):
        raise UserError(f"model {run.model!r} is not a Hugging Face model directory (no config.json); "
                        "create one with `spanrl model init DIR`")
    cpu_mode = resolve_cpu_mode(run.options)
    check_verl_installed()
    return cpu_mode


def gateway_config(run: BackendRun, upstream_api_key: str | None = None,
                   adapters: tuple[tuple[str, tuple[str, ...]], ...] = ()) -> GatewayConfig:
    """The gateway's settings for ``run``: the endpoint agents call (its names, its bearer token,
    validation rollouts' temperature, prompt resources, TLS) and the ``verl:`` block's sampling
    temperature and pause wait; ``upstream_api_key``: the key verl's replicas require;
    ``adapters``: the per-agent adapters the replicas serve (adapter -> agents)."""
    from .gateway import GatewayConfig

    verl, endpoint = run.options, run.endpoint
    return GatewayConfig(host=endpoint.host, port=endpoint.port, served_model_name=endpoint.model_name,
                         model_names=endpoint.model_names, api_token=endpoint.token, temperature=verl.temperature,
                         validation_temperature=endpoint.validation_temperature, pause_wait_s=verl.pause_wait_s,
                         prompts=endpoint.prompts, upstream_api_key=upstream_api_key, tls_cert=endpoint.tls_cert,
                         tls_key=endpoint.tls_key, adapters=adapters)


def start_backend(run: BackendRun) -> VerlBackend:
    """verl's workers and vLLM replicas for ``run``, behind a gateway (module docstring)."""
    from .config import verl_overrides

    cpu_mode = check_backend(run)
    from .workers import apply_cpu_mode_environment

    if cpu_mode:
        apply_cpu_mode_environment()
    from transformers import AutoTokenizer

    from spanrl.trainer_bridge.relay.server_thread import listening_socket

    from .config import compose_verl_config
    from .gateway import start_gateway
    from .workers import start_verl_workers

    verl = run.options
    tokenizer = AutoTokenizer.from_pretrained(run.model)
    config = compose_verl_config(verl_overrides(run, cpu_mode))
    # Held from here: a taken port fails before minutes of start, and Ray's and vLLM's processes
    # cannot take it while the workers come up.
    gateway_socket = listening_socket("gateway", run.endpoint.host, run.endpoint.port)
    try:
        workers = start_verl_workers(config, cpu_mode, verl.ray_address, verl.ray_num_cpus,
                                     adapters=bool(run.adapters))
    except BaseException:
        gateway_socket.close()
        raise
    policy_version, step, adapters = 0, 0, None
    try:
        latest = latest_checkpoint(run.checkpoint_dir) if run.resume else None
        if latest is not None:
            path, policy_version, step = latest
        if run.adapters:
            from .adapters import VerlAdapters

            adapters = VerlAdapters(run.adapters, workers, run.output_dir)
            adapters.start(saved=os.path.join(latest[0], ADAPTERS_FOLDER) if latest is not None else None)
        elif latest is not None:
            workers.actor.load_checkpoint(os.path.join(latest[0], "actor"))
            workers.sync_weights(policy_version)
        if latest is not None:
            logger.info("resumed from %s (policy version %d)", latest[0], policy_version)
        gateway = start_gateway(
            gateway_config(run, upstream_api_key=workers.replica_api_key,
                           adapters=adapters.agents if adapters is not None else ()),
            workers.server_urls,
            bound=gateway_socket,
        )
    except BaseException:
        gateway_socket.close()
        workers.shutdown()
        raise
    return VerlBackend(run, workers, gateway, tokenizer, policy_version=policy_version, step=step, adapters=adapters)
