"""Instructions added per LLM call: spanrl's instrumentation vs openinference's alone vs none,
counted by Valgrind's cachegrind, so the figure does not move with the machine's load or hour.

``bench_instrumentation_overhead.py`` times the same calls in CPU time; on a shared 2-core machine
a block of calls there varies by more than spanrl's whole part (docs/performance.md). Here every
set-up runs in its own process under ``valgrind --tool=cachegrind --cache-sim=no`` (the
vLLM-like server, a child process, runs natively), once with ``--calls-small`` and once with
``--calls-large`` calls after 5 warm ones; the difference divided by the difference in calls is
the instructions per call, start-up and imports cancelled. ``PYTHONHASHSEED=0`` makes a run repeat
to within ~0.1 % of spanrl's part on chat (streams: ~10 %, their span export runs in a thread).

Instructions are not time: a cache miss costs more than an add. The ratio (spanrl's addition /
openinference's, goal <= 1.1, issue 25) is a count of work done, the same on every machine.

Run: python bench/bench_instrumentation_instructions.py [--kinds chat stream completion] [--tokens 64]
(needs valgrind: ``apt-get install valgrind``; ~6 minutes for the three kinds)
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
MODES = ("none", "openinference", "spanrl")
KINDS = ("chat", "stream", "completion")
WARM_CALLS = 5
_INSTRUCTIONS = re.compile(r"I\s+refs:\s+([\d,]+)")


def run_calls(mode: str, kind: str, calls: int, tokens: int, server_kind: str) -> None:
    """Child process: ``calls`` calls of ``kind`` under set-up ``mode`` against the vLLM-like server
    (answering as ``server_kind``: ``bench_instrumentation_overhead.SERVERS``)."""
    sys.path.insert(0, str(BENCH_DIR))
    import openai
    from bench_instrumentation_overhead import _Modes

    server = subprocess.Popen([sys.executable, str(BENCH_DIR / "bench_instrumentation_overhead.py"), "--serve",
                               "--tokens", str(tokens), "--server", server_kind],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        url = server.stdout.readline().strip()
        modes = _Modes()
        modes.set(mode)
        client = openai.OpenAI(base_url=url, api_key="k")
        messages = [{"role": "user", "content": "hi"}]
        for _ in range(WARM_CALLS + calls):
            if kind == "chat":
                client.chat.completions.create(model="m", messages=messages)
            elif kind == "stream":
                for _chunk in client.chat.completions.create(model="m", messages=messages, stream=True):
                    pass
            else:
                client.completions.create(model="m", prompt="hi")
        modes.provider.shutdown()
    finally:
        server.stdin.close()
        server.wait()


def count_instructions(mode: str, kind: str, calls: int, tokens: int, server_kind: str) -> int:
    """Instructions of one whole child process (cachegrind's ``I refs``)."""
    command = ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
               sys.executable, __file__, "--child", mode, kind, str(calls), "--tokens", str(tokens),
               "--server", server_kind]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "0"})
    found = _INSTRUCTIONS.search(result.stderr)
    if result.returncode != 0 or found is None:
        raise SystemExit(f"{mode} {kind} {calls} calls failed (exit {result.returncode}):\n{result.stderr[-2000:]}")
    return int(found.group(1).replace(",", ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--tokens", type=int, default=64, help="response tokens per call")
    parser.add_argument("--server", choices=("spanrl", "vllm"), default="spanrl",
                        help="the endpoint's answer to spanrl's request for ids: packed (spanrl's server) or lists")
    parser.add_argument("--calls-small", type=int, default=10)
    parser.add_argument("--calls-large", type=int, default=60)
    parser.add_argument("--child", nargs=3, metavar=("MODE", "KIND", "CALLS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_calls(args.child[0], args.child[1], int(args.child[2]), args.tokens, args.server)
        return 0
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (Debian: apt-get install valgrind)")
    if args.calls_large <= args.calls_small:
        raise SystemExit("--calls-large must be more than --calls-small")
    print(f"instructions per call (cachegrind), {args.tokens} response tokens, {args.server}'s answers "
          f"({args.calls_large} - {args.calls_small} calls)")
    print("| kind | none | openinference adds | spanrl adds | spanrl's own | ratio (goal <= 1.1) |")
    print("|---|---|---|---|---|---|")
    for kind in args.kinds:
        per_call = {}
        for mode in MODES:
            small = count_instructions(mode, kind, args.calls_small, args.tokens, args.server)
            large = count_instructions(mode, kind, args.calls_large, args.tokens, args.server)
            per_call[mode] = (large - small) / (args.calls_large - args.calls_small)
        theirs = per_call["openinference"] - per_call["none"]
        ours = per_call["spanrl"] - per_call["none"]
        print(f"| {kind} | {per_call['none']:,.0f} | {theirs:,.0f} | {ours:,.0f} | {ours - theirs:,.0f} "
              f"| **{ours / theirs:.3f}** |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
