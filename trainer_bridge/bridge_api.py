"""The bridge's HTTP API for runners (JSON over HTTP, stdlib server, 127.0.0.1 by default).

Serves the protocol of ``spanrl.bridge_protocol`` (routes, payloads, status codes) over the
dispatcher's attempts. The runner (``spanrl.runner.bridge_client``) is its only client. With a
``token``, every request must carry ``Authorization: Bearer <token>`` (else 401); with
``tls_cert``/``tls_key`` it speaks HTTPS only. A client silent for ``read_timeout_s`` (mid-request
or between keep-alive requests) loses its connection, so none holds a thread forever. Bound
beyond loopback without a token, or with one but no TLS, it logs one warning at start.
"""

from __future__ import annotations

import json
import logging
import socket
import ssl
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from spanrl import bridge_protocol as protocol
from spanrl.bridge_protocol import BridgeInfo, ClaimedAttempt, ClaimRequest, FinishRequest, TrainingFinished
from spanrl.server_security import bearer_token_matches, server_ssl_context, warn_if_exposed

from .task_dispatch import TaskDispatcher

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20  # runners send small JSON objects
LISTEN_BACKLOG = 4096  # capped by the kernel's net.core.somaxconn
READ_TIMEOUT_S = 30.0  # a runner's requests are small: 30 s of silence is a stuck or hostile client
TLS_HANDSHAKE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class PolicyInfo:
    """What a runner needs to point its agents at the policy."""

    base_url: str
    model: str


class BridgeAPIError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Handler(BaseHTTPRequestHandler):
    server: _BridgeHTTPServer
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        if isinstance(self.request, ssl.SSLSocket):
            # the handshake runs in the connection's own thread, bounded in time (in the accept
            # loop one slow or plaintext client would stall every other)
            self.request.settimeout(TLS_HANDSHAKE_TIMEOUT_S)
            self.request.do_handshake()
        super().setup()
        self.request.settimeout(self.server.read_timeout_s)  # bounds every read of the request

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - stdlib signature
        logger.debug("bridge api: " + format, *args)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("do_"):  # any other method (PUT, PATCH, made-up ones): 405, not the stdlib's 501
            return self._method_not_allowed
        raise AttributeError(name)

    def _method_not_allowed(self) -> None:
        self.send_error(405, f"{self.command} is not served here: GET {protocol.INFO_PATH}, POST "
                             f"{protocol.CLAIM_PATH} or {protocol.FINISH_PATH}")

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The stdlib's own refusals (a malformed request line, headers too long) and 405, as the
        protocol's JSON error body (not the stdlib's HTML page); the connection closes."""
        self.close_connection = True
        data = json.dumps(protocol.error_body(message or HTTPStatus(code).phrase)).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        self._dispatch({protocol.INFO_PATH: self.server.api.info})

    def do_POST(self) -> None:  # noqa: N802 - stdlib name
        self._dispatch({protocol.CLAIM_PATH: self.server.api.claim, protocol.FINISH_PATH: self.server.api.finish})

    def _dispatch(self, routes: dict[str, Callable[[dict], tuple[int, dict | None]]]) -> None:
        route = routes.get(self.path.split("?", 1)[0])
        try:
            self.server.api.check_authorization(self.headers.get("Authorization"))
            if route is None:
                raise BridgeAPIError(404, f"no such endpoint: {self.command} {self.path}")
            raw = self._read_body()
            try:
                body = json.loads(raw) if raw.strip() else {}
            except ValueError as exc:  # JSONDecodeError, or UnicodeDecodeError: not UTF-8/16/32 text
                raise BridgeAPIError(400, f"request body is not JSON: {exc}") from exc
            except RecursionError as exc:  # nested deeper than Python recurses
                raise BridgeAPIError(400, "request body is nested too deeply") from exc
            if not isinstance(body, dict):
                raise BridgeAPIError(400, "request body must be a JSON object")
            status, payload = route(body)
        except BridgeAPIError as exc:
            status, payload = exc.status, protocol.error_body(str(exc))
        except TimeoutError:  # the body did not arrive within read_timeout_s: drop the connection
            self.close_connection = True
            return
        except Exception:  # a bug must not kill the server thread; its text stays in the log
            logger.exception("bridge api failed on %s", self.path)
            status, payload = 500, protocol.error_body("internal error of the bridge (its details are in its log)")
        data = b"" if payload is None else json.dumps(payload).encode()
        self.send_response(status)
        if status == protocol.NOTHING_TO_CLAIM:
            self.send_header("Retry-After", str(protocol.RETRY_AFTER_S))
        if status >= 400:  # the body may not have been read: do not reuse the connection
            self.send_header("Connection", "close")
            self.close_connection = True
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if data:
            self.wfile.write(data)

    def _read_body(self) -> bytes:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError as exc:
            raise BridgeAPIError(400, "Content-Length is not a number") from exc
        if not 0 <= length <= MAX_BODY_BYTES:
            raise BridgeAPIError(400, f"Content-Length must be 0..{MAX_BODY_BYTES}, got {length}")
        return self.rfile.read(length) if length else b""


class _BridgeHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    # The listen backlog. socketserver's default of 5 made the kernel reset connections when
    # dozens of runners' workers called at once (`spanrl demo`, 32 agents: 25 resets a run).
    request_queue_size = LISTEN_BACKLOG
    api: BridgeAPI
    read_timeout_s: float = READ_TIMEOUT_S

    def handle_error(self, request, client_address) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, (ssl.SSLError, socket.timeout, ConnectionError)):
            # a plaintext client on the TLS port, one that left or stalled mid-handshake
            logger.info("bridge api: connection from %s refused: %s", client_address[0], error)
            return
        super().handle_error(request, client_address)


class BridgeAPI:
    """Serves the dispatcher's attempts to runners; start with ``start()``, stop with ``stop()``.
    The port is bound when it is made and listened on from ``start()``: a caller that starts a
    backend in between (minutes, for verl) holds the port, and runners are refused until then;
    ``policy`` may be given then, once the backend's endpoint is known."""

    def __init__(
        self,
        dispatcher: TaskDispatcher,
        policy: PolicyInfo | None,
        policy_version: Callable[[], int],
        host: str = "127.0.0.1",
        port: int = 8100,
        token: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        read_timeout_s: float = READ_TIMEOUT_S,
    ) -> None:
        self.dispatcher = dispatcher
        self.policy = policy
        self.policy_version = policy_version
        self.token = token or None
        self.tls = bool(tls_cert and tls_key)
        context = server_ssl_context(tls_cert, tls_key) if tls_cert and tls_key else None  # read before binding
        self._server = _BridgeHTTPServer((host, port), _Handler, bind_and_activate=False)
        try:
            self._server.server_bind()
        except BaseException:
            self._server.server_close()
            raise
        if context is not None:
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True,
                                                      do_handshake_on_connect=False)
        self._server.api = self
        self._server.read_timeout_s = read_timeout_s
        self._thread: threading.Thread | None = None
        warn_if_exposed("the bridge's task API", host, self.token is not None, self.tls, logger,
                        "bridge_token, tls_cert/tls_key")

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        host = host.decode() if isinstance(host, bytes) else host
        return f"{'https' if self.tls else 'http'}://{host}:{port}"

    def start(self, policy: PolicyInfo | None = None) -> BridgeAPI:
        self.policy = policy or self.policy
        if self.policy is None:
            raise RuntimeError("the bridge's task API needs the policy endpoint before it starts")
        self._server.server_activate()
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="spanrl-bridge-api", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:  # shutdown() waits for serve_forever, which never ran otherwise
            self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _started_policy(self) -> PolicyInfo:
        assert self.policy is not None, "start() sets it"
        return self.policy

    def check_authorization(self, header: str | None) -> None:
        if self.token is None:
            return
        if not bearer_token_matches(header, self.token):
            raise BridgeAPIError(401, "missing or wrong bearer token: give `spanrl run` the trainer's "
                                      "bridge_token (--bridge-token or OTEL_SPANRL_RUN_BRIDGE_TOKEN)")

    # --- routes ----------------------------------------------------------------------------
    def info(self, _body: dict) -> tuple[int, dict]:
        policy = self._started_policy()
        return 200, BridgeInfo(policy.base_url, policy.model, self.policy_version(),
                               self.dispatcher.rollout_timeout_s).to_json()

    def claim(self, body: dict) -> tuple[int, dict | None]:
        try:
            request = ClaimRequest.from_json(body)
        except ValueError as exc:
            raise BridgeAPIError(400, str(exc)) from exc
        try:
            attempt = self.dispatcher.claim(request.claim_id)
        except TrainingFinished:
            return protocol.TRAINING_FINISHED, protocol.error_body("training finished")
        if attempt is None:
            return protocol.NOTHING_TO_CLAIM, None
        policy = self._started_policy()
        claimed = ClaimedAttempt.of(attempt, self.dispatcher.rollout_timeout_s, policy.base_url, policy.model)
        return 200, claimed.to_json()

    def finish(self, body: dict) -> tuple[int, dict]:
        try:
            request = FinishRequest.from_json(body)
            known = self.dispatcher.finish(request.rollout_id, request.status, request.error)
        except ValueError as exc:  # a BridgeProtocolError, or a status the dispatcher refuses
            raise BridgeAPIError(400, str(exc)) from exc
        if not known:
            raise BridgeAPIError(404, f"rollout {request.rollout_id!r} is not part of the open round")
        return 200, {protocol.OK: True}
