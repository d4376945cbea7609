"""Added latency per LLM call: spanrl's instrumentation vs openinference's alone vs none.

Starts the vLLM-like server (bench/vllm_like_server.py) in its own
process on 127.0.0.1, then runs the same OpenAI-SDK client loop in this process under three
set-ups, switched by instrument/uninstrument and interleaved in short blocks over many rounds
(so a busy machine slows all three alike):

- ``none``:         no instrumentation;
- ``openinference``: openinference's OpenAIInstrumentor (one LLM span per call);
- ``spanrl``:        SpanrlOpenAIInstrumentor (openinference + token ids, policy version).

Spans go through a real SDK TracerProvider and BatchSpanProcessor to an exporter that drops
them (export cost is the same for both instrumented set-ups and not what is measured).
Prints, for chat (non-streaming and streaming) and completions, the agent process's CPU time
per call (the calling thread's CPU time) and the median wall-clock latency per call, what each instrumentation adds over
``none``, and the ratio spanrl's addition / openinference's addition (goal <= 1.1, issue 25). CPU time
is the headline: on a shared machine wall-clock latency mostly measures the neighbours. The CPU
ratio is given twice: from each set-up's fastest block, and paired by round (each round's
additions over that round's own ``none`` block, the median over rounds), which drifts less.

Run: python bench/bench_instrumentation_overhead.py [--calls 20] [--rounds 30] [--tokens 64]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
SERVER_FILE = ROOT / "bench" / "vllm_like_server.py"
MODES = ("none", "openinference", "spanrl")
KINDS = ("chat", "chat_stream", "completion")
WARM_CALLS = 3  # untimed calls after each switch of set-up (the first calls after instrument() pay once)


SERVERS = ("spanrl", "vllm")  # how the endpoint answers spanrl's request for ids: packed strings, or lists


def serve(tokens: int, server_kind: str = "spanrl") -> None:
    """Child process: run the vLLM-like server, print its URL, serve until stdin closes; as
    ``spanrl`` it answers a request for packed ids (``spanrl_token_ids``) as spanrl's server does."""
    spec = importlib.util.spec_from_file_location("vllm_like_server", SERVER_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    server = module.VLLMLikeServer(tokens=tokens, packs_ids=server_kind == "spanrl")
    print(server.start(), flush=True)
    sys.stdin.read()
    server.stop()


class _Modes:
    """Switches this process between the three set-ups (instrument / uninstrument)."""

    def __init__(self) -> None:
        from openinference.instrumentation.openai import OpenAIInstrumentor
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

        from spanrl.instrumentation.openai_instrumentor import SpanrlOpenAIInstrumentor

        class DroppingExporter(SpanExporter):
            def export(self, spans):
                return SpanExportResult.SUCCESS

        self.provider = TracerProvider()
        self.provider.add_span_processor(BatchSpanProcessor(DroppingExporter()))
        self.openinference = OpenAIInstrumentor()
        self.spanrl = SpanrlOpenAIInstrumentor()

    def set(self, mode: str) -> None:
        if self.spanrl.is_instrumented_by_opentelemetry:
            self.spanrl.uninstrument()
        if self.openinference.is_instrumented_by_opentelemetry:
            self.openinference.uninstrument()
        if mode in ("openinference", "spanrl"):
            self.openinference.instrument(tracer_provider=self.provider)
        if mode == "spanrl":  # openinference is on already: spanrl only adds its part
            self.spanrl.instrument(tracer_provider=self.provider)


def client(base_url: str, calls: int, rounds: int) -> dict:
    """Time blocks of ``calls`` calls of each kind, the three modes interleaved ``rounds``
    times; return {mode: {kind: {"cpu": [...], "wall": [...]}}} in seconds per call."""
    import openai

    modes = _Modes()
    api = openai.OpenAI(base_url=base_url, api_key="bench")
    messages = [{"role": "user", "content": "Compute 37 + 45 and explain each step briefly."}]
    # The same request bytes in every mode: ``none`` and ``openinference`` ask for token ids
    # themselves (extra_body), under ``spanrl`` the instrumentation adds the field. So the
    # server's answers, and openinference's work on them, are the same size in all three.
    asked = {"return_token_ids": True}
    body = {"value": asked}

    calls_by_kind = {  # extra_body=None sends nothing extra
        "chat": lambda: api.chat.completions.create(
            model="p", messages=messages, extra_body=body["value"]),
        "chat_stream": lambda: [c for c in api.chat.completions.create(
            model="p", messages=messages, stream=True, extra_body=body["value"])],
        "completion": lambda: api.completions.create(
            model="p", prompt="37 + 45 =", extra_body=body["value"]),
    }
    samples = {m: {k: {"cpu": [], "wall": []} for k in KINDS} for m in MODES}
    for mode in MODES:  # warm every code path once
        modes.set(mode)
        body["value"] = None if mode == "spanrl" else asked
        for call in calls_by_kind.values():
            for _ in range(10):
                call()
    for _ in tqdm(range(rounds), desc="rounds", file=sys.stderr):
        for mode in MODES:
            modes.set(mode)
            body["value"] = None if mode == "spanrl" else asked
            for kind, call in calls_by_kind.items():
                for _ in range(WARM_CALLS):  # steady state: an agent instruments once, not per call
                    call()
                wall = []
                cpu_start = time.thread_time()  # this thread only: not the server, not export
                for _ in range(calls):
                    start = time.perf_counter()
                    call()
                    wall.append(time.perf_counter() - start)
                samples[mode][kind]["cpu"].append((time.thread_time() - cpu_start) / calls)
                samples[mode][kind]["wall"].append(statistics.median(wall))
    modes.set("none")
    modes.provider.shutdown()
    return samples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20, help="calls per kind per block")
    parser.add_argument("--rounds", type=int, default=30, help="interleaved rounds of the 3 modes")
    parser.add_argument("--tokens", type=int, default=64, help="response tokens per call")
    parser.add_argument("--server", choices=SERVERS, default="spanrl",
                        help="the endpoint's answer to spanrl's request for ids: spanrl's server packs them "
                        "(the default), vLLM sends lists")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.tokens, args.server)
        return 0

    server = subprocess.Popen([sys.executable, __file__, "--serve", "--tokens", str(args.tokens),
                               "--server", args.server],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        base_url = server.stdout.readline().strip()
        samples = client(base_url, args.calls, args.rounds)
    finally:
        server.stdin.close()
        server.wait(timeout=10)

    print(f"{args.calls} calls per kind x {args.rounds} rounds, {args.tokens} response tokens, "
          f"{args.server}'s answers; "
          "microseconds per call (CPU: fastest block; wall: median block)")
    ratios = []
    for metric, title in (("cpu", "client-thread CPU time per call (robust to a busy machine)"),
                          ("wall", "wall-clock latency per call (median)")):
        print(f"\n{title}")
        print(f"{'kind':<12} {'none':>8} {'openinf':>8} {'spanrl':>8} {'oi added':>9} "
              f"{'spanrl added':>13} {'own':>6} {'ratio':>6}")
        for kind in KINDS:
            # CPU: the least disturbed block (as timeit does); wall: the median block
            pick = min if metric == "cpu" else statistics.median
            none, oi, ours = (pick(samples[m][kind][metric]) * 1e6 for m in MODES)
            oi_added, our_added = oi - none, ours - none
            ratio = our_added / oi_added if oi_added > 0 else float("nan")
            if metric == "cpu":
                ratios.append(ratio)
            # own: spanrl's part alone (its addition beyond openinference's); 1.1x needs it at a tenth of "oi added"
            print(f"{kind:<12} {none:8.0f} {oi:8.0f} {ours:8.0f} {oi_added:9.0f} "
                  f"{our_added:13.0f} {our_added - oi_added:6.0f} {ratio:6.2f}")
    print(f"\nspanrl added CPU / openinference added CPU: worst {max(ratios):.2f}x (goal <= 1.1x)")
    paired = print_paired(samples)
    print(f"paired by round (the same ratio from each round's own blocks): worst {max(paired):.2f}x (goal <= 1.1x)")
    return 0


def print_paired(samples: dict) -> list[float]:
    """The CPU each instrumentation adds, measured against the ``none`` block of the same round
    (blocks minutes apart share less: the machine's clock, its neighbours, the caches), as the
    median over rounds; the fastest blocks above can come from different minutes. Prints a table
    with the quartiles of spanrl's own part per round; returns each kind's ratio."""
    print("\nclient-thread CPU time added per call, paired by round (median over rounds)")
    print(f"{'kind':<12} {'oi added':>9} {'spanrl added':>13} {'own q1':>7} {'own':>6} {'own q3':>7} {'ratio':>6}")
    ratios = []
    for kind in KINDS:
        none, oi, ours = (samples[m][kind]["cpu"] for m in MODES)
        oi_added = statistics.median(o - n for o, n in zip(oi, none, strict=True)) * 1e6
        our_added = statistics.median(s - n for s, n in zip(ours, none, strict=True)) * 1e6
        own_q1, own, own_q3 = (q * 1e6 for q in statistics.quantiles(
            [s - o for s, o in zip(ours, oi, strict=True)], n=4))
        ratio = our_added / oi_added if oi_added > 0 else float("nan")
        ratios.append(ratio)
        print(f"{kind:<12} {oi_added:9.0f} {our_added:13.0f} {own_q1:7.0f} {own:6.0f} {own_q3:7.0f} {ratio:6.2f}")
    return ratios


if __name__ == "__main__":
    sys.exit(main())
