"""Late feedback as it comes in: the ``POST /spanrl/v1/feedback`` body, and reward events of spans
and log records that no rollout will assemble.

Called by ``http_service.py`` (the route) and ``export_service.py`` (after a traces or logs
Export). Each value passes the receiver's reward trust rules (``rewards.RewardPolicy``: finite,
within the range or clipped; ``gen_ai.evaluation.result`` only when evaluation rewards are on),
and each feedback gets a key that makes a replay count once: the client's idempotency key, or
the event's identity (event and reward name, value, time, response id, trace).

Which OTLP events are feedback: those of a span that no rollout's assembly will read — a span of
an already assembled rollout (refused as late), or a span without any rollout id (an evaluator
service; if its trace turns out to belong to a rollout assembled with it, the join sees the
rollout counted the event already and marks it a duplicate) — and every such log record. Its
target: the response id it names, else (a log record) its span id, else the rollout id of a late
span, else its trace id.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from typing import Any

from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from spanrl.instrumentation import semconv
from spanrl.otlp_receiver.feedback_store import TARGET_KINDS, Feedback, FeedbackStore
from spanrl.otlp_receiver.otlp_decode import SpanRow
from spanrl.otlp_receiver.rewards import RewardPolicy
from spanrl.otlp_receiver.span_checks import any_value_to_python

BODY_FIELDS = (*TARGET_KINDS, "value", "name", "comment", "idempotency_key")
MAX_KEY_CHARS = 256
MAX_NAME_CHARS = 128
MAX_COMMENT_CHARS = 4096
HEX_LENGTHS = {"trace_id": 32, "span_id": 16}
EVENT_NAMES = (semconv.REWARD_EVENT, semconv.GENAI_EVALUATION_EVENT)
_MARKERS = tuple(name.encode() for name in EVENT_NAMES)


class FeedbackError(ValueError):
    """A feedback body that cannot be taken; ``field`` names what was wrong (HTTP 400)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def checked_value(raw: Any, policy: RewardPolicy) -> tuple[float | None, str | None]:
    """``raw`` as the reward value the policy allows, and what happened: None (taken as is),
    ``clipped``, or ``rejected`` (the value is None then)."""
    if not _is_number(raw):
        return None, "rejected"
    value = float(raw)
    if policy.minimum <= value <= policy.maximum:
        return value, None
    if policy.out_of_range == "clip":
        return min(max(value, policy.minimum), policy.maximum), "clipped"
    return None, "rejected"


def parse_feedback_body(body: bytes, header_key: str | None, policy: RewardPolicy) -> tuple[Feedback, bool]:
    """The feedback of a ``POST /spanrl/v1/feedback`` body, and whether its value was clipped."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise FeedbackError("body", f"not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise FeedbackError("body", "must be a JSON object")
    unknown = sorted(set(data) - set(BODY_FIELDS))
    if unknown:
        raise FeedbackError(unknown[0], f"unknown field; the fields are {', '.join(BODY_FIELDS)}")
    named = [kind for kind in TARGET_KINDS if data.get(kind) is not None]
    if len(named) != 1:
        given = f"; got {', '.join(named)}" if named else ""
        raise FeedbackError("target", f"give exactly one of {', '.join(TARGET_KINDS)}{given}")
    kind = named[0]
    target = _target(kind, data[kind])
    raw = data.get("value")
    value, outcome = checked_value(raw, policy)
    if value is None:
        raise FeedbackError("value", "must be a finite number" if not _is_number(raw) else (
            f"{raw!r} is outside the receiver's reward range [{policy.minimum:g}, {policy.maximum:g}]"))
    name = _text(data, "name", MAX_NAME_CHARS) or "feedback"
    comment = _text(data, "comment", MAX_COMMENT_CHARS)
    key = _text(data, "idempotency_key", MAX_KEY_CHARS)
    if header_key is not None:
        if key is not None and key != header_key:
            raise FeedbackError("idempotency_key", "differs from the Idempotency-Key header")
        key = header_key[:MAX_KEY_CHARS + 1]
        if not key or len(key) > MAX_KEY_CHARS:
            raise FeedbackError("idempotency_key", f"must be 1 to {MAX_KEY_CHARS} characters")
    if key is None:
        raise FeedbackError("idempotency_key", "required (or the Idempotency-Key header): a replay with the"
                            " same key counts once")
    return Feedback(key=f"http:{key}", target_kind=kind, target=target, value=value, name=name,
                    comment=comment), outcome == "clipped"


def _is_number(raw: Any) -> bool:
    """A finite int or float (not a bool; an int too big for a float is not one either)."""
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        return False
    try:
        return math.isfinite(float(raw))
    except OverflowError:
        return False


def _target(kind: str, raw: Any) -> str:
    if not isinstance(raw, str) or not raw or len(raw) > MAX_KEY_CHARS:
        raise FeedbackError(kind, f"must be a non-empty string of at most {MAX_KEY_CHARS} characters")
    if kind in HEX_LENGTHS:
        text = raw.lower()
        if len(text) != HEX_LENGTHS[kind] or any(c not in "0123456789abcdef" for c in text) or not text.strip("0"):
            raise FeedbackError(kind, f"must be {HEX_LENGTHS[kind]} hex digits, not all zero (got {raw!r})")
        return text
    return raw


def _text(data: dict, field: str, limit: int) -> str | None:
    raw = data.get(field)
    if raw is None:
        return None
    if not isinstance(raw, str) or not raw or len(raw) > limit:
        raise FeedbackError(field, f"must be a non-empty string of at most {limit} characters")
    return raw


class EventFeedback:
    """Turns reward events (span events, log records) into feedback and submits them."""

    def __init__(self, book: FeedbackStore, policy: RewardPolicy) -> None:
        self.book = book
        self.policy = policy

    def from_spans(self, rows: Sequence[SpanRow], late: Iterable[int]) -> int:
        """Submit the reward events of ``rows`` that no assembly will read: rows without a
        rollout id, and the rows at the indices ``late`` (refused: their rollout was assembled)."""
        late = set(late)
        submitted = 0
        for index, row in enumerate(rows):
            if (row.rollout_id and index not in late) or not any(m in row.body for m in _MARKERS):
                continue
            span = Span.FromString(row.body)
            for event in span.events:
                attributes = {kv.key: any_value_to_python(kv.value) for kv in event.attributes}
                fallback = ("rollout_id", row.rollout_id) if row.rollout_id else ("trace_id", span.trace_id.hex())
                submitted += self._submit(event.name, attributes, event.time_unix_nano, span.trace_id.hex(),
                                          span.span_id.hex(), fallback)
        return submitted

    def from_logs(self, request: ExportLogsServiceRequest) -> int:
        """Submit every reward event among the log records of a logs Export request."""
        submitted = 0
        for resource_logs in request.resource_logs:
            for scope_logs in resource_logs.scope_logs:
                for record in scope_logs.log_records:
                    attributes = {kv.key: any_value_to_python(kv.value) for kv in record.attributes}
                    name = getattr(record, "event_name", "") or attributes.get("event.name")
                    if name not in EVENT_NAMES:
                        continue
                    trace, span = record.trace_id.hex(), record.span_id.hex()
                    fallback = ("span_id", span) if span.strip("0") else ("trace_id", trace)
                    if not trace.strip("0"):
                        self.book.count("rejected")  # linked to nothing
                        continue
                    submitted += self._submit(str(name), attributes,
                                              record.time_unix_nano or record.observed_time_unix_nano,
                                              trace, None, fallback)
        return submitted

    def _submit(self, event: str, attributes: dict[str, Any], time_ns: int, trace: str, carrier: str | None,
                fallback: tuple[str, str]) -> int:
        if event == semconv.REWARD_EVENT:
            raw = attributes.get(semconv.REWARD_VALUE)
            name = attributes.get(semconv.REWARD_NAME) or semconv.DEFAULT_REWARD_NAME
        elif event == semconv.GENAI_EVALUATION_EVENT:
            if not self.policy.evaluation_events:
                self.book.count("evaluations_ignored")
                return 0
            raw = attributes.get(semconv.GENAI_EVALUATION_SCORE)
            name = attributes.get(semconv.GENAI_EVALUATION_NAME) or "evaluation"
        else:
            return 0
        response_id = attributes.get(semconv.REWARD_RESPONSE_ID) or attributes.get(semconv.GENAI_RESPONSE_ID)
        value, outcome = checked_value(raw, self.policy)
        if outcome is not None:
            self.book.count(outcome)
        if value is None:
            return 0
        kind, target = ("response_id", response_id) if isinstance(response_id, str) else fallback
        key = json.dumps(["event", event, str(name), raw, time_ns, response_id, trace])
        self.book.submit(Feedback(key=key, target_kind=kind, target=target, value=value, name=str(name),
                                  source=event, carrier_span_id=carrier))
        return 1
