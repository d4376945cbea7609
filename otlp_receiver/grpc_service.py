"""OTLP/gRPC: TraceService/Export (plus Metrics and Logs, accepted and dropped).

Started by ``server.py``. Requests arrive as raw bytes (no generated stub deserializer) so
garbage is answered INVALID_ARGUMENT by us rather than a generic INTERNAL by gRPC. gzip is
handled by grpcio; messages over the limit are refused by grpcio with RESOURCE_EXHAUSTED.
With server credentials (``tls.py``) the port speaks TLS only. At most ``max_concurrent_rpcs``
calls run or wait at once; grpcio refuses more with RESOURCE_EXHAUSTED, which exporters retry.
A failure of ours is logged; its text never reaches the client.
Overload answers UNAVAILABLE with the retry delay in both trailer forms clients read:
``grpc-status-details-bin`` (a google.rpc.Status with a RetryInfo detail; Go and Java
exporters) and ``google.rpc.retryinfo-bin`` (a bare RetryInfo; the OTel Python exporter).
"""

from __future__ import annotations

import logging
from concurrent import futures

import grpc
from google.protobuf.duration_pb2 import Duration
from google.rpc import code_pb2, error_details_pb2, status_pb2

from spanrl.otlp_receiver.export_service import ExportService, protocol_error
from spanrl.otlp_receiver.ingest import Overloaded

logger = logging.getLogger(__name__)

TRACE_SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
METRICS_SERVICE = "opentelemetry.proto.collector.metrics.v1.MetricsService"
LOGS_SERVICE = "opentelemetry.proto.collector.logs.v1.LogsService"


class _AbortStatus(grpc.Status):
    def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata) -> None:
        self.code = code
        self.details = details
        self.trailing_metadata = trailing_metadata


def retry_trailers(message: str, retry_after_s: float) -> tuple[tuple[str, bytes], ...]:
    delay = Duration()
    delay.FromNanoseconds(int(retry_after_s * 1e9))
    retry_info = error_details_pb2.RetryInfo(retry_delay=delay)
    status = status_pb2.Status(code=code_pb2.UNAVAILABLE, message=message)
    status.details.add().Pack(retry_info)
    return (
        ("grpc-status-details-bin", status.SerializeToString()),
        ("google.rpc.retryinfo-bin", retry_info.SerializeToString()),
    )


def _authorization(context: grpc.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata():
        if key == "authorization":
            return value
    return None


class GrpcExportServer:
    """A grpc.Server with the three OTLP Export methods bound to an ``ExportService``."""

    def __init__(self, service: ExportService, host: str, port: int, workers: int, max_message_bytes: int,
                 credentials: grpc.ServerCredentials | None = None, max_concurrent_rpcs: int | None = None) -> None:
        self.service = service
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="spanrl-grpc"),
            maximum_concurrent_rpcs=max_concurrent_rpcs,
            options=[
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", 4 * 1024 * 1024),
                # grpcio shares a port between servers by default (SO_REUSEPORT): a second
                # receiver on the same port would silently take half of the agents' spans
                ("grpc.so_reuseport", 0),
            ],
        )
        handlers = [
            grpc.method_handlers_generic_handler(
                TRACE_SERVICE, {"Export": self._unary(self._export_traces)}
            ),
            grpc.method_handlers_generic_handler(
                METRICS_SERVICE, {"Export": self._unary(lambda body, ctx: self._export_other("metrics", body, ctx))}
            ),
            grpc.method_handlers_generic_handler(
                LOGS_SERVICE, {"Export": self._unary(lambda body, ctx: self._export_other("logs", body, ctx))}
            ),
        ]
        self.server.add_generic_rpc_handlers(handlers)
        try:
            if credentials is None:
                self.port = self.server.add_insecure_port(f"{host}:{port}")
            else:
                self.port = self.server.add_secure_port(f"{host}:{port}", credentials)
        except RuntimeError as exc:  # grpcio reports a failed bind this way
            raise OSError(f"cannot bind OTLP/gRPC on {host}:{port}: address in use? ({exc})") from exc
        if self.port == 0:
            raise OSError(f"cannot bind OTLP/gRPC on {host}:{port}: address in use?")

    @staticmethod
    def _unary(behaviour):
        # No request deserializer: the behaviour gets raw bytes and parses them itself.
        return grpc.unary_unary_rpc_method_handler(
            behaviour, response_serializer=lambda message: message.SerializeToString()
        )

    def _export_traces(self, body: bytes, context: grpc.ServicerContext):
        return self._guarded(context, lambda: self.service.export_traces(body))

    def _export_other(self, signal: str, body: bytes, context: grpc.ServicerContext):
        return self._guarded(context, lambda: self.service.export_other(signal, body))

    def _guarded(self, context: grpc.ServicerContext, call):
        try:
            self.service.check_authorization(_authorization(context))
            return call()
        except Exception as exc:
            mapped = protocol_error(exc)
            if mapped is None:
                logger.exception("unexpected error in Export")
                context.abort(grpc.StatusCode.INTERNAL, "internal error of the receiver (its details are in its log)")
            assert mapped is not None  # context.abort raised
            code, _ = mapped
            if isinstance(exc, Overloaded):
                context.abort_with_status(
                    _AbortStatus(code, str(exc), retry_trailers(str(exc), exc.retry_after_s))
                )
            if code == grpc.StatusCode.UNAVAILABLE:
                context.abort_with_status(_AbortStatus(code, str(exc), retry_trailers(str(exc), 1.0)))
            context.abort(code, str(exc))

    def start(self) -> None:
        self.server.start()

    def stop(self, grace_s: float = 5.0) -> None:
        self.server.stop(grace_s).wait()
