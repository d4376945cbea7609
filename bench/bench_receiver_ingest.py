"""Benchmark: sustained durable ingest (spans/s) vs raw protobuf parse speed of the same payloads.

Run: ``python bench/bench_receiver_ingest.py [--requests 40] [--spans 200] [--clients 4] [--ids packed|array]``.
Builds realistic agent payloads (LLM spans with a few hundred prompt token ids, tool spans; the
ids packed, as spanrl's instrumentation writes them, or with ``--ids array`` as int arrays, as
another language's agent may),
measures ``ExportTraceServiceRequest.FromString`` over them (the baseline), then sends the
same bytes over OTLP/gRPC on loopback to a ``spanrl receive`` process, each request
acknowledged only after its SQLite commit, and prints spans/s and the ratio (goal >= 50 %).
Also measures, in one thread without the network, validation alone (with the C span scanner
and with the Python path it falls back to) and validation + commit, to show where time goes.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time

import grpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from spanrl.instrumentation import semconv
from spanrl.instrumentation.packed_values import pack_token_ids
from spanrl.otlp_receiver.otlp_decode import NATIVE_SCANNER, decode_payload
from spanrl.otlp_receiver.store import SpanStore

EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


def _kv(key: str, value) -> KeyValue:
    kv = KeyValue(key=key)
    if isinstance(value, str):
        kv.value.string_value = value
    elif isinstance(value, int):
        kv.value.int_value = value
    elif isinstance(value, list):
        kv.value.array_value.values.extend(AnyValue(int_value=v) for v in value)
    return kv


def build_payloads(requests: int, spans_per_request: int, seed: int = 0, ids: str = "array") -> list[bytes]:
    rng = random.Random(seed)

    def token_ids(count: int) -> str | list[int]:
        values = [rng.randrange(32000) for _ in range(count)]
        return pack_token_ids(values) if ids == "packed" else values

    payloads = []
    for r in range(requests):
        spans = []
        trace_id = rng.getrandbits(128).to_bytes(16, "big")
        rollout = f"bench-{r}"
        for s in range(spans_per_request):
            attrs = [
                _kv(semconv.ROLLOUT_ID, rollout), _kv(semconv.TASK_ID, f"task-{r}"), _kv(semconv.ATTEMPT, 0),
            ]
            if s % 2 == 0:  # an LLM call
                attrs += [
                    _kv("openinference.span.kind", "LLM"),
                    _kv(semconv.LLM_PROMPT_TOKEN_IDS, token_ids(300)),
                    _kv(semconv.llm_response_token_ids(0), token_ids(40)),
                    _kv("llm.input_messages.0.message.content", "What is 37 + 45? " * 20),
                    _kv("llm.output_messages.0.message.content", "CALC 37+45"),
                ]
            else:
                attrs += [_kv("openinference.span.kind", "TOOL"), _kv("tool.name", "calculator")]
            spans.append(Span(
                trace_id=trace_id, span_id=rng.getrandbits(64).to_bytes(8, "big") or b"\x01" * 8,
                parent_span_id=b"\x01" * 8, name="chat" if s % 2 == 0 else "calculator",
                start_time_unix_nano=1_700_000_000_000_000_000 + s, end_time_unix_nano=1_700_000_000_000_000_100 + s,
                attributes=attrs,
            ))
        request = ExportTraceServiceRequest(resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(spans=spans)])])
        payloads.append(request.SerializeToString())
    return payloads


def parse_rate(payloads: list[bytes], spans: int, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for payload in payloads:
            ExportTraceServiceRequest.FromString(payload)
        best = min(best, time.perf_counter() - start)
    return spans / best


def start_receiver_process(db: str, sync: str) -> tuple[subprocess.Popen, int]:
    """The real ``spanrl receive`` in its own process (its own GIL), on a free port."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "spanrl", "--log-level", "WARNING", "receive", "--db", db, "--sync", sync,
         "--grpc-port", "0", "--http-port", "0", "--idle-timeout-s", "0", "--grace-s", "3600"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    for line in proc.stdout:
        match = re.search(r"ready, OTLP/gRPC [\d.]+:(\d+)", line)
        if match:
            return proc, int(match.group(1))
    raise RuntimeError("spanrl receive did not start")


def grpc_ingest_rate(payloads: list[bytes], spans: int, clients: int, sync: str) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        db = os.path.join(tmp, "bench.db")
        proc, port = start_receiver_process(db, sync)
        try:
            channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 64 << 20)])
            export = channel.unary_unary(EXPORT, response_deserializer=ExportTraceServiceResponse.FromString)
            export(payloads[0])  # warm up the channel (these spans count as duplicates below)
            queue = list(range(len(payloads)))
            lock = threading.Lock()

            def client() -> None:
                while True:
                    with lock:
                        if not queue:
                            return
                        i = queue.pop()
                    response = export(payloads[i])
                    assert not response.HasField("partial_success"), response

            threads = [threading.Thread(target=client) for _ in range(clients)]
            start = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            elapsed = time.perf_counter() - start
            channel.close()
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        with SpanStore(db) as store:
            assert store.span_count() == spans, "every acknowledged span must be stored"
    return spans / elapsed


def validate_rate(payloads: list[bytes], spans: int, native: bool, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for payload in payloads:
            decode_payload(payload, native=native)
        best = min(best, time.perf_counter() - start)
    return spans / best


def direct_ingest_rate(payloads: list[bytes], spans: int, sync: str) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        store = SpanStore(os.path.join(tmp, "direct.db"), sync=sync)
        start = time.perf_counter()
        for payload in payloads:
            store.write_spans(decode_payload(payload).rows)
        elapsed = time.perf_counter() - start
        store.close()
    return spans / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--spans", type=int, default=200, help="spans per request")
    parser.add_argument("--clients", type=int, default=4, help="concurrent gRPC clients")
    parser.add_argument("--repeat", type=int, default=2, help="runs per measurement (best is shown)")
    parser.add_argument("--ids", choices=("packed", "array"), default="array",
                        help="token ids as int arrays (the default: the figures in docs/receiver.md) or packed, as "
                             "spanrl's instrumentation writes them (their raw parse is ~10x faster, so the ratio is "
                             "not comparable)")
    args = parser.parse_args()
    payloads = build_payloads(args.requests, args.spans, ids=args.ids)
    spans = args.requests * args.spans
    size_mb = sum(map(len, payloads)) / 1e6
    print(f"payloads: {args.requests} requests x {args.spans} spans = {spans} spans, {size_mb:.1f} MB, ids {args.ids}")
    parse = parse_rate(payloads, spans, repeat=3 * args.repeat)
    print(f"baseline  raw protobuf parse:                 {parse:>10.0f} spans/s")
    paths = [("C scanner", True)] if NATIVE_SCANNER else []
    for label, native in paths + [("Python", False)]:
        rate = validate_rate(payloads, spans, native, repeat=3 * args.repeat)
        print(f"validate  only, {label:<10}                   {rate:>10.0f} spans/s  ratio {rate / parse:6.1%}")
    for sync in ("full", "normal"):
        direct = max(direct_ingest_rate(payloads, spans, sync) for _ in range(args.repeat))
        print(f"ingest    decode+validate+commit, sync={sync:<6}  {direct:>10.0f} spans/s  ratio {direct / parse:6.1%}")
    for sync in ("full", "normal"):
        rate = max(grpc_ingest_rate(payloads, spans, args.clients, sync) for _ in range(args.repeat))
        print(f"ingest    OTLP/gRPC durable, sync={sync:<6}       {rate:>10.0f} spans/s  ratio {rate / parse:6.1%}"
              f"  (goal >= 50%)")


if __name__ == "__main__":
    main()
