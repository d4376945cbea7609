"""spanrl's training samples as verl's batch: the ``DataProto`` verl's agent loop would build.

Called by the verl backend's ``update``: ``build_verl_batch`` lays the samples out exactly as
``verl.experimental.agent_loop.AgentLoopWorker`` does for one LLM call per row
(``_agent_loop_postprocess`` + ``_postprocess``): prompts left-padded, responses right-padded,
masks (a merged row of several calls, ``trajectory_merge``, is verl's multi-turn layout: the
tokens between the calls' responses are attended to but have ``response_mask`` 0), position
ids from verl's own ``compute_position_id_with_mask``, the engine's logprobs as
``rollout_log_probs``, the reward at the last response token. spanrl computes the advantages
(credit assignment, GRPO, per-rollout weighting) and writes them into ``advantages`` and
``returns``, so verl's advantage estimator is not run and both backends train on the same
numbers. ``to_worker_tensordict`` then converts the batch as ``RayPPOTrainer._update_actor``
does before ``actor_rollout_wg.update_actor``.

Samples longer than the configured prompt or response length are dropped and counted, never
truncated (a truncated prompt is a different state; a truncated response a different action).
Imports verl and torch (never vLLM); only the verl backend imports this module.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict
from verl.protocol import DataProto
from verl.utils import tensordict_utils as tu
from verl.utils.model import compute_position_id_with_mask
from verl.workers.utils.padding import left_right_2_no_padding

from ..advantages import weigh_rollouts_equally
from ..backend import TrainingSample

logger = logging.getLogger(__name__)


class EmptyVerlBatch(ValueError):
    """Every sample of an update was dropped: nothing is left for verl to train on."""


@dataclass(frozen=True)
class VerlBatch:
    """A verl ``DataProto`` of training samples and what building it left out.

    ``dropped_overlong``: samples whose prompt or response was longer than the configured
    limits; ``dropped_empty``: samples with an empty prompt or response (verl's unpadding needs
    at least one token of each). ``has_rollout_log_probs``: every kept sample carried the
    engine's logprobs, so ``rollout_log_probs`` is in the batch; when False it is absent (as
    in verl's own agent loop when the engine returned none) and old log-probs must be
    recomputed by verl's ``compute_log_prob`` before the update.
    """

    data: DataProto
    dropped_overlong: int
    dropped_empty: int
    has_rollout_log_probs: bool


def _fits(sample: TrainingSample, max_prompt_length: int, max_response_length: int) -> bool:
    return len(sample.prompt_token_ids) <= max_prompt_length and len(sample.response_token_ids) <= max_response_length


def _usable_logprobs(sample: TrainingSample) -> Sequence[float] | None:
    logprobs = sample.old_logprobs
    if logprobs is None or len(logprobs) != len(sample.response_token_ids):
        return None
    return logprobs


def build_verl_batch(samples: Sequence[TrainingSample], *, pad_token_id: int, max_prompt_length: int,
                     max_response_length: int, temperature: float) -> VerlBatch:
    """The ``DataProto`` of ``samples``, one row per sample, as verl's agent loop lays it out.

    Batch (``B`` rows, ``P = max_prompt_length``, ``T = max_response_length``):

    - ``prompts [B, P]`` left-padded, ``responses [B, T]`` right-padded with ``pad_token_id``;
      ``input_ids [B, P+T]`` their concatenation, ``attention_mask [B, P+T]`` 1 on real tokens,
      ``position_ids [B, P+T]`` by verl's ``compute_position_id_with_mask`` (0 on padding,
      0.. on real tokens), ``response_mask [B, T]`` 1 on response tokens trained on, 0 on
      padding and on a merged row's tokens in between (all int64);
    - ``rollout_log_probs [B, T]`` float32, the engine's logprobs, 0 on padding (only when
      every kept sample has them: ``VerlBatch.has_rollout_log_probs``);
    - ``advantages``, ``returns [B, T]`` float32: the advantage of each response token (its
      call's in a merged row), 0 on padding and masked tokens;
    - ``token_level_scores``, ``token_level_rewards [B, T]`` float32: the sample's reward at
      its last trained response token, 0 elsewhere.

    Non-tensor: ``uid`` (the GRPO group id), ``rollout_id``, ``turn_index``; meta_info
    ``temperature`` (the sampling temperature, which verl divides the logits by when it
    recomputes log-probs). Samples over the limits are dropped and counted; when the samples
    carry per-rollout loss weights (``loss_weighting: rollout``) and some were dropped, the
    weights are recomputed over the kept samples. Raises ``EmptyVerlBatch`` when none is left.
    """
    if max_prompt_length < 1 or max_response_length < 1:
        raise ValueError("max_prompt_length and max_response_length must be at least 1")
    kept, dropped_overlong, dropped_empty = _samples_that_fit(samples, max_prompt_length, max_response_length)
    tensors = _row_tensors(kept, pad_token_id, max_prompt_length, max_response_length)
    has_logprobs = "rollout_log_probs" in tensors
    non_tensors = {
        "uid": np.array([s.group_id for s in kept], dtype=object),
        "rollout_id": np.array([s.rollout_id for s in kept], dtype=object),
        "turn_index": np.array([s.turn_index for s in kept], dtype=np.int64),
    }
    data = DataProto(batch=TensorDict(tensors, batch_size=len(kept)), non_tensor_batch=non_tensors,
                     meta_info={"temperature": float(temperature)})
    return VerlBatch(data=data, dropped_overlong=dropped_overlong, dropped_empty=dropped_empty,
                     has_rollout_log_probs=has_logprobs)


def _samples_that_fit(samples: Sequence[TrainingSample], max_prompt_length: int,
                      max_response_length: int) -> tuple[list[TrainingSample], int, int]:
    """``(kept, dropped over the limits, dropped empty)``; the kept ones re-weighed when per-rollout
    loss weights were folded in and some were dropped. ``EmptyVerlBatch`` when none is left."""
    empty = [s for s in samples if not s.prompt_token_ids or not s.response_token_ids or not s.loss_token_count]
    usable = [s for s in samples if s.prompt_token_ids and s.response_token_ids and s.loss_token_count]
    kept = [s for s in usable if _fits(s, max_prompt_length, max_response_length)]
    dropped_overlong = len(usable) - len(kept)
    if dropped_overlong:
        logger.warning("%d of %d samples are longer than max_prompt_length=%d / max_response_length=%d "
                       "and are left out of the update (raise the limits to train on them)",
                       dropped_overlong, len(samples), max_prompt_length, max_response_length)
    if not kept:
        raise EmptyVerlBatch(
            f"all {len(samples)} samples were dropped ({dropped_overlong} longer than max_prompt_length="
            f"{max_prompt_length} / max_response_length={max_response_length}, {len(empty)} empty): "
            "raise the limits so the agents' calls fit")
    if len(kept) < len(samples) and any(s.loss_weight is not None for s in kept):
        kept = weigh_rollouts_equally(kept)
    return kept, dropped_overlong, len(empty)


def _row_tensors(kept: list[TrainingSample], pad_token_id: int, max_prompt_length: int,
                 max_response_length: int) -> dict[str, torch.Tensor]:
    """The batch's tensors (``build_verl_batch``'s layout), ``rollout_log_probs`` only when every
    sample has usable engine logprobs."""
    rows = len(kept)
    prompts = torch.full((rows, max_prompt_length), pad_token_id, dtype=torch.int64)
    responses = torch.full((rows, max_response_length), pad_token_id, dtype=torch.int64)
    prompt_mask = torch.zeros((rows, max_prompt_length), dtype=torch.int64)
    response_mask = torch.zeros((rows, max_response_length), dtype=torch.int64)
    response_attention = torch.zeros((rows, max_response_length), dtype=torch.int64)
    advantages = torch.zeros((rows, max_response_length), dtype=torch.float32)
    scores = torch.zeros((rows, max_response_length), dtype=torch.float32)
    logprobs = [_usable_logprobs(s) for s in kept]
    rollout_log_probs = torch.zeros((rows, max_response_length), dtype=torch.float32)
    for row, sample in enumerate(kept):
        prompt_length, response_length = len(sample.prompt_token_ids), len(sample.response_token_ids)
        prompts[row, max_prompt_length - prompt_length:] = torch.tensor(list(sample.prompt_token_ids))
        prompt_mask[row, max_prompt_length - prompt_length:] = 1
        responses[row, :response_length] = torch.tensor(list(sample.response_token_ids))
        loss_mask = sample.loss_mask
        response_mask[row, :response_length] = torch.tensor(loss_mask, dtype=torch.int64)
        response_attention[row, :response_length] = 1
        advantages[row, :response_length] = torch.tensor(sample.response_advantages, dtype=torch.float32)
        advantages[row, :response_length] *= response_mask[row, :response_length]
        last_trained = max(t for t, m in enumerate(loss_mask) if m)
        scores[row, last_trained] = float(sample.reward)
        values = logprobs[row]
        if values is not None:
            rollout_log_probs[row, :response_length] = (torch.tensor(list(values), dtype=torch.float32)
                                                        * response_mask[row, :response_length])
    attention_mask = torch.cat([prompt_mask, response_attention], dim=1)
    tensors: dict[str, torch.Tensor] = {
        "prompts": prompts, "responses": responses, "response_mask": response_mask,
        "input_ids": torch.cat([prompts, responses], dim=1), "attention_mask": attention_mask,
        "position_ids": compute_position_id_with_mask(attention_mask),
        "advantages": advantages, "returns": advantages.clone(),
        "token_level_scores": scores, "token_level_rewards": scores.clone(),
    }
    if all(values is not None for values in logprobs):
        tensors["rollout_log_probs"] = rollout_log_probs
    else:
        logger.info("%d of %d samples carry no usable engine logprobs: old log-probs are recomputed by verl",
                    sum(values is None for values in logprobs), rows)
    return tensors


def to_worker_tensordict(batch: VerlBatch | DataProto, **meta: Any) -> TensorDict:
    """The batch as verl's actor worker takes it, converted as ``RayPPOTrainer._update_actor``
    (and ``_compute_old_log_prob``) do: ``DataProto.to_tensordict``, then
    ``left_right_2_no_padding`` (``input_ids``, ``position_ids`` and ``loss_mask`` become
    jagged nested tensors; ``max_seq_len``, ``max_response_len`` and ``indices`` are added),
    then ``meta`` (``global_batch_size``, ``mini_batch_size``, ``epochs``, ``seed``,
    ``dataloader_kwargs``, ``calculate_entropy``, ``compute_loss``, ...) assigned as non-tensor
    data with verl's ``tensordict_utils.assign_non_tensor``. meta_info (``temperature``)
    comes along as non-tensor data."""
    data = batch.data if isinstance(batch, VerlBatch) else batch
    tensordict = left_right_2_no_padding(data.to_tensordict())
    if meta:
        tu.assign_non_tensor(tensordict, **meta)
    return tensordict
