"""What an OTLP Export request does, independent of the transport; errors -> protocol codes.

Used by ``grpc_service.py`` and ``http_service.py``. Traces are decoded, validated and
committed (through ``IngestWriter``) before the response is built; reward events that no
rollout will assemble (late spans, spans without a rollout) become late feedback
(``feedback_intake``). Metrics and logs are accepted and dropped (the OTel distro exports
metrics to the same endpoint by default; that must not fail), after checking that they parse,
except the reward events among log records, which become late feedback too. ``PROTOCOL_ERRORS`` is the one table that
maps our exceptions to gRPC status codes and HTTP statuses.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
    ExportLogsServiceRequest,
    ExportLogsServiceResponse,
)
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

from spanrl.otlp_receiver.feedback_intake import EventFeedback, FeedbackError
from spanrl.otlp_receiver.ingest import IngestFailed, IngestWriter, Overloaded
from spanrl.otlp_receiver.otlp_decode import (
    PayloadError,
    decode_payload,
    decode_request,
    parse_json_request,
)
from spanrl.otlp_receiver.span_writes import ROLLOUT_ALREADY_ASSEMBLED
from spanrl.otlp_receiver.store import StoreError
from spanrl.server_security import bearer_token_matches

logger = logging.getLogger(__name__)

SIGNALS: dict[str, tuple[type[Any], type[Any]]] = {
    "metrics": (ExportMetricsServiceRequest, ExportMetricsServiceResponse),
    "logs": (ExportLogsServiceRequest, ExportLogsServiceResponse),
}


class Unauthenticated(PermissionError):
    """The request lacks the bearer token the receiver was started with."""


class TooLarge(ValueError):
    """The request is larger than the configured message limit."""


# exception -> (gRPC status code, HTTP status); the first matching class wins.
PROTOCOL_ERRORS: tuple[tuple[type[BaseException], grpc.StatusCode, int], ...] = (
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED, 401),
    (TooLarge, grpc.StatusCode.RESOURCE_EXHAUSTED, 413),
    (PayloadError, grpc.StatusCode.INVALID_ARGUMENT, 400),
    (FeedbackError, grpc.StatusCode.INVALID_ARGUMENT, 400),  # a POST /spanrl/v1/feedback body
    (Overloaded, grpc.StatusCode.UNAVAILABLE, 503),
    (StoreError, grpc.StatusCode.UNAVAILABLE, 503),  # locked, disk full, I/O: may pass
    (IngestFailed, grpc.StatusCode.INTERNAL, 500),  # a retry would not help
)


def protocol_error(exc: BaseException) -> tuple[grpc.StatusCode, int] | None:
    for cls, code, http_status in PROTOCOL_ERRORS:
        if isinstance(exc, cls):
            return code, http_status
    return None


class ExportService:
    def __init__(self, writer: IngestWriter, token: str | None, feedback: EventFeedback | None = None) -> None:
        self.writer = writer
        self.token = token
        self.feedback = feedback  # late reward events of spans and log records (feedback_intake)
        self.accepted_spans = 0
        self.rejected_spans = 0
        self._count_lock = threading.Lock()

    def check_authorization(self, header: str | None) -> None:
        if not self.token:
            return
        if not bearer_token_matches(header, self.token):
            raise Unauthenticated(
                "missing or wrong bearer token: send 'Authorization: Bearer <token>'"
                " (OTEL_EXPORTER_OTLP_HEADERS=Authorization=Bearer%20<token>)"
            )

    def export_traces(self, body: bytes, json_encoding: bool = False) -> ExportTraceServiceResponse:
        decoded = decode_request(parse_json_request(body)) if json_encoding else decode_payload(body)
        refused = self.writer.submit(decoded.rows)  # returns once committed
        if self.feedback is not None:  # a StoreError here is retryable: the retry finds the same events
            late = [r.index for r in refused
                    if r.reason == ROLLOUT_ALREADY_ASSEMBLED.format(rollout_id=decoded.rows[r.index].rollout_id)]
            self.feedback.from_spans(decoded.rows, late)
        if refused:
            decoded.refuse(refused)
        with self._count_lock:
            self.accepted_spans += len(decoded.rows) - len(refused)
            self.rejected_spans += decoded.rejected
        if decoded.rejected:
            logger.warning("%s", decoded.error_message())
        return decoded.response()

    def stats(self) -> dict[str, int]:
        """Counters since start (``GET /spanrl/v1/stats``): spans acknowledged as stored and
        rejected in answers, spans in committed writes (a retry counts again) and those new to
        the store, commits, requests refused as overload."""
        writer = self.writer
        with self._count_lock:
            return {"accepted_spans": self.accepted_spans, "rejected_spans": self.rejected_spans,
                    "committed_spans": writer.committed_spans, "new_spans": writer.store.new_spans,
                    "commits": writer.commits,
                    "overloaded_requests": writer.overloaded_requests, "pending_bytes": writer.pending_bytes}

    def export_other(self, signal: str, body: bytes, json_encoding: bool = False):
        """Metrics and logs: checked and dropped; the response is a full success."""
        request_type, response_type = SIGNALS[signal]
        if json_encoding:
            request = parse_json_request(body, request_type)
        else:
            try:
                request = request_type.FromString(body)
            except DecodeError as exc:
                raise PayloadError(f"body is not a valid {request_type.__name__} protobuf: {exc}") from exc
        if signal == "logs" and self.feedback is not None:
            self.feedback.from_logs(request)
        return response_type()
