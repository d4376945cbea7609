"""One supervised (NLL) update of the torch trainer on rollout transitions (``algorithm: sft``).

``TorchBackend.sft_update`` calls ``sft_step(trainer, samples)``: the samples' response tokens
are learned as they are (``sft.encode_example`` of a ``TokenExample``, as the warm start from
a store does), the loss is their mean negative log-likelihood over all response tokens of the
batch, cut into micro-batches by the trainer's token budget; one step of the trainer's main
optimizer (the one its checkpoints save), gradient clipping as GRPO's. Like ``grpo_step`` it
counts a step, a new policy version and the periodic checkpoint.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from spanrl.trainer_bridge.backend import TokenExample, TrainingSample
from spanrl.trainer_bridge.torch_backend.checkpoints import save_periodic_checkpoint
from spanrl.trainer_bridge.torch_backend.sft import encode_example

if TYPE_CHECKING:
    from spanrl.trainer_bridge.torch_backend.trainer import TorchTrainer


def sft_step(trainer: TorchTrainer, samples: Sequence[TrainingSample]) -> dict[str, float]:
    """One NLL step on ``samples``' responses; its statistics (``loss`` is the mean NLL per
    response token before the step)."""
    started = time.perf_counter()
    sequences = [encode_example(trainer.tokenizer, TokenExample(tuple(s.prompt_token_ids),
                                                                tuple(s.response_token_ids))) for s in samples]
    total_tokens = float(sum(sum(mask) for _, mask in sequences))
    if total_tokens == 0:
        raise ValueError("sft_step: the samples hold no response token to learn")
    trainer.model.train()
    loss_value = 0.0
    for batch in trainer.token_batches(sequences):
        logprobs = trainer.token_logprobs(batch)
        loss = -(logprobs * batch.response_mask).sum() / total_tokens
        loss.backward()
        loss_value += float(loss.detach())
    grad_norm = trainer.clip_and_step(trainer.optimizer)
    trainer.step += 1
    trainer.policy_version += 1
    seconds = time.perf_counter() - started
    config = trainer.config
    if config.checkpoint_every and trainer.step % config.checkpoint_every == 0:
        save_periodic_checkpoint(trainer, str(config.checkpoint_dir), config.keep_checkpoints)
    return {
        "loss": loss_value, "sft_nll": loss_value, "grad_norm": grad_norm, "samples": float(len(samples)),
        "response_tokens": total_tokens, "lr": trainer.optimizer.param_groups[0]["lr"], "seconds": seconds,
        "tokens_per_s": float(sum(len(ids) for ids, _ in sequences)) / max(seconds, 1e-9),
        "step": float(trainer.step), "policy_version": float(trainer.policy_version),
    }
