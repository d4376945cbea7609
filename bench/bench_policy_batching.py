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


def sequential(base_url: str, model: str, count: int, max_tokens: int, kind: str) -> tuple[float, int]:
    return asyncio.run(concurrent(base_url, model, count, max_tokens, 1, kind))


async def _ask(client, kind: str, model: str, number: int, max_tokens: int) -> int:
    """One chat request; returns its completion tokens."""
    if kind == "openai":
        reply = await client.chat.completions.create(model=model, messages=messages(number), max_tokens=max_tokens)
        return reply.usage.completion_tokens
    response = await client.post("/chat/completions", json={"model": model, "messages": messages(number),
                                                            "max_tokens": max_tokens})
    response.raise_for_status()
    return response.json()["usage"]["completion_tokens"]


def _client(base_url: str, kind: str):
    if kind == "openai":
        return openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)
    return httpx.AsyncClient(base_url=base_url, timeout=120)


async def concurrent(base_url: str, model: str, count: int, max_tokens: int, clients: int,
                     kind: str) -> tuple[float, int]:
    tokens = 0
    queue: asyncio.Queue = asyncio.Queue()
    for number in range(count):
        queue.put_nowait(number)

    async def worker():
        nonlocal tokens
        async with _client(base_url, kind) as client:
            while not queue.empty():
                number = queue.get_nowait()
                got = await _ask(client, kind, model, number, max_tokens)
                tokens += got  # not `tokens += await ...`: that reads tokens before awaiting

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    return time.perf_counter() - started, tokens


def engine_only(model_dir: str, count: int, clients: int, max_tokens: int, threads: int) -> tuple[float, float]:
    """The same comparison inside one process, without HTTP: seconds one at a time, then in
    waves of ``clients`` concurrent requests (shows what the engine's batching itself buys)."""
    import torch

    from spanrl.trainer_bridge.policy_engine import PolicyEngine, SamplingParams

    if threads:
        torch.set_num_threads(threads)
    engine = PolicyEngine.from_pretrained(model_dir, device="cpu").start()
    try:
        prompts = [engine.encode_chat(messages(n)) for n in range(count)]
        params = SamplingParams(max_tokens=max_tokens)
        engine.generate(prompts[0], params)  # warm-up
        started = time.perf_counter()
        for prompt in prompts:
            engine.generate(prompt, params)
        one = time.perf_counter() - started
        started = time.perf_counter()
        for first in range(0, count, clients):
            jobs = [engine.submit(p, params) for p in prompts[first:first + clients]]
            for job in jobs:
                job.wait()
        many = time.perf_counter() - started
    finally:
        engine.stop()
    return one, many


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=None, help="serve this model (default: a fresh tiny one)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=0,
                        help="the server's torch threads (0: default; 1 is steadier on a busy machine)")
    parser.add_argument("--batch-wait-ms", type=float, default=20.0)
    parser.add_argument("--client", choices=["openai", "httpx"], default="openai",
                        help="the real openai client, or bare httpx (less client CPU on a small machine)")
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
            sequential(base_url, "bench", 4, args.max_tokens, args.client)  # warm-up
            one_time, one_tokens = sequential(base_url, "bench", args.requests, args.max_tokens, args.client)
            before = httpx.get(f"{url}/spanrl/v1/policy").json()["stats"]
            many_time, many_tokens = asyncio.run(
                concurrent(base_url, "bench", args.requests, args.max_tokens, args.concurrency, args.client))
            after = httpx.get(f"{url}/spanrl/v1/policy").json()["stats"]
            batches = after["batches"] - before["batches"]
            engine_one, engine_many = engine_only(model_dir, args.requests, args.concurrency, args.max_tokens,
                                                  args.threads)
        finally:
            server.terminate()
            try:
                server.wait(15)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    print(f"{args.requests} chat requests, max_tokens {args.max_tokens}, {args.client} client, "
          f"server threads {args.threads or 'default'}")
    print(f"one at a time      : {args.requests / one_time:7.1f} req/s {one_tokens / one_time:8.0f} tokens/s")
    print(f"{args.concurrency:2d} concurrent clients: {args.requests / many_time:7.1f} req/s "
          f"{many_tokens / many_time:8.0f} tokens/s ({batches} batches, "
          f"{args.requests / max(batches, 1):.1f} requests each)")
    print(f"ratio: {one_time / many_time:.2f}x requests/s, "
          f"{(many_tokens / many_time) / (one_tokens / one_time):.2f}x tokens/s (goal >= 6x)")
    print(f"engine alone, no HTTP (same requests, waves of {args.concurrency}): one at a time "
          f"{args.requests / engine_one:.1f} req/s, batched {args.requests / engine_many:.1f} req/s, "
          f"ratio {engine_one / engine_many:.2f}x")


if __name__ == "__main__":
    main()
