"""Policy server throughput: 16 concurrent clients versus one client at a time, same run.

Starts ``spanrl serve`` on a locally created model in a subprocess (the real HTTP server,
batching concurrent requests into shared forward passes; its HTTP front end in a child process
unless ``--single-process``), then sends the same number of
chat requests with the real ``openai`` client: first one at a time, then from 16 concurrent
async clients. Prints requests/s and generated tokens/s for both and the ratio (goal >= 6x),
plus the CPU each request cost the client process and the server (engine and HTTP front-end
processes), and the load average
(other processes on a small machine change the numbers; ``--repeat`` measures the ratio again).

Both modes use the same server, model, requests and max_tokens; their clients are created
before the clock starts (an ``AsyncOpenAI`` builds an SSL context, ~20 ms, which is not
request throughput), one per concurrent caller as 16 separate agents would have.

Structured outputs (same run): the 16 concurrent clients' free requests are timed again while
8 more clients keep the batch busy, first with free requests, then with strict ``json_schema``
requests (grammar-constrained rows in the same batches). Free requests should not be slower
with constrained ones beside them than with as many free ones (the ratio printed, goal >= 0.95).

    python bench/bench_policy_batching.py [--requests 128 --concurrency 16 --max-tokens 24 --repeat 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

from spanrl.child_processes import free_port


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


# what a long agent prompt adds before the question (history, tool results), repeated as needed
FILLER = "the tool said the total was 42 and the next step is to check it again ".split()


def messages(number: int, filler_words: int = 0) -> list[dict]:
    """A short question; ``filler_words`` words of earlier context before it make the prompt long."""
    history = " ".join(FILLER[i % len(FILLER)] for i in range(filler_words))
    question = f"What is {number % 90 + 10} + {number % 7 + 2}?"
    return [{"role": "user", "content": f"{history}\n{question}" if history else question}]


async def _ask(client, kind: str, model: str, number: int, max_tokens: int, filler_words: int = 0) -> int:
    """One chat request; returns its completion tokens."""
    asked = messages(number, filler_words)
    if kind == "openai":
        reply = await client.chat.completions.create(model=model, messages=asked, max_tokens=max_tokens)
        return reply.usage.completion_tokens
    response = await client.post("/chat/completions", json={"model": model, "messages": asked,
                                                            "max_tokens": max_tokens})
    response.raise_for_status()
    return response.json()["usage"]["completion_tokens"]


def _client(base_url: str, kind: str):
    if kind == "openai":
        return openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)
    return httpx.AsyncClient(base_url=base_url, timeout=120)


# what the constrained companions ask for: a typed answer, as an agent's output_type sends it
ANSWER_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": {
    "type": "object", "additionalProperties": False, "required": ["answer", "steps"],
    "properties": {"answer": {"type": "integer"}, "steps": {"type": "array", "items": {"type": "string"}}}}}}


def run_beside(base_url: str, model: str, count: int, max_tokens: int, clients: int, companions: int,
               constrained: bool) -> float:
    """Seconds for ``count`` free requests from ``clients`` callers while ``companions`` more
    callers keep sending requests (strict json_schema ones when ``constrained``) until they finish."""

    async def main() -> float:
        queue: asyncio.Queue = asyncio.Queue()
        for number in range(count):
            queue.put_nowait(number)
        made = [_client(base_url, "openai") for _ in range(clients + companions)]
        done = asyncio.Event()
        extra = {"response_format": ANSWER_FORMAT} if constrained else {}

        async def timed(client):
            while not queue.empty():
                number = queue.get_nowait()
                await client.chat.completions.create(model=model, messages=messages(number), max_tokens=max_tokens)

        async def companion(client, number):
            while not done.is_set():
                await client.chat.completions.create(model=model, messages=messages(number), max_tokens=max_tokens,
                                                     **extra)

        background = [asyncio.create_task(companion(c, n)) for n, c in enumerate(made[clients:])]
        try:
            await asyncio.sleep(0.5)  # the companions are in the batch before the clock starts
            started = time.perf_counter()
            await asyncio.gather(*(timed(client) for client in made[:clients]))
            return time.perf_counter() - started
        finally:
            done.set()
            await asyncio.gather(*background, return_exceptions=True)
            for client in made:
                await client.close()

    return asyncio.run(main())


def run_clients(base_url: str, model: str, count: int, max_tokens: int, clients: int,
                kind: str, filler_words: int = 0) -> tuple[float, int, float]:
    """``count`` requests from ``clients`` concurrent callers (1: one at a time), each prompt
    ``filler_words`` words longer than a bare question. Returns (seconds, completion tokens, this
    process's CPU seconds); clients are made before the clock starts."""

    async def main() -> tuple[float, int, float]:
        tokens = 0
        queue: asyncio.Queue = asyncio.Queue()
        for number in range(count):
            queue.put_nowait(number)
        made = [_client(base_url, kind) for _ in range(clients)]

        async def worker(client):
            nonlocal tokens
            while not queue.empty():
                number = queue.get_nowait()
                got = await _ask(client, kind, model, number, max_tokens, filler_words)
                tokens += got  # not `tokens += await ...`: that reads tokens before awaiting

        try:
            started, cpu_started = time.perf_counter(), time.process_time()
            await asyncio.gather(*(worker(client) for client in made))
            return time.perf_counter() - started, tokens, time.process_time() - cpu_started
        finally:
            for client in made:
                await (client.close() if kind == "openai" else client.aclose())

    return asyncio.run(main())


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process and its children (the HTTP front end runs in
    one), from Linux /proc; None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/task/{pid}/children") as children:
            child_pids = [int(child) for child in children.read().split()]
    except OSError:
        return None
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return own + sum(process_cpu_s(child) or 0.0 for child in child_pids)


@dataclass
class Measured:
    seconds: float
    tokens: int
    client_cpu_s: float
    server_cpu_s: float | None
    prefills: int  # prefill passes: groups of requests admitted together
    forward_passes: int  # prefill and decode passes


def engine_stats(url: str) -> dict:
    return httpx.get(f"{url}/spanrl/v1/policy").json()["stats"]


def measure(url: str, server_pid: int, count: int, max_tokens: int, clients: int, kind: str) -> Measured:
    before = engine_stats(url)
    server_before = process_cpu_s(server_pid)
    seconds, tokens, client_cpu = run_clients(f"{url}/v1", "bench", count, max_tokens, clients, kind)
    server_after = process_cpu_s(server_pid)
    after = engine_stats(url)
    server_cpu = None if server_before is None else server_after - server_before
    return Measured(seconds, tokens, client_cpu, server_cpu, after["batches"] - before["batches"],
                    after["forward_passes"] - before["forward_passes"])


def describe(label: str, run: Measured, count: int) -> str:
    server = "?" if run.server_cpu_s is None else f"{1000 * run.server_cpu_s / count:.1f}"
    return (f"{label:22s}: {count / run.seconds:7.1f} req/s {run.tokens / run.seconds:8.0f} tokens/s | "
            f"CPU per request: client {1000 * run.client_cpu_s / count:.1f} ms, server {server} ms | "
            f"{run.prefills} prefill passes, {run.tokens / max(run.forward_passes, 1):.1f} tokens per pass")


def engine_only(model_dir: str, count: int, clients: int, max_tokens: int, threads: int,
                device: str = "cpu") -> tuple[float, float]:
    """The same comparison inside one process, without HTTP: seconds one at a time, then in
    waves of ``clients`` concurrent requests (shows what the engine's batching itself buys)."""
    import torch

    from spanrl.trainer_bridge.torch_backend.engine.policy_engine import PolicyEngine, SamplingParams

    if threads:
        torch.set_num_threads(threads)
    engine = PolicyEngine.from_pretrained(model_dir, device=device).start()
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
    parser.add_argument("--requests", type=int, default=128,
                        help="requests per mode (16 clients take ~0.7 s for 128; with fewer, the start, when all "
                             "arrive at once, and the drain, when the last few decode alone, weigh more)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto: where the server and the engine run")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=1,
                        help="the server's torch threads, for both modes (0: torch's default, one per core). "
                             "1 by default: on a small machine the clients need a core, and a tiny model gains "
                             "nothing from a second thread; with 2 threads on 2 cores both modes are slower")
    parser.add_argument("--batch-wait-ms", type=float, default=20.0,
                        help="the server's --batch-wait-ms (the longest a newcomer waits to join a running batch)")
    parser.add_argument("--single-process", action="store_true",
                        help="serve HTTP from the engine's process (`spanrl serve --single-process`) instead of "
                             "the default HTTP front-end process")
    parser.add_argument("--repeat", type=int, default=1, help="measure both modes this many times")
    parser.add_argument("--companions", type=int, default=8,
                        help="clients that keep the batch busy while free requests are timed (structured outputs)")
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
                                   "--device", args.device, "--threads", str(args.threads),
                                   "--batch-wait-ms", str(args.batch_wait_ms),
                                   *(["--single-process"] if args.single_process else [])],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ))
        try:
            wait_ready(url, server)
            run_clients(f"{url}/v1", "bench", 4, args.max_tokens, 1, args.client)  # warm-up
            rounds = []
            for _ in range(args.repeat):
                one = measure(url, server.pid, args.requests, args.max_tokens, 1, args.client)
                many = measure(url, server.pid, args.requests, args.max_tokens, args.concurrency, args.client)
                rounds.append((one, many, os.getloadavg()[0]))
            beside = []
            for _ in range(args.repeat):  # alternated: a shared machine's drift hits both alike
                for constrained in (False, True):
                    beside.append((constrained, run_beside(f"{url}/v1", "bench", args.requests, args.max_tokens,
                                                           args.concurrency, args.companions, constrained)))
            engine_one, engine_many = engine_only(model_dir, args.requests, args.concurrency, args.max_tokens,
                                                  args.threads, args.device)
        finally:
            server.terminate()
            try:
                server.wait(15)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    print(f"{args.requests} chat requests, max_tokens {args.max_tokens}, {args.client} client, "
          f"server threads {args.threads or 'default'}, batch wait {args.batch_wait_ms} ms, "
          f"HTTP {'in the engine process' if args.single_process else 'in its own process'}")
    for number, (one, many, load) in enumerate(rounds, 1):
        print(f"run {number} (load average {load:.2f})")
        print("  " + describe("one at a time", one, args.requests))
        print("  " + describe(f"{args.concurrency} concurrent clients", many, args.requests))
        print(f"  ratio: {one.seconds / many.seconds:.2f}x requests/s, "
              f"{(many.tokens / many.seconds) / (one.tokens / one.seconds):.2f}x tokens/s (goal >= 6x)")
    if len(rounds) > 1:  # the runs together: drift of a shared machine hits both modes alike
        one_s, many_s = sum(one.seconds for one, _, _ in rounds), sum(many.seconds for _, many, _ in rounds)
        ratios = sorted(one.seconds / many.seconds for one, many, _ in rounds)
        print(f"all {len(rounds)} runs: one at a time {len(rounds) * args.requests / one_s:.1f} req/s, "
              f"{args.concurrency} concurrent {len(rounds) * args.requests / many_s:.1f} req/s, "
              f"ratio {one_s / many_s:.2f}x (median of runs {ratios[len(ratios) // 2]:.2f}x)")
    free_s = sum(seconds for constrained, seconds in beside if not constrained)
    constrained_s = sum(seconds for constrained, seconds in beside if constrained)
    runs = len(beside) // 2
    print(f"structured outputs: {args.concurrency} clients' free requests beside {args.companions} clients' free "
          f"requests {runs * args.requests / free_s:.1f} req/s, beside {args.companions} clients' strict json_schema "
          f"requests {runs * args.requests / constrained_s:.1f} req/s: ratio {free_s / constrained_s:.2f} "
          f"(goal >= 0.95; each: {', '.join(f'{s:.2f} s' for _, s in beside)})")
    print(f"engine alone, no HTTP (same requests, waves of {args.concurrency}): one at a time "
          f"{args.requests / engine_one:.1f} req/s, batched {args.requests / engine_many:.1f} req/s, "
          f"ratio {engine_one / engine_many:.2f}x")


if __name__ == "__main__":
    main()
