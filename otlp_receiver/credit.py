"""Credit assignment: how a rollout's rewards become each transition's return.

Called by ``assembly.py`` once per rollout. Pure functions, picked by name from a registry:

- ``identical`` (default, the Agent Lightning paper): every transition gets the rollout's
  total return ``R = sum of all rewards`` (0 when the rollout emitted none).
- ``discounted``: per-transition returns from intermediate rewards,
  ``return_t = r_t + gamma * return_{t+1}`` with ``r_t`` the rewards attached to transition t
  (``gamma = 1`` gives reward-to-go).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

CreditFunction = Callable[[Sequence[float], "float | None", float], list[float]]


def identical_returns(rewards: Sequence[float], total_reward: float | None, gamma: float) -> list[float]:
    """``[R] * T``: every transition gets the rollout's total return (0.0 when None)."""
    total = 0.0 if total_reward is None else float(total_reward)
    return [total] * len(rewards)


def discounted_returns(rewards: Sequence[float], total_reward: float | None, gamma: float) -> list[float]:
    """``return_t = r_t + gamma * return_{t+1}``, computed backwards from the last call."""
    returns = [0.0] * len(rewards)
    running = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        running = float(rewards[t]) + gamma * running
        returns[t] = running
    return returns


CREDIT_ASSIGNMENTS: dict[str, CreditFunction] = {
    "identical": identical_returns,
    "discounted": discounted_returns,
}


def credit_function(name: str) -> CreditFunction:
    try:
        return CREDIT_ASSIGNMENTS[name]
    except KeyError:
        raise ValueError(
            f"unknown credit assignment {name!r}; choose one of {sorted(CREDIT_ASSIGNMENTS)}"
        ) from None
