"""Policy server throughput: 16 concurrent clients versus one client at a time, same run.

Starts ``spanrl serve`` on a locally created model in a subprocess (the real HTTP server,
batching concurrent requests into shared forward passes), then sends the same number of
chat requests with the real ``openai`` client: first one at a time, then from 16 concurrent
async clients. Prints requests/s and generated tokens/s for both and the ratio (goal >= 6x).

    python bench/bench_policy_batching.py [--requests 64 --concurrency 16 --max-tokens 24]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(url: str, process: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError("spanrl serve exited early")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("spanrl serve did not come up")


def messages(number: int) -> list[dict]:
    return [{"role": "user", "content": f"What is {number % 90 + 10} + {number % 7 + 2}?"}]


def sequential(base_url: str, model: str, count: int, max_tokens: int) -> tuple[float, int]:
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0)
    tokens = 0
    started = time.perf_counter()
    for number in range(count):
        reply = client.chat.completions.create(model=model, messages=messages(number), max_tokens=max_tokens)
        tokens += reply.usage.completion_tokens
    return time.perf_counter() - started, tokens


async def concurrent(base_url: str, model: str, count: int, max_tokens: int, clients: int) -> tuple[float, int]:
    tokens = 0
    queue: asyncio.Queue = asyncio.Queue()
    for number in range(count):
        queue.put_nowait(number)

    async def worker():
        nonlocal tokens
        async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
            while not queue.empty():
                number = queue.get_nowait()
                reply = await client.chat.completions.create(model=model, messages=messages(number),
                                                             max_tokens=max_tokens)
                tokens += reply.usage.completion_tokens

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    return time.perf_counter() - started, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=None, help="serve this model (default: a fresh tiny one)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=0,
                        help="the server's torch threads (0: default; 1 is steadier on a busy machine)")
    parser.add_argument("--batch-wait-ms", type=float, default=20.0)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        model_dir = args.model_dir
        if model_dir is None:
            model_dir = str(Path(scratch) / "tiny")
            subprocess.run([sys.executable, "-m", "spanrl", "--log-level", "WARNING", "model", "init", model_dir,
                            "--preset", "tiny"], check=True, stdout=subprocess.DEVNULL)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = subprocess.Popen([sys.executable, "-m", "spanrl", "--log-level", "WARNING", "serve", model_dir,
                                   "--port", str(port), "--served-model-name", "bench",
                                   "--threads", str(args.threads), "--batch-wait-ms", str(args.batch_wait_ms)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ))
        try:
            wait_ready(url, server)
            base_url = f"{url}/v1"
            sequential(base_url, "bench", 4, args.max_tokens)  # warm-up
            one_time, one_tokens = sequential(base_url, "bench", args.requests, args.max_tokens)
            many_time, many_tokens = asyncio.run(
                concurrent(base_url, "bench", args.requests, args.max_tokens, args.concurrency))
        finally:
            server.terminate()
            try:
                server.wait(15)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    print(f"{args.requests} chat requests, max_tokens {args.max_tokens}, tiny model on CPU")
    print(f"one at a time      : {args.requests / one_time:7.1f} req/s {one_tokens / one_time:8.0f} tokens/s")
    print(f"{args.concurrency:2d} concurrent clients: {args.requests / many_time:7.1f} req/s "
          f"{many_tokens / many_time:8.0f} tokens/s")
    print(f"ratio: {one_time / many_time:.2f}x requests/s, "
          f"{(many_tokens / many_time) / (one_tokens / one_time):.2f}x tokens/s (goal >= 6x)")


if __name__ == "__main__":
    main()
