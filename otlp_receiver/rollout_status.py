"""How a rollout went, from its span tree: ``failed`` with an error, or ``ok`` with a reason when
``ok`` rests only on the absence of evidence. Called by ``assembly.assemble_rollout``.

- Separate runs under one rollout id (two ``spanrl.rollout`` spans, neither nested in the
  other) are never merged into one rollout: ``failed``, "rollout id reused".
- With a ``spanrl.rollout`` span: ``failed`` when it ended with status ERROR, else ``ok``.
- Without one (an agent run outside ``spanrl run``): ``failed`` when a top-level span (one
  without a parent, the agent's outermost) ended with ERROR; else ``ok`` with a
  ``status_reason`` naming what is unknown (ERROR spans below, no reward).
"""

from __future__ import annotations

from spanrl.instrumentation import semconv
from spanrl.otlp_receiver.span_tree import SpanTree


def rollout_status(tree: SpanTree, end_reason: str, total_reward: float | None) -> tuple[str | None, str | None]:
    """``(error, status_reason)``: an error makes the rollout ``failed``; ``status_reason``
    says why an ``ok`` rollout is ok only for want of evidence (no ``spanrl.rollout`` span)."""
    root = tree.root
    if tree.separate_runs > 1:
        return (f"rollout id reused: {tree.separate_runs} separate {semconv.ROLLOUT_SPAN_NAME} spans (runs)"
                " carry it, and their spans are not one rollout; give each run its own"
                f" {semconv.ROLLOUT_ID}"), None
    if tree.has_rollout_span:
        if root.status_error:
            return root.status_message or "the rollout span ended with status ERROR", None
        return None, None
    crashed = next((r for r in tree.top_level() if r.status_error), None)
    if crashed is not None:
        detail = f": {crashed.status_message}" if crashed.status_message else ""
        return (f"no {semconv.ROLLOUT_SPAN_NAME} span arrived, and top-level span {crashed.name!r}"
                f" ended with status ERROR{detail}"), None
    reasons = [f"no {semconv.ROLLOUT_SPAN_NAME} span arrived, so how the agent ended is unknown"
               f" (the rollout ended by {end_reason})"]
    errors = sum(1 for r in tree.order if r.status_error)
    if errors:
        reasons.append(f"{errors} span(s) ended with status ERROR")
    if total_reward is None:
        reasons.append("no reward")
    return None, "; ".join(reasons)
