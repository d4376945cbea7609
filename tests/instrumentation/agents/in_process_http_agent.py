"""A callable agent traced with start_tracing over OTLP/HTTP (the runner's in-process path).

Usage: python in_process_http_agent.py ENDPOINT; prints the response id it received."""

import sys

from openai import OpenAI

from spanrl.exporter.in_process import start_tracing, stop_tracing
from spanrl.instrumentation import emit_reward, rollout

provider = start_tracing(sys.argv[1], protocol="http/protobuf", headers={"X-Team": "rl"})
assert start_tracing(sys.argv[1]) is provider  # a second call keeps the first set-up
with rollout("task-http", attempt=3, rollout_id="http-rollout"):
    response = OpenAI().chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}])
    emit_reward(0.25)
stop_tracing()
print(response.id)
