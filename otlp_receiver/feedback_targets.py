"""The names a late feedback may give an assembled rollout, each with the call it judges.

Called by ``feedback_store.FeedbackStore.catch_up`` once per assembled rollout, with the rollout
and its decoded spans. A feedback that names

- the rollout id or one of its trace ids judges the rollout (no call);
- a ``gen_ai.response.id`` judges the call that returned it (the transition whose span, or the
  endpoint's or agent's span of the same call, carries it);
- a span id judges that call when the span is a call's span or carries a call's response id,
  else the rollout.
"""

from __future__ import annotations

from spanrl.instrumentation import semconv
from spanrl.otlp_receiver.span_tree import SpanRecord
from spanrl.schema.rollouts import AssembledRollout

Target = tuple[str, str, "str | None"]  # (kind, target, call span id)


def rollout_targets(rollout: AssembledRollout, records: list[SpanRecord]) -> list[Target]:
    """Every (kind, target, call span id) of ``rollout``; ids are lowercase hex."""
    calls = {t.span_id for t in rollout.transitions}
    call_of_response: dict[str, str | None] = {}
    for record in records:
        response_id = record.attributes.get(semconv.GENAI_RESPONSE_ID)
        if isinstance(response_id, str) and record.key in calls:
            call_of_response[response_id] = record.key
    for record in records:  # a response id no transition's span carries: the rollout's
        response_id = record.attributes.get(semconv.GENAI_RESPONSE_ID)
        if isinstance(response_id, str):
            call_of_response.setdefault(response_id, None)
    targets: list[Target] = [("rollout_id", rollout.rollout_id, None)]
    targets += [("trace_id", trace, None) for trace in sorted({r.trace_id.lower() for r in records if r.trace_id})]
    targets += [("response_id", rid, call) for rid, call in call_of_response.items()]
    for record in records:
        response_id = record.attributes.get(semconv.GENAI_RESPONSE_ID)
        if record.key in calls:
            call: str | None = record.key
        elif isinstance(response_id, str):
            call = call_of_response[response_id]
        else:
            call = None
        targets.append(("span_id", record.key.lower(), call))
    return targets
