"""An agent with no OpenAI SDK and no spanrl code: plain ``httpx`` against an OpenAI-compatible URL.

Run by ``test_integration_endpoint_spans.py``. It sends what any HTTP client can: call 1 only the
``x-spanrl-rollout-id`` header; calls 2 (chat) and 3 (streamed completions) the W3C ``traceparent``
and ``baggage`` headers given in ``TRACE_HEADERS`` (JSON), as OTel's generic HTTP instrumentation
would. It never asks for token ids. Prints the replies' texts as one JSON list.
"""

import json
import os

import httpx

base_url = os.environ["OPENAI_BASE_URL"].rstrip("/")
model = os.environ["OPENAI_MODEL"]
trace_headers = json.loads(os.environ["TRACE_HEADERS"])
rollout_header = {"x-spanrl-rollout-id": os.environ["ROLLOUT_ID"]}
replies = []
with httpx.Client(timeout=60) as client:
    chat = {"model": model, "messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 8}
    reply = client.post(f"{base_url}/chat/completions", json=chat, headers=rollout_header)
    reply.raise_for_status()
    replies.append(reply.json()["choices"][0]["message"]["content"])

    chat["messages"][0]["content"] = "What is 7 + 1?"
    reply = client.post(f"{base_url}/chat/completions", json=chat, headers=trace_headers)
    reply.raise_for_status()
    replies.append(reply.json()["choices"][0]["message"]["content"])

    completion = {"model": model, "prompt": "CALC 4+4", "max_tokens": 6, "stream": True}
    text = []
    with client.stream("POST", f"{base_url}/completions", json=completion, headers=trace_headers) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text.append(json.loads(line[len("data: "):])["choices"][0]["text"])
    replies.append("".join(text))
print(json.dumps(replies))
