"""The embedded torch backend behind ``backend.PolicyBackend``: trainer, engine and server in one.

``start_backend(run)`` is what ``backend.make_backend`` calls for ``backend: torch`` (its
``options`` are ``config.TorchOptions``): a ``TorchTrainer`` (resumed from the newest checkpoint with ``resume``),
a ``PolicyEngine`` on the same weights and the OpenAI-compatible server in a child process.
``update`` runs one GRPO step and swaps the new weights into the engine, so agents keep
calling the same URL and get the new policy. With per-agent adapters (``adapters:``) the engine
serves the frozen base and every adapter at once, and ``update`` swaps in the adapters' weights;
``close`` warns once for an adapter's agent that no update had a transition of.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from spanrl.errors import UserError
from spanrl.trainer_bridge.adapter_specs import warn_unseen_agents
from spanrl.trainer_bridge.backend import BackendRun, TrainingSample, UpdateStats
from spanrl.trainer_bridge.torch_backend.checkpoints import checkpoint_name, list_checkpoints
from spanrl.trainer_bridge.torch_backend.config import TorchOptions, TrainerConfig
from spanrl.trainer_bridge.torch_backend.fine_tune import fine_tune
from spanrl.trainer_bridge.torch_backend.multi_adapter import adapter_weights, trained_adapters
from spanrl.trainer_bridge.torch_backend.trainer import TorchTrainer

if TYPE_CHECKING:
    from spanrl.trainer_bridge.torch_backend.engine.policy_engine import PolicyEngine

__all__ = ["TorchBackend", "fine_tune", "start_backend"]  # fine_tune: the warm start (backend.fine_tune)

logger = logging.getLogger(__name__)


class TorchBackend:
    """A ``PolicyBackend``: ``trainer`` updates, ``engine`` serves through ``server``.

    ``server`` is a handle of ``serve_in_process`` or ``serve_in_thread`` (``base_url``,
    ``stop()``); ``close()`` stops it (and with it the engine it started).
    """

    def __init__(self, trainer: TorchTrainer, engine: PolicyEngine, server: Any) -> None:
        self.trainer = trainer
        self.engine = engine
        self.server = server

    @property
    def policy_version(self) -> int:
        return self.trainer.policy_version

    @property
    def endpoint_url(self) -> str:
        return str(self.server.base_url)

    def update(self, samples: Sequence[TrainingSample]) -> UpdateStats:
        stats = self.trainer.grpo_step(samples)
        if self.trainer.config.adapters:  # the new weights of the adapters it trained; the base is frozen
            # (the other adapters' rows decode on meanwhile: scheduler.py)
            changed = adapter_weights(self.trainer.model, only=trained_adapters(stats))
            self.engine.swap_adapters(changed, self.trainer.policy_version)
        else:
            self.engine.swap_weights(self.trainer.policy_state_dict(), self.trainer.policy_version)
        return UpdateStats(
            policy_version=self.trainer.policy_version, step=self.trainer.step, loss=stats["loss"],
            grad_norm=stats["grad_norm"], seconds=stats["seconds"], details=stats,
        )

    def sft_update(self, samples: Sequence[TrainingSample]) -> UpdateStats:
        """One supervised (NLL) update on ``samples``' responses (``algorithm: sft``), published."""
        from spanrl.trainer_bridge.torch_backend.sft_update import sft_step

        stats = sft_step(self.trainer, samples)
        self.engine.swap_weights(self.trainer.policy_state_dict(), self.trainer.policy_version)
        return UpdateStats(
            policy_version=self.trainer.policy_version, step=self.trainer.step, loss=stats["loss"],
            grad_norm=stats["grad_norm"], seconds=stats["seconds"], details=stats,
        )

    def save_checkpoint(self, root: str) -> str:
        return str(self.trainer.save_checkpoint(os.path.join(root, checkpoint_name(self.trainer.step))))

    def close(self) -> None:
        self.server.stop()
        warn_unseen_adapter_agents(self.trainer)


def warn_unseen_adapter_agents(trainer: TorchTrainer) -> None:
    """Once per run, at its end: the adapters' agents no update had a transition of."""
    if trainer.config.adapters:
        warn_unseen_agents(trainer.config.adapter_specs, trainer.agents_seen, trainer.step)


def start_backend(run: BackendRun) -> TorchBackend:
    """Trainer, engine and HTTP server for ``run`` (``options``: ``TorchOptions``; module docstring)."""
    from spanrl.trainer_bridge.torch_backend.engine.policy_engine import PolicyEngine
    from spanrl.trainer_bridge.torch_backend.server.api_process import serve_in_process

    options: TorchOptions = run.options
    engine_config, endpoint = options.engine, run.endpoint
    if engine_config.threads > 0:  # torch intra-op threads of this process (trainer and engine)
        import torch

        torch.set_num_threads(engine_config.threads)
    if endpoint.prompts:  # a bad file is said here, not in the server's HTTP process
        from spanrl.trainer_bridge.prompt_resources import PromptResources

        PromptResources.from_file(endpoint.prompts)
    trainer, serving_dir = _start_trainer(run, options.trainer)
    engine = PolicyEngine.from_pretrained(
        serving_dir, device=engine_config.device, dtype=engine_config.dtype,
        model_name=endpoint.model_name, version=trainer.policy_version,
        max_batch_size=engine_config.max_batch_size, batch_wait_s=engine_config.batch_wait_ms / 1000.0,
        prefix_cache_mb=engine_config.prefix_cache_mb,
    )
    if trainer.config.adapters:  # every adapter served at once beside the base (engine/multi_lora.py)
        engine.attach_adapters(adapter_weights(trainer.model),
                               {spec.name: spec.agents for spec in trainer.config.adapter_specs})
    # HTTP in its own process: agents' requests are not held up by this process's training steps
    try:
        server = serve_in_process(engine, endpoint.host, endpoint.port, endpoint.token,
                                  validation_temperature=endpoint.validation_temperature,
                                  model_names=[endpoint.model_name, *endpoint.model_names], prompts=endpoint.prompts,
                                  tls_cert=endpoint.tls_cert, tls_key=endpoint.tls_key)
    except OSError as exc:  # a setting the user can change: said in one line by `spanrl train`
        engine.stop()
        raise UserError(f"the policy server cannot listen on {endpoint.host}:"
                        f"{endpoint.port} (policy_port): {exc}") from exc
    return TorchBackend(trainer, engine, server)


def _start_trainer(run: BackendRun, config: TrainerConfig) -> tuple[TorchTrainer, str]:
    """The torch trainer (resumed from the newest checkpoint with --resume) and the model
    directory the policy server should load."""
    checkpoints = run.checkpoint_dir
    if run.resume and list_checkpoints(checkpoints):
        trainer = TorchTrainer.resume(checkpoints, config)
        return trainer, str(list_checkpoints(checkpoints)[-1])
    return TorchTrainer(run.model, config), run.model
