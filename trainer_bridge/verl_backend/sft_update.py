"""The verl backend's supervised update (``algorithm: sft``): verl's own SFT loss on the actor.

verl 0.9.1 trains SFT with ``verl.trainer.sft_trainer(_ray)``, a separate trainer over its own
dataset and its own ``TrainingWorker`` group. spanrl already holds the actor worker group that
vLLM's weights are synced from, so it does what that trainer does on that group instead:

- the loss function: ``ActorRolloutRefWorker.set_loss_fn`` with
  ``partial(verl.workers.utils.losses.sft_loss, config=None)`` (exactly what
  ``sft_trainer_ray`` passes to its workers) replaces the PPO loss of the worker's actor;
  ``sft_loss`` is the negative log-likelihood of the tokens under ``loss_mask``, summed and
  divided by the mini-batch's ``loss_mask`` tokens over all data-parallel ranks (token-mean);
- the data: the same batch as a GRPO update (``batch.py``), in verl's no-padding layout, with
  ``loss_mask`` replaced by what ``sft_loss`` reads in that layout (a jagged tensor over the
  whole sequence, 1 on the response tokens: it shifts it by one itself), and temperature 1.0
  (as the SFT trainer sets it: the model's own distribution);
- the step: ``update_actor`` on the whole batch as one mini-batch (one optimizer step, with
  the actor's optimizer, clipping and learning rate).

No old log-probs, ratio, clipping or advantages take part: an update with advantages 1 through
the PPO loss would still clip the ratio and is not SFT. Once switched, the worker keeps the
SFT loss (a run has one ``algorithm``); ``VerlBackend.update`` refuses GRPO afterwards.
Called by ``VerlBackend._train_and_sync``.
"""

from __future__ import annotations

from typing import Any

SFT_TEMPERATURE = 1.0


def use_sft_loss(workers: Any) -> None:
    """Make the actor worker group train with verl's ``sft_loss`` from now on."""
    from functools import partial

    from verl.workers.utils.losses import sft_loss

    # config=None as verl's sft_trainer_ray passes it: sft_loss never reads its config
    workers.actor.set_loss_fn(partial(sft_loss, config=None))  # type: ignore[arg-type]


def sft_tensordict(data: Any, actor_config: Any) -> Any:
    """``data`` (a padded ``DataProto`` from ``build_verl_batch``) as ``update_actor`` takes it
    for ``sft_loss``: the whole batch one mini-batch, the loss mask over the full sequence."""
    import torch

    from .batch import to_worker_tensordict

    size = len(data)
    prompt_width = data.batch["prompts"].shape[1]
    attention = data.batch["attention_mask"].bool()
    full_mask = torch.cat([torch.zeros((size, prompt_width), dtype=data.batch["response_mask"].dtype),
                           data.batch["response_mask"]], dim=1)
    td = to_worker_tensordict(
        data, calculate_entropy=False, distillation_use_topk=False, distillation_only=False,
        global_batch_size=size, mini_batch_size=size, epochs=1, seed=actor_config.data_loader_seed,
        dataloader_kwargs={"shuffle": False}, compute_loss=True, temperature=SFT_TEMPERATURE,
    )
    # the real tokens of each row in order, as input_ids' jagged values are laid out
    td["loss_mask"] = torch.nested.nested_tensor_from_jagged(full_mask[attention], offsets=td["input_ids"].offsets())
    return td


def sft_actor_update(workers: Any, data: Any) -> dict[str, float]:
    """One SFT step of the actor on ``data``; verl's metrics (``loss``: the mean NLL per
    response token before the step, ``grad_norm``, ``lr``, ...)."""
    from verl.utils import tensordict_utils as tu

    from .metrics import flatten_metrics

    td = sft_tensordict(data, workers.config.actor_rollout_ref.actor)
    output = workers.actor.update_actor(td)
    metrics = flatten_metrics(tu.get(output, "metrics"))
    if "loss" in metrics:
        metrics["sft_nll"] = metrics["loss"]
    return metrics
