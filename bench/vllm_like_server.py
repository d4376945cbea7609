"""An HTTP server that answers ``/v1/chat/completions`` and ``/v1/completions`` like vLLM.

Used by ``bench/bench_instrumentation_overhead.py``, which needs answers of any length (the
tests replay answers recorded from a real vLLM instead: tests/instrumentation/vllm_replay_server.py).
Real HTTP/1.1 on 127.0.0.1 (stdlib ``http.server``), JSON bodies and server-sent-event streams
in vLLM's shapes (docs/interfaces.md §1): token ids only when the request asks with
``return_token_ids: true`` (or never, with ``token_ids=False``; or broken, with
``malformed_choice_ids=True``), logprobs when asked, ``policy_version`` in every body/chunk and
the ``x-spanrl-policy-version`` header. With ``packs_ids=True`` it answers a request that asks with
``"spanrl_token_ids": "packed"`` (or the header ``x-spanrl-token-ids: packed``) with each id list
as one packed string, as spanrl's server does.

Every id it sends is kept in ``sent[response_id]``.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from spanrl.instrumentation.packed_values import asks_packed_ids, pack_token_ids

TOKENS_PER_CHUNK = 2


class VLLMLikeServer:
    def __init__(self, token_ids: bool = True, policy_version: int = 7, tokens: int = 5,
                 delay_s: float = 0.0, malformed_choice_ids: bool = False, packs_ids: bool = False) -> None:
        self.token_ids = token_ids
        self.packs_ids = packs_ids
        self.malformed_choice_ids = malformed_choice_ids
        self.policy_version = policy_version
        self.tokens = tokens
        self.delay_s = delay_s
        self.requests: list[dict[str, Any]] = []
        self.sent: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._counter = 0
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # --- lifecycle --------------------------------------------------------------------------
    def start(self) -> str:
        server = self

        class Handler(_Handler):
            owner = server

        self._httpd = _QuietHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()
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

    # --- answers ----------------------------------------------------------------------------
    def plan(self, kind: str, body: dict[str, Any], packed: bool = False) -> dict[str, Any]:
        """Decide the ids of one answer and remember them under its response id."""
        with self._lock:
            self._counter += 1
            number = self._counter
            self.requests.append(body)
        text = _prompt_text(kind, body)
        n = int(body.get("n") or 1)
        want_ids = self.token_ids and body.get("return_token_ids") is True
        want_logprobs = bool(body.get("logprobs")) if kind == "chat" else body.get("logprobs") is not None
        prompt_ids = [(ord(c) * 31 + number) % 30000 for c in text] or [number]
        choices = []
        for i in range(n):
            ids = [100000 * (i + 1) + number * 100 + k for k in range(self.tokens)]
            choices.append({
                "token_ids": ids,
                "logprobs": [-0.125 * (k + 1) - i for k in range(self.tokens)],
                "text": "".join(f" t{t}" for t in ids),
            })
        response_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{number}"
        plan = {"id": response_id, "kind": kind, "prompt_token_ids": prompt_ids, "choices": choices,
                "with_ids": want_ids, "with_logprobs": want_logprobs, "packed": self.packs_ids and packed,
                "policy_version": self.policy_version, "malformed": self.malformed_choice_ids}
        with self._lock:
            self.sent[response_id] = plan
        return plan


def _prompt_text(kind: str, body: dict[str, Any]) -> str:
    if kind == "chat":
        return " ".join(str(m.get("content", "")) for m in body.get("messages", []))
    prompt = body.get("prompt", "")
    return prompt if isinstance(prompt, str) else json.dumps(prompt)


def _logprobs_obj(kind: str, values: list[float], texts: list[str]) -> dict[str, Any]:
    if kind == "chat":
        return {"content": [{"token": t, "logprob": v, "bytes": None, "top_logprobs": []}
                            for t, v in zip(texts, values, strict=True)]}
    return {"tokens": texts, "token_logprobs": values, "top_logprobs": None, "text_offset": []}


def _wire(plan: dict[str, Any], ids: list[int]) -> list[int] | str:
    return pack_token_ids(ids) if plan["packed"] else ids


def full_body(plan: dict[str, Any], model: str) -> dict[str, Any]:
    kind = plan["kind"]
    choices = []
    for i, choice in enumerate(plan["choices"]):
        texts = [f" t{t}" for t in choice["token_ids"]]
        entry: dict[str, Any] = {"index": i, "finish_reason": "stop", "logprobs": None}
        if kind == "chat":
            entry["message"] = {"role": "assistant", "content": choice["text"]}
        else:
            entry["text"] = choice["text"]
        if plan["with_logprobs"]:
            entry["logprobs"] = _logprobs_obj(kind, choice["logprobs"], texts)
        if plan["with_ids"]:
            entry["token_ids"] = "not-a-list" if plan["malformed"] else _wire(plan, choice["token_ids"])
            if kind == "completions":
                entry["prompt_token_ids"] = _wire(plan, plan["prompt_token_ids"])
        choices.append(entry)
    body: dict[str, Any] = {
        "id": plan["id"],
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": int(time.time()), "model": model, "choices": choices,
        "usage": {"prompt_tokens": len(plan["prompt_token_ids"]),
                  "completion_tokens": sum(len(c["token_ids"]) for c in plan["choices"]),
                  "total_tokens": 0},
        "policy_version": plan["policy_version"],
    }
    if plan["with_ids"] and kind == "chat":
        body["prompt_token_ids"] = _wire(plan, plan["prompt_token_ids"])
    return body


def stream_chunks(plan: dict[str, Any], model: str) -> list[dict[str, Any]]:
    """The chunks of a streamed answer: choices interleaved, ``TOKENS_PER_CHUNK`` tokens each,
    the last chunk of each choice with its finish_reason, then a usage chunk."""
    kind = plan["kind"]
    common = {"id": plan["id"], "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
              "created": int(time.time()), "model": model, "policy_version": plan["policy_version"]}
    chunks: list[dict[str, Any]] = []
    if kind == "chat":
        first = dict(common, choices=[{"index": i, "delta": {"role": "assistant", "content": ""},
                                       "finish_reason": None, "logprobs": None,
                                       **({"token_ids": []} if plan["with_ids"] else {})}
                                      for i in range(len(plan["choices"]))])
        if plan["with_ids"]:
            first["prompt_token_ids"] = _wire(plan, plan["prompt_token_ids"])
        chunks.append(first)
    longest = max(len(c["token_ids"]) for c in plan["choices"])
    for start in range(0, longest, TOKENS_PER_CHUNK):
        for i, choice in enumerate(plan["choices"]):
            ids = choice["token_ids"][start:start + TOKENS_PER_CHUNK]
            if not ids:
                continue
            texts = [f" t{t}" for t in ids]
            last = start + TOKENS_PER_CHUNK >= len(choice["token_ids"])
            entry: dict[str, Any] = {"index": i, "finish_reason": "stop" if last else None,
                                     "logprobs": None}
            if kind == "chat":
                entry["delta"] = {"content": "".join(texts)}
            else:
                entry["text"] = "".join(texts)
            if plan["with_logprobs"]:
                entry["logprobs"] = _logprobs_obj(kind, choice["logprobs"][start:start + len(ids)], texts)
            if plan["with_ids"]:
                # malformed: one chunk in the middle of the stream is broken
                malformed = plan["malformed"] and start == TOKENS_PER_CHUNK
                entry["token_ids"] = "not-a-list" if malformed else ids  # per-token chunks: lists, as spanrl's server
                if kind == "completions" and start == 0:
                    entry["prompt_token_ids"] = _wire(plan, plan["prompt_token_ids"])
            chunks.append(dict(common, choices=[entry]))
    chunks.append(dict(common, choices=[], usage={"prompt_tokens": len(plan["prompt_token_ids"]),
                                                  "completion_tokens": 0, "total_tokens": 0}))
    return chunks


class _QuietHTTPServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        import sys  # noqa: PLC0415

        if not isinstance(sys.exc_info()[1], ConnectionError):  # clients hanging up are fine
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    owner: VLLMLikeServer
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go in separate writes

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        return

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        length = int(self.headers.get("Content-Length") or 0)
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except json.JSONDecodeError:
            return self._send_json(400, {"error": {"message": "body is not JSON"}})
        if self.path.rstrip("/").endswith("/chat/completions"):
            kind = "chat"
        elif self.path.rstrip("/").endswith("/completions"):
            kind = "completions"
        else:
            return self._send_json(404, {"error": {"message": f"no route {self.path}"}})
        if self.owner.delay_s:
            time.sleep(self.owner.delay_s)
        plan = self.owner.plan(kind, body, isinstance(body, dict) and asks_packed_ids(self.headers, body))
        model = str(body.get("model", "policy"))
        if body.get("stream"):
            return self._send_stream(plan, model)
        return self._send_json(200, full_body(plan, model))

    def _send_json(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("x-spanrl-policy-version", str(self.owner.policy_version))
        self.end_headers()
        self.wfile.write(data)

    def _send_stream(self, plan: dict[str, Any], model: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("x-spanrl-policy-version", str(self.owner.policy_version))
        self.end_headers()
        events = [f"data: {json.dumps(c)}\n\n" for c in stream_chunks(plan, model)]
        events.append("data: [DONE]\n\n")
        for event in events:
            data = event.encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()
