"""Serving throughput: spanrl's policy server vs vLLM's CPU build, same model, same clients, same run.

Run in the verl environment (``.ci/verl_env.sh``: it has vLLM's CPU build) on a quiet machine:

    .venv-verl/bin/python bench/bench_serving_vs_vllm.py [--preset small --requests 64 --max-tokens 32 --repeat 3]

Creates one model (``spanrl model init --preset``), then serves it twice, one server at a time:
``spanrl serve`` (its HTTP front end in its own process, ``--threads`` torch threads) and vLLM's
OpenAI server (float32, eager, the CPU settings ``tests/verl_backend/vllm_server.py`` uses). Each
gets the same chat requests from real ``openai`` clients (``bench_policy_batching.run_clients``):
one at a time, then ``--concurrency`` concurrent clients; generated tokens/s counted from each
reply's ``usage``; ``--filler-words N`` puts N words of earlier context before each question,
as an agent's prompt carries its history. ``--isa avx2`` runs both servers as on an AVX2-only
machine (torch's, oneDNN's and MKL's kernels limited to AVX2, vLLM's AVX2 build of its kernels:
``bench/avx2_only/sitecustomize.py``), for the issue's AVX2 figure on an AVX-512 machine.
Rounds alternate the two modes ``--repeat`` times after a warm-up; prints min/median/max
tokens/s of each server and mode, and spanrl / vLLM of the medians (goal: >= 1.2x at 16 clients,
no worse at 1; issue 25).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from bench_policy_batching import run_clients, wait_ready  # noqa: E402

from spanrl.child_processes import free_port  # noqa: E402

VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
AVX2_ONLY_DIR = Path(__file__).resolve().parent / "avx2_only"


def isa_env(isa: str) -> dict[str, str]:
    """Environment of both servers: nothing for the machine's own ISA, AVX2 limits for ``avx2``."""
    if isa == "native":
        return {}
    path = os.pathsep.join(p for p in (str(AVX2_ONLY_DIR), os.environ.get("PYTHONPATH", "")) if p)
    return {"SPANRL_BENCH_CPU_ISA": "avx2", "PYTHONPATH": path, "ATEN_CPU_CAPABILITY": "avx2",
            "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def check_isa(env: dict[str, str]) -> str:
    """What a server process under ``env`` sees: torch's kernel ISA and its AVX-512 check."""
    probe = "import torch; print(torch.backends.cpu.get_cpu_capability(), torch.cpu._is_avx512_supported())"
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, **env}, check=True,
                         capture_output=True, text=True).stdout.split()
    return f"torch kernels {out[0]}, AVX-512 reported {out[1]}"


def spanrl_command(model_dir: str, port: int, threads: int) -> list[str]:
    return [sys.executable, "-m", "spanrl", "--log-level", "WARNING", "serve", model_dir, "--port", str(port),
            "--served-model-name", "bench", "--threads", str(threads)]


def vllm_command(model_dir: str, port: int, concurrency: int) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
            "--served-model-name", "bench", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--enforce-eager", "--max-model-len", "2048", "--max-num-seqs", str(max(concurrency, 16)),
            "--generation-config", "vllm", "--override-generation-config", json.dumps({"temperature": 1.0})]


def measure_server(command: list[str], port: int, env: dict[str, str], args: argparse.Namespace,
                   log: Path) -> dict[str, list[float]]:
    """Tokens/s of each mode, one value per round, against the server ``command`` starts."""
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env})
    try:
        wait_ready(url, server, timeout=600.0)
        run_clients(f"{url}/v1", "bench", 8, args.max_tokens, 4, "openai")  # warm-up
        rounds: dict[str, list[float]] = {"1 client": [], f"{args.concurrency} clients": []}
        for _ in range(args.repeat):
            for label, clients in ((f"{args.concurrency} clients", args.concurrency), ("1 client", 1)):
                count = args.requests if clients > 1 else max(args.requests // 4, 8)
                seconds, tokens, _ = run_clients(f"{url}/v1", "bench", count, args.max_tokens, clients, "openai",
                                                 args.filler_words)
                rounds[label].append(tokens / seconds)
        return rounds
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=["tiny", "small"])
    parser.add_argument("--requests", type=int, default=64, help="requests a round at full concurrency")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="spanrl serve's torch threads (0: one per core)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--filler-words", type=int, default=0,
                        help="words of earlier context before each question (an agent's long prompt)")
    parser.add_argument("--isa", default="native", choices=["native", "avx2"],
                        help="avx2: both servers run as on an AVX2-only machine (see the module's help)")
    args = parser.parse_args()
    machine_env = isa_env(args.isa)
    print(f"instruction set: {args.isa} ({check_isa(machine_env)})", flush=True)

    with tempfile.TemporaryDirectory() as scratch:
        model_dir = str(Path(scratch) / args.preset)
        subprocess.run([sys.executable, "-m", "spanrl", "--log-level", "WARNING", "model", "init", model_dir,
                        "--preset", args.preset], check=True, stdout=subprocess.DEVNULL)
        results = {}
        for name, command, env in (("spanrl", spanrl_command, {}), ("vLLM", vllm_command, VLLM_ENV)):
            port = free_port()
            argument = args.threads if name == "spanrl" else args.concurrency
            results[name] = measure_server(command(model_dir, port, argument), port, {**env, **machine_env}, args,
                                           Path(scratch) / f"{name}.log")
    print(f"preset {args.preset}, {args.requests} chat requests a round at {args.concurrency} clients, "
          f"max_tokens {args.max_tokens}, spanrl threads {args.threads or 'default'}, {args.repeat} rounds, "
          f"{args.filler_words} filler words before each question")
    for label in results["spanrl"]:
        medians = {}
        for name, rounds in results.items():
            values = rounds[label]
            medians[name] = statistics.median(values)
            print(f"  {name:6s} {label:10s}: {medians[name]:7.0f} tokens/s (min {min(values):.0f}, "
                  f"max {max(values):.0f})")
        print(f"  spanrl / vLLM at {label}: {medians['spanrl'] / medians['vLLM']:.2f}x")


if __name__ == "__main__":
    main()
