"""Benchmark: assembly cost per span at 100 vs 100 000 spans per rollout (goal: within 1.2x, issue 25).

Run: ``python bench/bench_receiver_assembly.py [--small 100] [--large 100000] [--ids packed|array]``.
Writes agent-shaped rollouts (root, steps, LLM calls with token ids, wrapped duplicates,
tools with errors, rewards, variables) into a SQLite store, then times what the receiver's
assembler does for one ended rollout (``Assembler.assemble``): read its spans from the store,
decode them, build the tree, dedupe, attach rewards and AIR rewards, credit assignment. The small case runs enough
rollouts to assemble the same number of spans as the large one; prints microseconds per span
for each and the ratio large/small. Token ids are written packed (one string, what spanrl's
instrumentation writes) or, with ``--ids array``, as int arrays (what another language may write).
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time

from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from spanrl.instrumentation import semconv
from spanrl.instrumentation.packed_values import pack_token_ids
from spanrl.otlp_receiver.air import load_rules
from spanrl.otlp_receiver.assembly import AssemblyOptions
from spanrl.otlp_receiver.otlp_decode import SpanRow
from spanrl.otlp_receiver.server import Assembler
from spanrl.otlp_receiver.settings import ReceiverSettings
from spanrl.otlp_receiver.store import SpanStore


def _kv(key, value) -> KeyValue:
    kv = KeyValue(key=key)
    if isinstance(value, str):
        kv.value.string_value = value
    elif isinstance(value, float):
        kv.value.double_value = value
    elif isinstance(value, int):
        kv.value.int_value = value
    else:
        kv.value.array_value.values.extend(AnyValue(int_value=v) for v in value)
    return kv


def rollout_rows(rollout_id: str, spans: int, rng: random.Random, packed: bool = True) -> list[SpanRow]:
    """About ``spans`` spans: root, then steps of chain -> (LLM wrapper -> LLM call), tool."""
    ids = pack_token_ids if packed else list
    trace_id = rng.getrandbits(128).to_bytes(16, "big")
    counter = iter(range(1, 10**9))
    identity = [_kv(semconv.ROLLOUT_ID, rollout_id), _kv(semconv.TASK_ID, "t"), _kv(semconv.ATTEMPT, 0)]
    rows: list[SpanRow] = []

    def add(name, parent, start, attrs=(), error=False, events=()) -> bytes:
        span_id = next(counter).to_bytes(8, "big")
        span = Span(trace_id=trace_id, span_id=span_id, parent_span_id=parent, name=name,
                    start_time_unix_nano=start, end_time_unix_nano=start + 10, attributes=[*identity, *attrs])
        if error:
            span.status.code = Status.STATUS_CODE_ERROR
        for event in events:
            span.events.add(name=semconv.REWARD_EVENT, attributes=[_kv(semconv.REWARD_VALUE, event)])
        rows.append(SpanRow(trace_id, span_id, rollout_id, "t", 0, name, start, span.SerializeToString()))
        return span_id

    root = add(semconv.ROLLOUT_SPAN_NAME, b"", 0, [_kv(semconv.variable("question"), "q")], events=[1.0])
    step = 0
    while len(rows) + 5 <= spans:
        t = 100 * (step + 1)
        chain = add("agent-step", root, t, [_kv("openinference.span.kind", "CHAIN")])
        wrapper = add("ChatOpenAI", chain, t + 1, [_kv("openinference.span.kind", "LLM")])
        add("ChatCompletion", wrapper, t + 2, [
            _kv("openinference.span.kind", "LLM"),
            _kv(semconv.LLM_PROMPT_TOKEN_IDS, ids(rng.randrange(32000) for _ in range(64))),
            _kv(semconv.llm_response_token_ids(0), ids(rng.randrange(32000) for _ in range(8))),
        ])
        add("calculator", chain, t + 5, [_kv("openinference.span.kind", "TOOL")], error=step % 7 == 0,
            events=[0.1] if step % 3 == 0 else ())
        add("parse", chain, t + 6, [_kv(semconv.variable("step"), step)])
        step += 1
    rng.shuffle(rows)  # spans arrive in any order
    return rows


def time_assembly(assembler: Assembler, rollout_ids: list[str]) -> tuple[float, int]:
    spans_done = 0
    start = time.perf_counter()
    for rollout_id in rollout_ids:
        rollout, spans = assembler.assemble(rollout_id, "rollout_span")
        assert rollout.transitions, "every benchmark rollout has calls"
        spans_done += spans
    return time.perf_counter() - start, spans_done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=100)
    parser.add_argument("--large", type=int, default=100_000)
    parser.add_argument("--ids", choices=("packed", "array"), default="packed",
                        help="how the LLM spans carry token ids (default: packed, as spanrl's instrumentation)")
    args = parser.parse_args()
    rng = random.Random(0)
    options = AssemblyOptions(air_rules=load_rules("default"))
    with tempfile.TemporaryDirectory() as tmp:
        store = SpanStore(os.path.join(tmp, "bench.db"), sync="normal")
        small_ids = [f"small-{i}" for i in range(max(1, args.large // args.small))]
        for rollout_id in small_ids:
            store.write_spans(rollout_rows(rollout_id, args.small, rng, args.ids == "packed"))
        store.write_spans(rollout_rows("large", args.large, rng, args.ids == "packed"))
        assembler = Assembler(store, ReceiverSettings(), options)
        results = {}
        for name, ids in (("small", small_ids), ("large", ["large"])):
            best = None
            for _ in range(2):
                elapsed, spans = time_assembly(assembler, ids)
                per_span = elapsed / spans
                best = per_span if best is None else min(best, per_span)
            results[name] = best
            print(f"{name:>5}: {len(ids)} rollout(s) of ~{spans // len(ids)} spans: {best * 1e6:6.1f} us/span")
        store.close()
    ratio = results["large"] / results["small"]
    print(f"ratio large/small per-span cost: {ratio:.2f}x  (goal <= 1.2x)")


if __name__ == "__main__":
    main()
