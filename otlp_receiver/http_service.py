"""OTLP/HTTP: ``POST /v1/traces`` (protobuf or JSON), ``/v1/metrics`` and ``/v1/logs``
(accepted and dropped, but for their reward events: late feedback), spanrl's ``POST
/spanrl/v1/rollouts/<id>/complete`` and ``POST /spanrl/v1/feedback`` (late feedback,
``feedback_intake``), ``GET /spanrl/v1/health`` and ``GET /spanrl/v1/stats`` (the ingest and
feedback counters, behind the token).

Started by ``server.py`` on a stdlib ``ThreadingHTTPServer`` (no extra dependency; one thread
per connection, keep-alive). Follows the OTLP/HTTP spec: the response has the request's
content type; errors carry a google.rpc.Status body; overload answers 503 with Retry-After;
gzip request bodies are accepted (and bounded by the message limit after decompression).
With an SSL context (``tls.py``) the port speaks HTTPS only. A client silent for
``read_timeout_s`` (mid-request, or between keep-alive requests) loses its connection, so a slow
client cannot hold a thread forever. A failure of ours is logged; its text never reaches a
response.
"""

from __future__ import annotations

import json
import logging
import math
import socket
import sqlite3
import ssl
import sys
import threading
import zlib
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote

from google.protobuf import json_format
from google.rpc import status_pb2

from spanrl.otlp_receiver.export_service import ExportService, TooLarge, protocol_error
from spanrl.otlp_receiver.feedback_intake import FeedbackError, parse_feedback_body
from spanrl.otlp_receiver.feedback_store import FeedbackStore, StoredFeedback
from spanrl.otlp_receiver.ingest import Overloaded
from spanrl.otlp_receiver.otlp_decode import PayloadError
from spanrl.otlp_receiver.rewards import RewardPolicy
from spanrl.otlp_receiver.store import (
    COMPLETION_ALREADY_ASSEMBLED,
    COMPLETION_PENDING,
    PENDING_COMPLETION_TTL_S,
    SpanStore,
    StoreError,
)

logger = logging.getLogger(__name__)

PROTOBUF = "application/x-protobuf"
JSON = "application/json"
COMPLETE_PREFIX = "/spanrl/v1/rollouts/"
COMPLETE_SUFFIX = "/complete"
STATS_PATH = "/spanrl/v1/stats"
FEEDBACK_PATH = "/spanrl/v1/feedback"
TLS_HANDSHAKE_TIMEOUT_S = 10.0
SIGNAL_PATHS = {"/v1/traces": "traces", "/v1/metrics": "metrics", "/v1/logs": "logs"}


class UnsupportedMediaType(ValueError):
    pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "spanrl-receiver"
    server: _Server

    def setup(self) -> None:
        if isinstance(self.request, ssl.SSLSocket):
            # The handshake runs here, in the connection's own thread (not in the accept loop,
            # where one slow or plaintext client would stall every other); bounded in time.
            self.request.settimeout(TLS_HANDSHAKE_TIMEOUT_S)
            self.request.do_handshake()
        super().setup()
        self.request.settimeout(self.server.read_timeout_s)  # bounds every read of the request

    def log_message(self, format: str, *args) -> None:  # route the access log to logging
        logger.debug("%s " + format, self.address_string(), *args)

    def __getattr__(self, name: str):
        if name.startswith("do_"):  # any other method (PUT, PATCH, made-up ones): 405, not the stdlib's 501
            return self._method_not_allowed
        raise AttributeError(name)

    def _method_not_allowed(self) -> None:
        self.send_error(405, f"{self.command} is not served here: POST /v1/traces (OTLP/HTTP) and spanrl's routes")

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The stdlib's own refusals (a malformed request line, headers too long) and 405, as a
        google.rpc.Status in JSON (not the stdlib's HTML page); the connection closes."""
        self.close_connection = True
        self._send_error(code, message or HTTPStatus(code).phrase, json_encoding=True)

    def do_GET(self) -> None:
        if self.path == "/spanrl/v1/health":
            self._send(200, JSON, b'{"status": "ok"}')
        elif self.path == STATS_PATH:
            try:
                self.server.export.check_authorization(self.headers.get("Authorization"))
            except Exception as exc:
                self._send(401, JSON, json.dumps({"message": str(exc)}).encode())
                return
            stats: dict = dict(self.server.export.stats())
            if self.server.feedback is not None:
                stats["feedback"] = self.server.feedback.counters()
            self._send(200, JSON, json.dumps(stats).encode())
        else:
            self._send(404, JSON, b'{"message": "not found"}')

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        json_encoding = False
        try:
            content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
            json_encoding = content_type == JSON
            self.server.export.check_authorization(self.headers.get("Authorization"))
            if path in SIGNAL_PATHS:
                if content_type not in (PROTOBUF, JSON):
                    raise UnsupportedMediaType(
                        f"Content-Type must be {PROTOBUF} or {JSON}, got {content_type or 'none'!r}"
                    )
                body = self._read_body()
                signal = SIGNAL_PATHS[path]
                if signal == "traces":
                    response = self.server.export.export_traces(body, json_encoding)
                else:
                    response = self.server.export.export_other(signal, body, json_encoding)
                self._send_message(200, response, json_encoding)
            elif path == FEEDBACK_PATH and self.server.feedback is not None:
                if content_type != JSON:
                    raise UnsupportedMediaType(f"Content-Type must be {JSON}, got {content_type or 'none'!r}")
                self._post_feedback(self._read_body())
            elif path.startswith(COMPLETE_PREFIX) and path.endswith(COMPLETE_SUFFIX):
                self._read_body()
                rollout_id = unquote(path[len(COMPLETE_PREFIX) : -len(COMPLETE_SUFFIX)])
                if not rollout_id:
                    raise PayloadError("the URL names no rollout id")
                completion = self.server.store.complete_rollout(rollout_id)
                answer = {"rollout_id": rollout_id, "completion": completion}
                if completion == COMPLETION_PENDING:
                    answer["message"] = (
                        "no span of this rollout has arrived yet: no rollout is created; the completion"
                        f" applies when its spans arrive within {PENDING_COMPLETION_TTL_S:.0f} s")
                status = 200 if completion == COMPLETION_ALREADY_ASSEMBLED else 202
                self._send(status, JSON, json.dumps(answer).encode())
            else:
                self._read_body()
                self._send(404, JSON, json.dumps({"message": f"no such endpoint: POST {path}"}).encode())
        except UnsupportedMediaType as exc:
            self.close_connection = True  # the body was not read
            self._send_error(415, str(exc), json_encoding)
        except TimeoutError:  # the body did not arrive within read_timeout_s: drop the connection
            self.close_connection = True
        except Exception as exc:
            mapped = protocol_error(exc)
            if mapped is None:
                logger.exception("unexpected error in %s", path)
                self._send_error(500, "internal error of the receiver (its details are in its log)", json_encoding)
                return
            _, status = mapped
            headers = {}
            if status == 503:
                retry_after = exc.retry_after_s if isinstance(exc, Overloaded) else 1.0
                headers["Retry-After"] = str(max(1, math.ceil(retry_after)))
            if status in (413, 401):
                self.close_connection = True  # the unread body must not be parsed as a request
            self._send_error(status, str(exc), json_encoding, headers)

    def _post_feedback(self, body: bytes) -> None:
        """Keep a feedback (once per idempotency key): 202 while its target is unknown, 200 once
        joined or when the key was seen; 400 naming the field of a bad body; 409 for a key used
        with another content."""
        book, policy = self.server.feedback, self.server.feedback_policy
        assert book is not None and policy is not None
        try:
            feedback, clipped = parse_feedback_body(body, self.headers.get("Idempotency-Key"), policy)
        except FeedbackError as exc:
            self._send(400, JSON, json.dumps({"message": str(exc), "field": exc.field}).encode())
            return
        result = book.submit(feedback)
        key = feedback.key.removeprefix("http:")
        if result.conflict:
            self._send(409, JSON, json.dumps({
                "message": f"idempotency_key {key!r} was used for another feedback; nothing changed",
                "field": "idempotency_key"}).encode())
            return
        if clipped and not result.replayed:
            book.count("clipped")
        stored = result.stored
        if stored.state == "pending" and not result.replayed:
            stored = self._join_if_just_assembled(book, stored)
        answer = {"idempotency_key": key, "state": stored.state, "replayed": result.replayed,
                  "rollout_id": stored.rollout_id, "call_span_id": stored.call_span_id,
                  "value": stored.feedback.value}
        if stored.state == "pending":
            answer["message"] = ("its target is not assembled (yet): kept, and joined when it is"
                                 f" (for at most {book.ttl_s:g} s)")
        self._send(202 if stored.state == "pending" and not result.replayed else 200, JSON,
                   json.dumps(answer).encode())

    def _join_if_just_assembled(self, book: FeedbackStore, stored: StoredFeedback) -> StoredFeedback:
        """Index the rollouts assembled since the assembler's last pass, so that a feedback for a
        rollout the store already shows joins in its own answer rather than on the next pass."""
        try:
            book.catch_up(self.server.store)
        except (sqlite3.Error, StoreError) as exc:  # kept pending: the assembler joins it later
            logger.warning("late feedback kept pending: indexing the new rollouts failed (%s)", exc)
            return stored
        return book.get(stored.feedback.key) or stored

    def _read_body(self) -> bytes:
        limit = self.server.max_message_bytes
        if (self.headers.get("Transfer-Encoding") or "").lower() == "chunked":
            raw = self._read_chunked(limit)
        else:
            header = self.headers.get("Content-Length") or "0"
            try:
                length = int(header)
            except ValueError:
                length = -1
            if length < 0:
                # rfile.read(-1) would read until the client closes, with no limit
                self.close_connection = True  # where the body ends is unknown
                raise PayloadError(f"Content-Length must be a non-negative integer, got {header!r}")
            if length > limit:
                raise TooLarge(f"request body of {length} bytes exceeds the limit of {limit} bytes")
            raw = self.rfile.read(length)
        encoding = (self.headers.get("Content-Encoding") or "identity").lower()
        if encoding == "gzip":
            decompressor = zlib.decompressobj(16 + zlib.MAX_WBITS)
            try:
                body = decompressor.decompress(raw, limit + 1)
            except zlib.error as exc:
                raise PayloadError(f"Content-Encoding gzip but the body is not gzip: {exc}") from exc
            if len(body) > limit:
                raise TooLarge(f"decompressed request exceeds the limit of {limit} bytes")
            return body
        if encoding != "identity":
            raise PayloadError(f"unsupported Content-Encoding {encoding!r} (use gzip or none)")
        return raw

    def _read_chunked(self, limit: int) -> bytes:
        parts: list[bytes] = []
        total = 0
        while True:
            line = self.rfile.readline(1024)
            try:
                size = int(line.split(b";")[0].strip(), 16)
            except ValueError:
                size = -1
            if size < 0:  # a negative size would make rfile.read() read until the client closes
                self.close_connection = True
                raise PayloadError(f"malformed chunked transfer encoding: chunk size line {line[:40]!r}")
            if size == 0:
                while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                    pass
                return b"".join(parts)
            total += size
            if total > limit:
                raise TooLarge(f"request body exceeds the limit of {limit} bytes")
            parts.append(self.rfile.read(size))
            self.rfile.readline(16)

    def _send_message(self, status: int, message, json_encoding: bool, headers=None) -> None:
        if json_encoding:
            body = json.dumps(json_format.MessageToDict(message)).encode()
            self._send(status, JSON, body, headers)
        else:
            self._send(status, PROTOBUF, message.SerializeToString(), headers)

    def _send_error(self, status: int, message: str, json_encoding: bool, headers=None) -> None:
        self._send_message(status, status_pb2.Status(code=_rpc_code(status), message=message), json_encoding, headers)

    def _send(self, status: int, content_type: str, body: bytes, headers=None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)


def _rpc_code(http_status: int) -> int:
    return {400: 3, 401: 16, 404: 5, 405: 12, 413: 8, 414: 3, 415: 3, 431: 3, 503: 14}.get(http_status, 13)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # socketserver's listen backlog of 5 resets connections when many exporters connect at once
    request_queue_size = 4096  # capped by the kernel's net.core.somaxconn

    def __init__(self, address, export: ExportService, store: SpanStore, max_message_bytes: int,
                 ssl_context: ssl.SSLContext | None = None, read_timeout_s: float = 30.0,
                 feedback: FeedbackStore | None = None, feedback_policy: RewardPolicy | None = None) -> None:
        self.export = export
        self.store = store
        self.feedback = feedback
        self.feedback_policy = feedback_policy
        self.max_message_bytes = max_message_bytes
        self.read_timeout_s = read_timeout_s
        super().__init__(address, _Handler)
        if ssl_context is not None:
            self.socket = ssl_context.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)

    def handle_error(self, request, client_address) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, (ssl.SSLError, socket.timeout, ConnectionError)):
            # a plaintext client on the TLS port, a client that left mid-handshake: its problem
            logger.info("OTLP/HTTP connection from %s refused: %s", client_address[0], error)
            return
        super().handle_error(request, client_address)


class HttpExportServer:
    def __init__(self, export: ExportService, store: SpanStore, host: str, port: int, max_message_bytes: int,
                 ssl_context: ssl.SSLContext | None = None, read_timeout_s: float = 30.0,
                 feedback: FeedbackStore | None = None, feedback_policy: RewardPolicy | None = None) -> None:
        try:
            self.server = _Server((host, port), export, store, max_message_bytes, ssl_context, read_timeout_s,
                                  feedback, feedback_policy)
        except OSError as exc:
            raise OSError(f"cannot bind OTLP/HTTP on {host}:{port}: {exc.strerror or exc}") from exc
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.2}, name="spanrl-http", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)
