"""The fuzzers of spanrl's HTTP JSON servers (hypothesis), each over its real server: the bridge
API, the policy server's OpenAI routes (with the agents' token), its weights route (with the
admin token, the agents' token and none), the verl gateway in front of a policy server, and slow
clients of each.

Every case is a request a client could send: known and unknown paths and methods, mutated valid
bodies, random JSON and bytes, JSON nested past Python's recursion limit, and odd headers (a
non-ASCII or huge ``Authorization``, wrong schemes, odd content types). A case "crashes" when
the answer is a 5xx, a status the server does not document for it, an error without a message,
or no answer within ``HANG_S``. A slow client sends part of a request and stalls: the stdlib
servers (bridge, receiver) must drop it after their read timeout, and every server must go on
answering others meanwhile.

Used by ``test_fuzz.py`` (short runs in CI) and ``bench/reliability.py`` (the figures of
docs/reliability.md).
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st
from reliability_fuzz import HANG_S, JSON_VALUES, FuzzReport, deep_json, mutated_json, run_cases

# Authorization values no server should choke on (bytes go on the wire as they are)
ODD_AUTHORIZATION: list[str | bytes] = [
    b"Bearer caf\xe9", "Bearer \u00e9t\u00e9".encode(), b"Bearer \xff\xfe\x00", "Bearer " + "x" * 6000,
    "Bearer", "", "Basic dXNlcjpwYXNz", "bearer lower-case", "Bearer  two  spaces", "x",
]
METHODS = ["POST", "POST", "POST", "GET", "GET", "PUT", "DELETE", "PATCH", "OPTIONS"]


@dataclass(frozen=True)
class HttpCase:
    method: str
    path: str
    headers: dict
    body: bytes


def http_cases(paths: list[str], seeds: list[dict], auth: list[str],
               adjust: Callable[[Any], Any] = lambda body: body) -> st.SearchStrategy[HttpCase]:
    """Requests to an HTTP JSON API. ``auth``: the Authorization values the server knows
    (most cases carry one of them, so the routes behind the check are reached)."""
    bodies = st.one_of(
        mutated_json(seeds).map(lambda d: json.dumps(adjust(d)).encode()),
        st.sampled_from([json.dumps(adjust(json.loads(json.dumps(s)))).encode() for s in seeds]),
        JSON_VALUES.map(lambda d: json.dumps(d).encode()),
        st.binary(max_size=64),
        st.builds(deep_json, st.integers(100, 20_000), st.booleans()),
    )
    headers = st.fixed_dictionaries(
        {"Content-Type": st.sampled_from(["application/json", "text/plain", "", "application/json; charset=latin-1"])},
        optional={"Authorization": st.sampled_from(ODD_AUTHORIZATION), "X-Odd": st.sampled_from(ODD_AUTHORIZATION),
                  "x-spanrl-rollout-id": st.text(st.characters(blacklist_characters="\r\n"), max_size=40).map(
                      lambda t: t.encode("utf-8", "replace"))})  # any bytes a client can put in a header
    if auth:
        with_token = [headers.map(lambda h, a=a: {**h, "Authorization": a}) for a in auth]
        headers = st.one_of(headers, *with_token, *with_token)  # most cases carry a known token
    path = st.one_of(st.sampled_from(paths), st.text(alphabet="/abcv1?=%.-", max_size=20).map(lambda p: "/" + p))
    return st.builds(HttpCase, st.sampled_from(METHODS), path, headers, bodies)


def send(port: int, case: HttpCase, context: ssl.SSLContext | None = None) -> tuple[int, dict, bytes]:
    connection: http.client.HTTPConnection
    if context is None:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=HANG_S)
    else:
        connection = http.client.HTTPSConnection("127.0.0.1", port, timeout=HANG_S, context=context)
    try:
        connection.request(case.method, case.path, body=case.body, headers=case.headers)
        answer = connection.getresponse()
        return answer.status, {k.lower(): v for k, v in answer.getheaders()}, answer.read()
    finally:
        connection.close()


def fuzz_http_api(name: str, port: int, cases: int, strategy: st.SearchStrategy[HttpCase],
                  expected: Callable[[HttpCase, int], bool], message_of: Callable[[bytes], str | None],
                  context: ssl.SSLContext | None = None) -> FuzzReport:
    """Send each case; a 5xx, an unexpected status or an error answer without a message is a crash."""
    report = FuzzReport(name)

    def check(case: HttpCase) -> None:
        report.cases += 1
        started = time.monotonic()
        try:
            status, _, data = send(port, case, context)
        except Exception as exc:  # noqa: BLE001
            report.crash(case, f"no answer: {exc!r}")
            return
        if status >= 500:
            report.server_errors += 1
        if status >= 500 or not expected(case, status):
            report.crash(case, f"status {status}: {data[:200]!r}")
        elif status >= 400 and not message_of(data):
            report.crash(case, f"status {status} without a message: {data[:200]!r}")
        if time.monotonic() - started > HANG_S:
            report.crash(case, f"hang: {time.monotonic() - started:.1f}s")

    run_cases(cases, strategy, check)
    return report


def bridge_message(data: bytes) -> str | None:
    try:
        return json.loads(data).get("error")
    except Exception:  # noqa: BLE001
        return None


def openai_message(data: bytes) -> str | None:
    """The OpenAI-style error's message; for a request the HTTP parser itself refused (uvicorn's
    plain-text 400), that text."""
    try:
        return json.loads(data)["error"]["message"]
    except Exception:  # noqa: BLE001
        text = data.decode("utf-8", "replace").strip()
        return text if text and not text.startswith("{") else None


def receiver_message(data: bytes) -> str | None:
    """The receiver's error message: its JSON ``message`` (spanrl's routes, google.rpc.Status in
    JSON), else a google.rpc.Status in protobuf."""
    try:
        return json.loads(data).get("message")
    except Exception:  # noqa: BLE001
        from google.rpc import status_pb2

        try:
            return status_pb2.Status.FromString(data).message or None
        except Exception:  # noqa: BLE001
            return None


def fuzz_feedback(port: int, token: str, cases: int) -> FuzzReport:
    """The receiver's ``POST /spanrl/v1/feedback`` (late feedback) under ``cases`` requests."""
    seeds = [{"rollout_id": "r-1", "value": 1.0, "idempotency_key": "k"},
             {"response_id": "resp-1", "value": -0.5, "name": "thumbs", "comment": "ok", "idempotency_key": "k2"},
             {"trace_id": "ab" * 16, "value": 0, "idempotency_key": "k3"},
             {"span_id": "cd" * 8, "value": 100, "idempotency_key": "k4"}]
    strategy = http_cases(["/spanrl/v1/feedback"], seeds, [f"Bearer {token}"])
    allowed = {200, 202, 400, 401, 404, 405, 409, 413, 415}
    return fuzz_http_api("receiver feedback", port, cases, strategy, lambda case, status: status in allowed,
                         receiver_message)


def fuzz_bridge(api, token: str, cases: int) -> FuzzReport:
    """The bridge API (``BridgeAPI`` with an open round) under ``cases`` requests."""
    from spanrl import bridge_protocol as protocol

    seeds = [{"claim_id": "c-1"}, {}, {"rollout_id": "r", "status": "ok"},
             {"rollout_id": "r", "status": "failed", "error": "boom"}]
    strategy = http_cases([protocol.INFO_PATH, protocol.CLAIM_PATH, protocol.FINISH_PATH], seeds, [f"Bearer {token}"])
    allowed = {200, 204, 400, 401, 404, 405, 410}
    return fuzz_http_api("bridge", int(api.url.rsplit(":", 1)[1]), cases, strategy,
                         lambda case, status: status in allowed, bridge_message)


def _small_generation(body: Any) -> Any:
    """Keep generation short (tiny model, thousands of cases): cap token counts and n."""
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            if not isinstance(body.get(key), int) or body[key] > 2:
                body[key] = 2
        if isinstance(body.get("n"), int) and body["n"] > 2:
            body["n"] = 2
    return body


def generation_seeds(model: str) -> list[dict]:
    return [
        {"model": model, "messages": [{"role": "user", "content": "1+1?"}], "max_tokens": 2, "logprobs": True},
        {"model": model, "messages": [{"role": "system", "content": "x"}, {"role": "user", "content": [
            {"type": "text", "text": "hi"}]}], "max_tokens": 2, "stream": True, "n": 2, "temperature": 0.5},
        {"model": model, "prompt": "CALC 1", "max_tokens": 2, "logprobs": 1, "stop": ["\n"], "seed": 3},
        {"model": model, "input": "hi", "max_output_tokens": 2, "instructions": "be brief"},
        {"model": model, "input": [{"role": "user", "content": "hi"}], "max_output_tokens": 2},
    ]


GENERATION_PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/responses"]


def fuzz_policy_server(port: int, model: str, cases: int, token: str | None = None) -> FuzzReport:
    """The policy server's OpenAI-compatible routes (a tiny real model behind them); with
    ``token``, most cases carry it."""
    paths = [*GENERATION_PATHS, "/v1/models", "/health", "/spanrl/v1/policy", "/v1/responses/resp_x"]
    strategy = http_cases(paths, generation_seeds(model), [f"Bearer {token}"] if token else [], _small_generation)
    return fuzz_http_api("policy-server", port, cases, strategy, lambda case, status: status < 500, openai_message)


def fuzz_weights_route(port: int, cases: int, admin_token: str, agent_token: str, inside: str) -> FuzzReport:
    """``POST /spanrl/v1/weights`` of a server with an admin: paths inside its folder (no model
    there) and out of it, any version, the admin's token, the agents' and odd ones. Nothing
    loads, nothing answers 5xx; only 400, 401, 403, 404, 405, 409 and 422 are expected."""
    seeds = [{"path": inside, "version": 10**6}, {"path": "/", "version": 1}, {"path": f"{inside}/../..", "version": 2},
             {"path": inside, "version": -1}, {"path": "", "version": 0}]
    strategy = http_cases(["/spanrl/v1/weights"], seeds, [f"Bearer {admin_token}", f"Bearer {agent_token}"])
    allowed = {400, 401, 403, 404, 405, 409, 413, 422}
    return fuzz_http_api("weights-route", port, cases, strategy, lambda case, status: status in allowed,
                         openai_message)


def fuzz_gateway(port: int, cases: int, token: str) -> FuzzReport:
    """The verl gateway in front of a real upstream: every route, the agents' token in most cases."""
    paths = [*GENERATION_PATHS, "/v1/models", "/health", "/spanrl/gateway/stats"]
    strategy = http_cases(paths, generation_seeds("policy"), [f"Bearer {token}"], _small_generation)
    return fuzz_http_api("gateway", port, cases, strategy, lambda case, status: status < 500, openai_message)


# --- slow clients ------------------------------------------------------------------------------

@dataclass(frozen=True)
class SlowClient:
    """A request cut after ``keep`` bytes (0: connect and say nothing), then silence."""

    request: bytes
    keep: int


def slow_clients(path: str, authorization: str) -> st.SearchStrategy[SlowClient]:
    body = json.dumps({"claim_id": "slow", "messages": [{"role": "user", "content": "hi"}]}).encode()
    request = (f"POST {path} HTTP/1.1\r\nHost: fuzz\r\nContent-Type: application/json\r\nAuthorization: "
               f"{authorization}\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    return st.builds(SlowClient, st.just(request), st.integers(0, len(request) - 1))


def fuzz_slow_clients(name: str, port: int, cases: int, path: str, authorization: str,
                      still_served: Callable[[], bool], drops_them: bool, read_timeout_s: float,
                      held_at_once: int = 8) -> FuzzReport:
    """``held_at_once`` clients at a time each send part of a request to ``path`` and stall.
    Meanwhile ``still_served()`` (an ordinary request) must succeed; with ``drops_them`` each
    stalled connection must be closed by the server within ``read_timeout_s`` + ``HANG_S``."""
    report = FuzzReport(f"{name}-slow-clients")

    def check(batch: list[SlowClient]) -> None:
        report.cases += len(batch)
        held = []
        for client in batch:
            connection = socket.create_connection(("127.0.0.1", port), timeout=HANG_S)
            connection.sendall(client.request[:client.keep])
            held.append((client, connection))
        try:
            if not still_served():
                report.crash(batch, "an ordinary request failed while slow clients held connections")
            if drops_them:
                for client, connection in held:
                    _expect_dropped(connection, client, read_timeout_s, report)
        finally:
            for _, connection in held:
                connection.close()

    examples = max(1, -(-cases // held_at_once))  # held_at_once clients each
    run_cases(examples, st.lists(slow_clients(path, authorization), min_size=held_at_once, max_size=held_at_once),
              check)
    return report


def _expect_dropped(connection: socket.socket, client: SlowClient, read_timeout_s: float, report: FuzzReport) -> None:
    connection.settimeout(read_timeout_s + HANG_S)
    try:
        while connection.recv(4096):
            pass  # an answer (e.g. a 400 for the part it could parse) is fine; the close is what counts
    except TimeoutError:
        report.crash(client, f"connection still held after {read_timeout_s + HANG_S:.0f} s of silence")
    except ConnectionError:
        pass  # reset: dropped too


def still_answers(url: str, headers: dict, body: dict | None = None,
                  context: ssl.SSLContext | None = None) -> Callable[[], bool]:
    """A check that ``url`` answers an ordinary request (GET, or POST of ``body``) with 2xx."""
    import httpx

    def check() -> bool:
        try:
            verify: Any = context if context is not None else True
            if body is None:
                return httpx.get(url, headers=headers, timeout=HANG_S * 6, verify=verify).is_success
            return httpx.post(url, json=body, headers=headers, timeout=HANG_S * 6, verify=verify).is_success
        except Exception:  # noqa: BLE001 - a failure is the finding
            return False

    return check
