"""The verl backend's off-policy correction, on CPU without workers: the batch carries each
sample's engine logprobs aligned with its response tokens (0 on padding and masked tokens, NaN
where a sample has none), a late sample without them is dropped and counted (not crashed on),
and verl 0.9.1's own ``compute_rollout_correction_and_add_to_batch`` turns the batch into the
truncated IS weights the embedded trainer uses, min(exp(old - engine logprob), cap)."""

from __future__ import annotations

import math

import pytest
import torch
from verl.trainer.config.algorithm import RolloutCorrectionConfig

from spanrl.trainer_bridge.backend import TrainingSample
from spanrl.trainer_bridge.verl_backend.backend import pad_to_multiple
from spanrl.trainer_bridge.verl_backend.batch import EmptyVerlBatch, build_verl_batch
from spanrl.trainer_bridge.verl_backend.off_policy import correct_off_policy

CAP = 1.5
LIMITS = {"pad_token_id": 0, "max_prompt_length": 6, "max_response_length": 5, "temperature": 1.0}


def sample(name: str, version: int | None, logprobs: list[float] | None, response=(7, 8, 9),
           mask: list[int] | None = None) -> TrainingSample:
    return TrainingSample(prompt_token_ids=[3, 4], response_token_ids=list(response), advantage=1.0,
                          old_logprobs=logprobs, group_id="g", rollout_id=name, policy_version=version,
                          response_loss_mask=mask)


SAMPLES = [
    sample("fresh", 2, [-0.5, -1.0, -1.5]),
    sample("late", 1, [-0.25, -3.0, -0.1, -2.0], response=(7, 8, 9, 10)),
    sample("late-merged", 1, [-0.2, -9.0, -0.3], mask=[1, 0, 1]),  # a merged row: the middle token masked
    sample("late-without", 1, None),  # cannot be weighed: dropped
    sample("fresh-without", 2, None),  # on-policy: weight 1
    sample("unknown-without", None, [-1.0]),  # logprobs of the wrong length count as none
]


def test_the_batch_carries_engine_logprobs_aligned_and_drops_late_samples_without_them():
    batch = build_verl_batch(SAMPLES, correct_before=2, **LIMITS)
    assert (batch.dropped_no_logprobs, batch.late_rollouts, batch.has_rollout_log_probs) == (1, 2, False)
    assert list(batch.data.non_tensor_batch["rollout_id"]) == ["fresh", "late", "late-merged", "fresh-without",
                                                               "unknown-without"]
    rollout = batch.data.batch["rollout_log_probs"]
    assert rollout.shape == (5, 5)
    assert rollout[0].tolist() == [-0.5, -1.0, -1.5, 0.0, 0.0]  # right-padded like the responses
    assert rollout[1].tolist() == pytest.approx([-0.25, -3.0, -0.1, -2.0, 0.0])
    assert rollout[2].tolist() == pytest.approx([-0.2, 0.0, -0.3, 0.0, 0.0])  # 0 where masked out
    assert batch.data.batch["responses"][1].tolist() == [7, 8, 9, 10, 0]
    assert torch.isnan(rollout[3:]).all()

    # without the correction nothing is late: the sample is kept, old log-probs are recomputed
    plain = build_verl_batch(SAMPLES, **LIMITS)
    assert (plain.dropped_no_logprobs, plain.late_rollouts, len(plain.data)) == (0, 0, 6)
    assert "rollout_log_probs" not in plain.data.batch.keys()

    with pytest.raises(EmptyVerlBatch, match="1 of an older policy without engine logprobs"):
        build_verl_batch([SAMPLES[3]], correct_before=2, **LIMITS)


def test_verls_correction_weighs_each_token_by_the_truncated_ratio():
    batch = build_verl_batch(SAMPLES, correct_before=2, **LIMITS)
    data = pad_to_multiple(batch.data, 10)  # 5 weightless copies (as for 10 actor ranks), NaN rows included
    old = torch.tensor([[-0.5, -1.0, -1.5, 0, 0], [-1.0, -1.0, -1.0, -1.0, 0], [-0.1, -0.5, -0.1, 0, 0],
                        [-2.0, -2.0, -2.0, 0, 0], [-1.0, -1.0, -1.0, 0, 0]])
    data.batch["old_log_probs"] = torch.cat([old, old])
    rollout_before = data.batch["rollout_log_probs"].clone()

    data, metrics = correct_off_policy(data, RolloutCorrectionConfig.decoupled_token_is(threshold=CAP))

    weights, mask = data.batch["rollout_is_weights"][:5], batch.data.batch["response_mask"]
    expected = torch.zeros(5, 5)
    for row in range(5):
        for t in range(5):
            if mask[row, t]:
                engine = rollout_before[row, t]
                ratio = 1.0 if math.isnan(engine) else math.exp(old[row, t] - engine)
                expected[row, t] = min(ratio, CAP)
    assert torch.allclose(weights, expected, atol=1e-6)
    assert weights[1].tolist()[:4] == pytest.approx([math.exp(-0.75), CAP, math.exp(-0.9), CAP])
    assert metrics["rollout_is_mean"] == pytest.approx(float(expected.sum() / mask.sum()), abs=1e-6)
    clipped = sum(1 for row in range(5) for t in range(5)
                  if mask[row, t] and not math.isnan(rollout_before[row, t])
                  and math.exp(old[row, t] - rollout_before[row, t]) > CAP)
    assert clipped == 2 and metrics["rollout_is_truncated"] == pytest.approx(clipped / float(mask.sum()))
    assert metrics["rollout_is_rows_without_logprobs"] == 2.0  # the filler copies are not counted
    assert "rollout_corr/rollout_is_eff_sample_size" in metrics
    assert not torch.isnan(data.batch["rollout_log_probs"]).any()  # nothing NaN reaches verl's workers
