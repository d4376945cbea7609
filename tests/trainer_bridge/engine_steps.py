"""Test support for the policy engine: requests that join a running batch at one step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from spanrl.trainer_bridge.torch_backend.engine.policy_engine import SamplingParams


def submit_at_one_step(engine, prompts: list[list[int]], params_of: Callable[[int], SamplingParams],
                       on_pass: Callable[[dict[str, Any]], None] | None = None) -> list:
    """Start a short unrelated request and, at its first token (on the engine thread), submit
    ``prompts`` (``params_of(i)`` for the i-th): they all join the running batch at its next step.
    Returns their results; ``on_pass`` sees each forward pass's keyword arguments meanwhile."""
    jobs: list = []

    def join_together(event) -> None:
        if event.choice == 0 and not jobs:
            jobs.extend(engine.submit(prompt, params_of(i)) for i, prompt in enumerate(prompts))

    handle = None
    if on_pass is not None:
        handle = engine.model.register_forward_pre_hook(lambda module, args, kwargs: on_pass(kwargs),
                                                        with_kwargs=True)
    try:
        engine.submit(engine.encode_chat([{"role": "user", "content": "Hi"}]),
                      SamplingParams(max_tokens=6, temperature=0.0), on_token=join_together).wait(60)
        return [job.wait(60) for job in jobs]
    finally:
        if handle is not None:
            handle.remove()
