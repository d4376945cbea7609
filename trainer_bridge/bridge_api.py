"""The bridge's HTTP API for runners (JSON over HTTP, stdlib server, 127.0.0.1 by default).

Serves the protocol of ``spanrl.bridge_protocol`` (routes, payloads, status codes) over the
dispatcher's attempts. The runner (``spanrl.runner.bridge_client``) is its only client. With a
``token``, every request must carry ``Authorization: Bearer <token>`` (else 401).
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from spanrl import bridge_protocol as protocol
from spanrl.bridge_protocol import BridgeInfo, ClaimedAttempt, ClaimRequest, FinishRequest, TrainingFinished

from .task_dispatch import TaskDispatcher

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20  # runners send small JSON objects
LISTEN_BACKLOG = 4096  # capped by the kernel's net.core.somaxconn


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

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - stdlib signature
        logger.debug("bridge api: " + format, *args)

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
            if not isinstance(body, dict):
                raise BridgeAPIError(400, "request body must be a JSON object")
            status, payload = route(body)
        except BridgeAPIError as exc:
            status, payload = exc.status, protocol.error_body(str(exc))
        except Exception as exc:  # a bug must not kill the server thread
            logger.exception("bridge api failed on %s", self.path)
            status, payload = 500, protocol.error_body(f"internal error: {exc}")
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


class BridgeAPI:
    """Serves the dispatcher's attempts to runners; start with ``start()``, stop with ``stop()``."""

    def __init__(
        self,
        dispatcher: TaskDispatcher,
        policy: PolicyInfo,
        policy_version: Callable[[], int],
        host: str = "127.0.0.1",
        port: int = 8100,
        token: str | None = None,
    ) -> None:
        self.dispatcher = dispatcher
        self.policy = policy
        self.policy_version = policy_version
        self.token = token or None
        self._server = _BridgeHTTPServer((host, port), _Handler)
        self._server.api = self
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        host = host.decode() if isinstance(host, bytes) else host
        return f"http://{host}:{port}"

    def start(self) -> BridgeAPI:
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="spanrl-bridge-api", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def check_authorization(self, header: str | None) -> None:
        if self.token is None:
            return
        expected = f"Bearer {self.token}".encode()
        if header is None or not hmac.compare_digest(header.strip().encode(), expected):
            raise BridgeAPIError(401, "missing or wrong bearer token: give `spanrl run` the trainer's "
                                      "bridge_token (--bridge-token or OTEL_SPANRL_RUN_BRIDGE_TOKEN)")

    # --- routes ----------------------------------------------------------------------------
    def info(self, _body: dict) -> tuple[int, dict]:
        return 200, BridgeInfo(self.policy.base_url, self.policy.model, self.policy_version(),
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
        claimed = ClaimedAttempt.of(attempt, self.dispatcher.rollout_timeout_s, self.policy.base_url,
                                    self.policy.model)
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
