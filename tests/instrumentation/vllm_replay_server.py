"""An HTTP server that answers ``/v1/chat/completions`` and ``/v1/completions`` with answers
recorded from a real vLLM (``recordings/*.json``, made by ``recordings/record_vllm.py``).

Loaded by conftest.py for the instrumentation tests. Real HTTP/1.1 on 127.0.0.1 (stdlib
``http.server``): a JSON answer is sent with its recorded status, content type and body text;
a stream as the recorded server-sent events, one HTTP chunk each. A request is matched by its
route and ``request_key`` (model, messages or prompt, stream, n, logprobs, whether it asks for
token ids); a request made several times gets the recorded answers in turn, so each call of a
test has its own completion id. A request nobody recorded gets a 501 naming the key.

What vLLM does not do, the server does on request, each said where the fixture asks for it:

- ``policy_version_header=V`` adds ``x-spanrl-policy-version: V`` to every answer, as spanrl's
  policy endpoint does (vLLM reports no policy version);
- ``ignores_token_ids=True`` answers as an endpoint that ignores ``return_token_ids`` (the
  answers recorded without it);
- ``malformed_token_ids=True`` breaks ``choices[0].token_ids`` (a string instead of a list) in
  the body, or in the second stream event that has it.

``sent[response_id]`` holds what each served answer carried (prompt ids, per choice its token
ids and logprobs), read from the recorded answer, so tests compare spans with vLLM's ids.
"""

from __future__ import annotations

import json
import sys
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

RECORDINGS = Path(__file__).resolve().parent / "recordings"
ROUTES = ("/chat/completions", "/completions")
POLICY_VERSION_HEADER = "x-spanrl-policy-version"


@dataclass(frozen=True)
class RecordedAnswer:
    status: int
    content_type: str
    body: str | None = None  # a JSON answer's exact text
    sse_events: tuple[str, ...] | None = None  # a stream's events, each ending in "\n\n"


def request_key(route: str, body: dict[str, Any], ignore_token_ids: bool = False) -> str:
    """What tells two recorded requests apart (extra fields such as stream_options do not)."""
    return json.dumps({
        "route": route,
        "model": body.get("model"),
        "input": body.get("messages", body.get("prompt")),
        "stream": bool(body.get("stream")),
        "n": body.get("n") or 1,
        "logprobs": body.get("logprobs") or None,
        "token_ids": body.get("return_token_ids") is True and not ignore_token_ids,
    }, sort_keys=True)


def load_recordings(folder: Path = RECORDINGS) -> dict[str, list[RecordedAnswer]]:
    """Every recorded exchange in ``folder``, by request key."""
    answers: dict[str, list[RecordedAnswer]] = {}
    for path in sorted(folder.glob("*.json")):
        document = json.loads(path.read_text())
        if "responses" not in document:
            continue  # vllm.json: what was recorded with
        key = request_key(document["route"], document["request"])
        for answer in document["responses"]:
            events = answer.get("sse_events")
            answers.setdefault(key, []).append(RecordedAnswer(
                answer["status"], answer["content_type"], answer.get("body"),
                tuple(events) if events is not None else None))
    return answers


def answer_objects(answer: RecordedAnswer) -> list[dict[str, Any]]:
    """The JSON objects of an answer: its body, or each ``data:`` event but ``[DONE]``."""
    if answer.sse_events is None:
        return [json.loads(answer.body or "{}")]
    payloads = [event.removeprefix("data: ").strip() for event in answer.sse_events]
    return [json.loads(payload) for payload in payloads if payload != "[DONE]"]


def what_was_sent(answer: RecordedAnswer) -> dict[str, Any]:
    """Prompt ids, and per choice index its token ids and logprobs, in vLLM's shapes (chat:
    top-level prompt ids, ``logprobs.content[j].logprob``; completions: prompt ids on the
    choice, ``logprobs.token_logprobs``); stream events concatenated per choice."""
    objects = answer_objects(answer)
    prompt_ids: list[int] | None = None
    choices: dict[int, dict[str, list]] = {}
    for obj in objects:
        if obj.get("prompt_token_ids") is not None:
            prompt_ids = obj["prompt_token_ids"]
        for choice in obj.get("choices", []):
            entry = choices.setdefault(choice["index"], {"token_ids": [], "logprobs": []})
            if choice.get("prompt_token_ids") is not None:
                prompt_ids = choice["prompt_token_ids"]
            entry["token_ids"] += choice.get("token_ids") or []
            logprobs = choice.get("logprobs") or {}
            if "content" in logprobs:
                entry["logprobs"] += [item["logprob"] for item in logprobs["content"] or []]
            entry["logprobs"] += logprobs.get("token_logprobs") or []
    ordered = [choices[i] for i in sorted(choices)]
    return {"id": objects[0].get("id"), "prompt_token_ids": prompt_ids,
            "choices": ordered, "with_ids": prompt_ids is not None,
            "with_logprobs": any(c["logprobs"] for c in ordered)}


def _compact(obj: dict[str, Any]) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def malformed(answer: RecordedAnswer) -> RecordedAnswer:
    """``answer`` with ``choices[0].token_ids`` broken: in the body, or in the second stream
    event carrying it."""
    if answer.sse_events is None:
        obj = json.loads(answer.body or "{}")
        obj["choices"][0]["token_ids"] = "not-a-list"
        return RecordedAnswer(answer.status, answer.content_type, body=_compact(obj))
    events, seen = list(answer.sse_events), 0
    for i, event in enumerate(events):
        payload = event.removeprefix("data: ").strip()
        if payload == "[DONE]":
            continue
        obj = json.loads(payload)
        first = next((c for c in obj.get("choices", []) if c.get("index") == 0 and c.get("token_ids")), None)
        if first is None:
            continue
        seen += 1
        if seen == 2:
            first["token_ids"] = "not-a-list"
            events[i] = f"data: {_compact(obj)}\n\n"
            break
    return RecordedAnswer(answer.status, answer.content_type, sse_events=tuple(events))


class VLLMReplayServer:
    def __init__(self, policy_version_header: int | None = None, ignores_token_ids: bool = False,
                 malformed_token_ids: bool = False, recordings: Path = RECORDINGS) -> None:
        self.policy_version_header = policy_version_header
        self.ignores_token_ids = ignores_token_ids
        self.malformed_token_ids = malformed_token_ids
        self.recorded = load_recordings(recordings)
        self.requests: list[dict[str, Any]] = []
        self.request_headers: list[dict[str, str]] = []  # each request's, lower-case names
        self.unavailable_next = 0  # answer this many requests 503 (retry after 10 ms) first
        self.sent: dict[str, dict[str, Any]] = {}
        self._served: dict[str, int] = {}
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None

    def start(self) -> str:
        server = self

        class Handler(_Handler):
            owner = server

        self._httpd = _QuietHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        return self.base_url

    @property
    def base_url(self) -> str:
        assert self._httpd is not None
        return f"http://127.0.0.1:{self._httpd.server_address[1]}/v1"

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def take_unavailable(self) -> bool:
        """True when this request is to be answered 503 (``unavailable_next`` counts down)."""
        with self._lock:
            if self.unavailable_next <= 0:
                return False
            self.unavailable_next -= 1
            return True

    def answer_for(self, route: str, body: dict[str, Any]) -> RecordedAnswer | None:
        """The next recorded answer to this request (in turn), noted in ``requests``/``sent``."""
        key = request_key(route, body, ignore_token_ids=self.ignores_token_ids)
        with self._lock:
            self.requests.append(body)
            recorded = self.recorded.get(key)
            if not recorded:
                return None
            turn = self._served.get(key, 0)
            self._served[key] = turn + 1
            answer = recorded[turn % len(recorded)]
            if answer.status == 200:
                sent = what_was_sent(answer)
                self.sent[sent["id"]] = sent
        return malformed(answer) if self.malformed_token_ids and answer.status == 200 else answer


class _QuietHTTPServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # clients hanging up are fine
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    owner: VLLMReplayServer
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go in separate writes

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        return

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        length = int(self.headers.get("Content-Length") or 0)
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except json.JSONDecodeError:
            return self._send(400, "application/json", '{"error":{"message":"body is not JSON"}}')
        route = self.path.removeprefix("/v1").rstrip("/")
        if route not in ROUTES:
            return self._send(404, "application/json", _compact({"error": {"message": f"no route {self.path}"}}))
        self.owner.request_headers.append({k.lower(): v for k, v in self.headers.items()})
        if self.owner.take_unavailable():
            self.owner.requests.append(body)
            return self._send(503, "application/json", '{"error":{"message":"busy"}}', {"retry-after-ms": "10"})
        answer = self.owner.answer_for(route, body)
        if answer is None:
            message = (f"no recorded vLLM answer for {request_key(route, body)}: add the request to "
                       "recordings/record_vllm.py and run it")
            return self._send(501, "application/json", _compact({"error": {"message": message}}))
        if answer.sse_events is None:
            return self._send(answer.status, answer.content_type, answer.body or "")
        self.send_response(answer.status)
        self.send_header("Content-Type", answer.content_type)
        self.send_header("Transfer-Encoding", "chunked")
        self._send_policy_version()
        self.end_headers()
        for event in answer.sse_events:
            data = event.encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _send(self, status: int, content_type: str, text: str, headers: dict[str, str] | None = None) -> None:
        data = text.encode()
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self._send_policy_version()
        self.end_headers()
        self.wfile.write(data)

    def _send_policy_version(self) -> None:
        if self.owner.policy_version_header is not None:
            self.send_header(POLICY_VERSION_HEADER, str(self.owner.policy_version_header))
