"""What docs/algorithms.md says of GRPO against SFT from rollouts, checked on spanrl's own advantage
and loss functions: on-policy, with a pass/fail reward, every estimator's expected update points
along ``grad p`` (``p``: the chance the policy solves the task), only its size differs.

The policy is four answers under a softmax, two of them right; many groups of 8 are sampled from
it, each gets the loop's advantages (``advantages.py``) and the torch backend's PPO loss
(``losses.policy_loss_dual_clip``, old logprobs equal to the new ones: one epoch), and the mean
gradient over the groups is compared with ``grad p``.
"""

from __future__ import annotations

import torch

from spanrl.trainer_bridge import advantages
from spanrl.trainer_bridge.torch_backend import losses

GROUP = 8
GROUPS = 12_000


def mean_gradient(estimator: str, logits: torch.Tensor, answers: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """The PPO loss's gradient in ``logits``, averaged over the sampled groups (``answers``: ``[GROUPS, GROUP]``)."""
    groups = [g for g in range(GROUPS) for _ in range(GROUP)]
    advantage, keep = advantages.ADVANTAGE_ESTIMATORS[estimator](rewards[answers].flatten(), groups)
    assert keep.all()
    logits = logits.detach().requires_grad_(True)
    logprobs = torch.log_softmax(logits, 0)[answers.flatten()].unsqueeze(1)  # one token a response
    loss, _ = losses.policy_loss_dual_clip(logprobs.detach(), logprobs, advantage.unsqueeze(1),
                                          torch.ones_like(logprobs))
    (gradient,) = torch.autograd.grad(-loss, logits)  # the direction the update moves the logits
    return gradient


def test_every_estimator_moves_the_policy_along_grad_p_on_policy():
    generator = torch.Generator().manual_seed(0)
    logits = torch.tensor([0.3, -0.5, 1.0, 0.1])
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    free = logits.clone().requires_grad_(True)
    (grad_p,) = torch.autograd.grad((torch.softmax(free, 0) * rewards).sum(), free)
    answers = torch.multinomial(torch.softmax(logits, 0).expand(GROUPS, 4), GROUP, replacement=True,
                                generator=generator)
    # SFT from rollouts: the successes' mean NLL gradient, per response sampled (token-mean over
    # the successes' tokens divides it by the batch's mean reward, a constant of the step)
    chosen = torch.nn.functional.one_hot(answers.flatten(), 4).float() - torch.softmax(logits, 0)
    sft = (rewards[answers.flatten()].unsqueeze(1) * chosen).mean(0)

    def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(torch.nn.functional.cosine_similarity(a, b, dim=0))

    scales = {}
    for name, gradient in [("sft", sft)] + [(e, mean_gradient(e, logits, answers, rewards))
                                            for e in ("drgrpo", "grpo", "reinforce_plus_plus")]:
        assert cosine(gradient, grad_p) > 0.995, name
        scales[name] = float(gradient.norm() / grad_p.norm())
    assert abs(scales["sft"] - 1) < 0.03
    assert abs(scales["drgrpo"] - (1 - 1 / GROUP)) < 0.03  # the group's mean includes the sample itself
    assert 1.6 < scales["grpo"] < 1.9  # divided by each group's own std: less than 1 / sqrt(p (1 - p)) = 2.02
    assert 1.9 < scales["reinforce_plus_plus"] < 2.15  # divided by the batch's std, sqrt(p (1 - p)) = 0.49
