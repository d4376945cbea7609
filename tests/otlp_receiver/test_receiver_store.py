"""The SQLite span store: triggers, cursors, other processes, and what the receiver imports."""

from __future__ import annotations

import logging
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from spanrl.instrumentation import semconv
from spanrl.otlp_receiver.assembly import AssemblyOptions
from spanrl.otlp_receiver.otlp_decode import decode_request
from spanrl.otlp_receiver.server import Assembler
from spanrl.otlp_receiver.settings import ReceiverSettings
from spanrl.otlp_receiver.store import (
    COMPLETION_ALREADY_ASSEMBLED,
    COMPLETION_PENDING,
    PENDING_COMPLETION_TTL_S,
    SpanStore,
    StoreError,
)


def rows(*spans):
    request = ExportTraceServiceRequest(resource_spans=[ResourceSpans(scope_spans=[ScopeSpans(spans=list(spans))])])
    decoded = decode_request(request)
    assert decoded.rejected == 0, decoded.reasons
    return decoded.rows


def span(n, trace=1, rollout="r1", parent=None, name="s", ids=False):
    attrs = [] if rollout is None else [KeyValue(key=semconv.ROLLOUT_ID, value=AnyValue(string_value=rollout))]
    if ids:
        arr = AnyValue()
        arr.array_value.values.add(int_value=n)
        attrs.append(KeyValue(key=semconv.LLM_PROMPT_TOKEN_IDS, value=arr))
        attrs.append(KeyValue(key=semconv.llm_response_token_ids(0), value=arr))
    s = Span(trace_id=trace.to_bytes(16, "big"), span_id=n.to_bytes(8, "big"), name=name,
             start_time_unix_nano=n, end_time_unix_nano=n + 1, attributes=attrs)
    if parent:
        s.parent_span_id = parent.to_bytes(8, "big")
    return s


def assembler(store, **overrides):
    settings = replace(ReceiverSettings(grace_s=1.0, idle_timeout_s=60.0), **overrides)
    return Assembler(store, settings, AssemblyOptions())


def test_triggers_grace_idle_and_explicit(tmp_path):
    store = SpanStore(tmp_path / "s.db")
    store.write_spans(rows(span(1, name=semconv.ROLLOUT_SPAN_NAME, rollout="ended")), now=100.0)
    store.write_spans(rows(span(2, trace=2, rollout="idle", ids=True)), now=100.0)
    store.write_spans(rows(span(3, trace=3, rollout="asked", ids=True)), now=100.0)
    store.complete_rollout("asked", now=100.5)
    a = assembler(store)
    assert a.run_once(now=100.9) == []  # grace not over
    # a straggler of "ended" arrives during the grace delay: it is waited for and included
    store.write_spans(rows(span(4, rollout="ended", parent=1, ids=True)), now=100.9)
    (asked,) = a.run_once(now=101.5)  # "ended" waits: its straggler restarted the grace delay
    assert asked.rollout_id == "asked" and asked.end_reason == "explicit"
    (ended,) = a.run_once(now=102.0)
    assert ended.rollout_id == "ended" and ended.end_reason == "rollout_span"
    assert len(ended.transitions) == 1  # the straggler's call is in
    done = {"asked": asked, "ended": ended}
    assert "idle" not in done
    (idle,) = a.run_once(now=161.0)
    assert idle.rollout_id == "idle" and idle.end_reason == "idle_timeout"
    # a late span after assembly is stored and counted, the rollout is not assembled twice
    store.write_spans(rows(span(5, rollout="ended", parent=1)), now=170.0)
    assert a.run_once(now=300.0) == []
    late = {s.rollout_id: s.late_spans for s in store.rollout_summaries()}
    assert late["ended"] == 1
    rollouts, cursor = store.completed_rollouts(0)
    assert [r.sequence for r in rollouts] == [1, 2, 3] and cursor == 3
    assert store.completed_rollouts(since=2, limit=5) == ([rollouts[2]], 3)
    store.close()


def test_spans_without_identity_join_their_trace(tmp_path):
    """A service that does not stamp rollout identity: its spans share the rollout's trace."""
    store = SpanStore(tmp_path / "s.db")
    store.write_spans(rows(span(1, trace=7, name=semconv.ROLLOUT_SPAN_NAME)))
    store.write_spans(rows(span(2, trace=7, rollout=None, parent=1, ids=True)))
    store.write_spans(rows(span(3, trace=8, rollout=None, ids=True)))  # unrelated trace
    store.write_spans(rows(span(4, trace=9, parent=1, ids=True)))  # same rollout, another trace
    (rollout,) = assembler(store, grace_s=0).run_once()
    assert [t.prompt_token_ids for t in rollout.transitions] == [(2,), (4,)]
    store.close()


def test_other_process_reads_while_receiver_writes(tmp_path):
    db = tmp_path / "s.db"
    store = SpanStore(db)
    store.write_spans(rows(span(1, name=semconv.ROLLOUT_SPAN_NAME), span(2, parent=1, ids=True)))
    assembler(store, grace_s=0).run_once()
    reader = textwrap.dedent(f"""
        import sys
        from spanrl.otlp_receiver.store import SpanStore
        rollouts, cursor = SpanStore({str(db)!r}).completed_rollouts(since=0)
        print(len(rollouts), cursor, rollouts[0].transitions[0].prompt_token_ids)
        assert "torch" not in sys.modules
    """)
    out = subprocess.run([sys.executable, "-c", reader], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "1", "(2,)"]
    store.close()


def test_receiver_never_imports_torch():
    code = textwrap.dedent("""
        import sys
        import spanrl.otlp_receiver.server, spanrl.otlp_receiver.retokenize, spanrl.otlp_receiver.receive_cli
        import spanrl.otlp_receiver.inspect_cli
        assert "torch" not in sys.modules and "transformers" not in sys.modules
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_explicit_completion_before_any_span_waits_for_spans(tmp_path):
    store = SpanStore(tmp_path / "s.db")
    assert store.complete_rollout("early", now=100.0) == COMPLETION_PENDING
    assert store.rollout_summaries() == []  # a pending completion is not an open rollout
    a = assembler(store, grace_s=0.5)
    assert a.run_once(now=110.0) == []  # nothing arrived yet: keep waiting
    store.write_spans(rows(span(1, rollout="early", ids=True)), now=111.0)
    assert a.run_once(now=111.3) == []  # the grace delay runs from the last span
    (rollout,) = a.run_once(now=111.6)
    assert rollout.end_reason == "explicit" and len(rollout.transitions) == 1
    assert store.complete_rollout("early", now=112.0) == COMPLETION_ALREADY_ASSEMBLED
    store.close()


def test_completion_of_an_unknown_rollout_creates_no_rollout(tmp_path):
    store = SpanStore(tmp_path / "s.db")
    assert store.complete_rollout("never", now=200.0) == COMPLETION_PENDING
    a = assembler(store, grace_s=0.5)
    assert a.run_once(now=200.0 + 7 * 24 * 3600) == []  # nothing is ever assembled empty
    assert store.rollout_summaries() == []
    # a pending completion expires: spans of that id arriving much later are not completed by it
    store.complete_rollout("other", now=200.0 + PENDING_COMPLETION_TTL_S + 1)  # purges the old one
    store.write_spans(rows(span(1, rollout="never", ids=True)), now=200.0 + PENDING_COMPLETION_TTL_S + 2)
    assert a.run_once(now=200.0 + PENDING_COMPLETION_TTL_S + 10) == []  # open: no trigger
    (summary,) = store.rollout_summaries()
    assert summary.rollout_id == "never" and summary.state == "open"
    store.close()


def test_a_rollout_that_cannot_be_assembled_is_marked_broken(tmp_path):
    from spanrl.otlp_receiver.otlp_decode import SpanRow

    store = SpanStore(tmp_path / "s.db")
    good = rows(span(1, rollout="fine", name=semconv.ROLLOUT_SPAN_NAME))
    corrupt = SpanRow(b"\x02" * 16, b"\x03" * 8, "corrupt", None, None, semconv.ROLLOUT_SPAN_NAME, 1, b"\xff\xff")
    store.write_spans(good + [corrupt], now=100.0)
    a = assembler(store, grace_s=0)
    assert [r.rollout_id for r in a.run_once(now=101.0)] == ["fine"]
    assert a.run_once(now=102.0) == []  # not retried forever
    states = {s.rollout_id: s.state for s in store.rollout_summaries()}
    assert states == {"fine": "assembled", "corrupt": "broken"}
    store.close()


def test_retried_spans_do_not_count_twice_or_delay_assembly(tmp_path):
    """An exporter retry re-sends spans already stored: they are ignored, bookkeeping included."""
    store = SpanStore(tmp_path / "s.db")
    batch = rows(span(1, name=semconv.ROLLOUT_SPAN_NAME), span(2, parent=1, ids=True))
    store.write_spans(batch, now=100.0)
    store.write_spans(batch, now=100.8)  # retries of the same batch
    store.write_spans(batch + rows(span(2, parent=1, ids=True)), now=100.9)
    (summary,) = store.rollout_summaries()
    assert (summary.span_count, summary.last_seen, summary.late_spans) == (2, 100.0, 0)
    (done,) = assembler(store).run_once(now=101.1)  # grace counted from the first arrival
    assert done.rollout_id == "r1" and len(done.transitions) == 1
    assert store.write_spans(batch, now=110.0) == []  # a retry after assembly: acknowledged again
    (summary,) = store.rollout_summaries()
    assert (summary.span_count, summary.last_seen, summary.late_spans) == (2, 100.0, 0)
    # a genuinely new span after assembly is refused and counted, even in a batch with duplicates
    (refused,) = store.write_spans(batch + rows(span(3, parent=1)), now=111.0)
    assert refused.index == 2 and "already assembled" in refused.reason
    (summary,) = store.rollout_summaries()
    assert (summary.span_count, summary.last_seen, summary.late_spans) == (2, 100.0, 1)
    assert store.span_count() == 2
    assert store.assembled_rollout("r1") == done
    store.close()


def test_complete_rollout_on_a_locked_store_raises_store_error(tmp_path):
    store = SpanStore(tmp_path / "s.db")
    store._db.execute("PRAGMA busy_timeout=0")  # fail at once instead of waiting a minute
    other = sqlite3.connect(str(tmp_path / "s.db"), isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
        with pytest.raises(StoreError, match="r-locked.*locked"):
            store.complete_rollout("r-locked", now=100.0)
        other.execute("ROLLBACK")
        # the store is usable afterwards (no span of it yet: the completion waits for them)
        assert store.complete_rollout("r-locked", now=100.0) == COMPLETION_PENDING
    finally:
        other.close()
        store.close()


class _StoreBusyOnce(SpanStore):
    """A real store whose first read of a rollout's spans meets a busy database, as it can when
    another process holds a lock (not reproducible on demand for a WAL reader)."""

    busy_reads = 1

    def rollout_bodies(self, rollout_id):  # what the assembler reads
        if self.busy_reads:
            self.busy_reads -= 1
            raise sqlite3.OperationalError("database is locked")
        return super().rollout_bodies(rollout_id)


def test_store_error_while_reading_spans_is_retried_not_broken(tmp_path, caplog):
    store = _StoreBusyOnce(tmp_path / "s.db")
    store.write_spans(rows(span(1, name=semconv.ROLLOUT_SPAN_NAME), span(2, parent=1, ids=True)), now=100.0)
    a = assembler(store)
    with caplog.at_level(logging.WARNING, logger="spanrl.otlp_receiver.server"):
        assert a.run_once(now=102.0) == []
    assert "database is locked" in caplog.text and "retrying" in caplog.text
    assert list(store.iter_rollout_ids(state="open")) == ["r1"]  # not marked broken
    (done,) = a.run_once(now=103.0)  # the next poll assembles it
    assert done.rollout_id == "r1" and len(done.transitions) == 1
    assert list(store.iter_rollout_ids(state="assembled")) == ["r1"]
    store.close()


class _StoreSlowReads(SpanStore):
    """A real store whose reads of a rollout's spans take a while, as a large rollout's do: the
    window in which a second assembly pass would see the same rollouts ready."""

    def rollout_bodies(self, rollout_id):
        time.sleep(0.01)
        return super().rollout_bodies(rollout_id)


def test_assembly_passes_called_at_once_assemble_each_rollout_once(tmp_path):
    """``run_once`` called while another pass runs (the receiver's thread and a caller): no error,
    and each ready rollout is assembled by exactly one of them."""
    store = _StoreSlowReads(tmp_path / "s.db")
    ids = [f"r{i}" for i in range(20)]
    for i, rollout_id in enumerate(ids):
        store.write_spans(rows(span(1, trace=i + 1, rollout=rollout_id, ids=True)), now=100.0)
        store.complete_rollout(rollout_id, now=100.0)
    a = assembler(store, grace_s=0)
    start = threading.Barrier(2)
    results: dict[str, list] = {}

    def one_pass(name):
        start.wait()
        try:
            results[name] = [r.rollout_id for r in a.run_once(now=101.0)]
        except Exception as exc:  # noqa: BLE001 - the assertion below names it
            results[name] = exc

    threads = [threading.Thread(target=one_pass, args=(n,)) for n in ("first", "second")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(isinstance(r, Exception) for r in results.values()), results
    assert sorted(results["first"] + results["second"]) == sorted(ids)
    assert sorted(store.iter_rollout_ids(state="assembled")) == sorted(ids)
    store.close()
