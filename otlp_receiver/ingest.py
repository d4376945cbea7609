"""Group commit: Export requests wait here until their spans are durable in the store.

Called by the gRPC and HTTP services (``submit`` blocks the request's thread). One writer
thread takes every request waiting, writes all their spans in one SQLite transaction and then
releases them, so many concurrent requests share one commit (and one fsync). When more than
``max_pending_bytes`` of spans are already waiting, a new request is refused with
``Overloaded`` (UNAVAILABLE / 503 + retry delay) instead of queueing without bound.

A span the store will not take (its rollout was already assembled, a value SQLite cannot hold)
is returned to its request as rejected, with the reason; the rest are stored. Only conditions
that can pass are retryable: overload and ``StoreError`` (locked, disk full, I/O). Anything
else is a bug, raised as ``IngestFailed`` (INTERNAL / 500: retrying would not help).
"""

from __future__ import annotations

import logging
import threading
import time

from spanrl.otlp_receiver.otlp_decode import SpanRow
from spanrl.otlp_receiver.span_writes import RejectedSpan
from spanrl.otlp_receiver.store import SpanStore, StoreError

logger = logging.getLogger(__name__)


class Overloaded(RuntimeError):
    """Too much is waiting for the store; the client should retry after ``retry_after_s``."""

    def __init__(self, retry_after_s: float, pending_bytes: int) -> None:
        super().__init__(
            f"receiver overloaded: {pending_bytes} bytes of spans wait for the store; retry later"
        )
        self.retry_after_s = retry_after_s


class IngestFailed(RuntimeError):
    """Writing spans failed for a reason a retry would not fix (a bug): INTERNAL / 500."""


class _Pending:
    __slots__ = ("rows", "size", "done", "error", "rejected")

    def __init__(self, rows: list[SpanRow], size: int) -> None:
        self.rows = rows
        self.size = size
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.rejected: list[RejectedSpan] = []  # indices into ``rows``


class IngestWriter:
    """Owns the store connection that writes spans; ``submit`` returns once they are committed."""

    def __init__(self, store: SpanStore, max_pending_bytes: int, retry_after_s: float) -> None:
        self.store = store
        self.max_pending_bytes = max_pending_bytes
        self.retry_after_s = retry_after_s
        self._cond = threading.Condition()
        self._queue: list[_Pending] = []
        self._pending_bytes = 0  # queued + being written
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="spanrl-ingest-writer", daemon=True)
        self.committed_spans = 0
        self.commits = 0
        self.overloaded_requests = 0

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    def start(self) -> None:
        self._thread.start()

    def submit(self, rows: list[SpanRow]) -> list[RejectedSpan]:
        """Block until ``rows`` are committed; returns those the store rejected (indices into
        ``rows``, with the reason). Raises ``Overloaded``, ``StoreError`` or ``IngestFailed``."""
        if not rows:
            return []
        size = sum(len(r.body) for r in rows)
        pending = _Pending(rows, size)
        with self._cond:
            if self._stopping or (self._pending_bytes and self._pending_bytes + size > self.max_pending_bytes):
                self.overloaded_requests += 1
                raise Overloaded(self.retry_after_s, self._pending_bytes)
            self._pending_bytes += size
            self._queue.append(pending)
            self._cond.notify()
        pending.done.wait()
        if pending.error is not None:
            raise pending.error
        return pending.rejected

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue and self._stopping:
                    return
                batch, self._queue = self._queue, []
            rows = [row for pending in batch for row in pending.rows]
            error: BaseException | None = None
            rejected: list[RejectedSpan] = []
            try:
                rejected = self.store.write_spans(rows, now=time.time())
                self.committed_spans += len(rows) - len(rejected)
                self.commits += 1
            except StoreError as exc:
                logger.error("%s", exc)
                error = exc
            except BaseException as exc:  # never leave a request waiting forever
                logger.exception("unexpected error writing spans")
                error = IngestFailed(f"unexpected error writing spans: {type(exc).__name__}: {exc}")
            with self._cond:
                self._pending_bytes -= sum(p.size for p in batch)
            _hand_back(batch, rejected)
            for pending in batch:
                pending.error = error
                pending.done.set()

    def stop(self) -> None:
        """Write what is queued, then stop the writer thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join()


def _hand_back(batch: list[_Pending], rejected: list[RejectedSpan]) -> None:
    """Give each request its own rejections, re-indexed from the batch's rows to its own."""
    if not rejected:
        return
    rejected = sorted(rejected, key=lambda r: r.index)
    position = 0
    offset = 0
    for pending in batch:
        end = offset + len(pending.rows)
        while position < len(rejected) and rejected[position].index < end:
            item = rejected[position]
            pending.rejected.append(RejectedSpan(item.index - offset, item.reason))
            position += 1
        offset = end
