"""Steps that trained on nothing: why, in words a user can act on, and when to stop.

``run_training`` asks ``empty_step_reason(row)`` after every step; ``max_empty_steps`` such
steps in a row raise ``NothingToTrain`` (a ``UserError``: one line, exit 2).
"""

from __future__ import annotations

from spanrl.errors import UserError
from spanrl.schema import metrics as keys


class NothingToTrain(UserError):
    """Too many steps in a row trained on nothing (``max_empty_steps``): the message says why."""


# Why rollouts were left out -> what the user can check (for the empty-step error).
LEFT_OUT_HINTS = {
    "unassembled": "no assembled rollout reached the store: is `spanrl receive` running, writing to the store "
                   "the trainer reads, and reachable by the agents?",
    "reward_error": "the reward function raised (its traceback is in the log)",
    "no_reward": "no rollout had a reward",
    "failed": "the agents failed",
    "timeout": "the agents timed out",
    "lost": "runners did not report back",
    "no_transitions": "no LLM call carried token ids",
    "no_selected_agent": "no call came from the agents named in 'agents'",
}


def empty_step_reason(row: dict) -> str | None:
    """Why the step of metrics row ``row`` trained on nothing, or None when it trained."""
    if row[keys.TRANSITIONS]:
        return None
    left_out = row[keys.ROLLOUTS_LEFT_OUT]
    hints = [LEFT_OUT_HINTS[k] for k in sorted(left_out, key=lambda k: -left_out[k]) if k in LEFT_OUT_HINTS]
    if row.get(keys.BELOW_SFT_MIN_REWARD):
        hints.append("no scored rollout reached sft_min_reward (algorithm: sft learns only those)")
    if row.get(keys.UNIFORM_GROUPS_DROPPED):
        hints.append("every group's rollouts got the same reward, so drop_uniform_groups left them out: "
                     "nothing to compare (tasks all solved or all failed; a warm start or easier tasks)")
    if row[keys.GROUPS_OF_ONE_DROPPED]:
        hints.append("groups with a single usable rollout were dropped (GRPO compares rollouts of one task)")
    counts = ", ".join(f"{k} {v}" for k, v in sorted(left_out.items())) or "none left out"
    return (f"step {row[keys.STEP]} trained on nothing: {row[keys.ROLLOUTS]} rollouts ({counts})"
            + (f"; {'; '.join(hints)}" if hints else ""))
