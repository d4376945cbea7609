"""A rollout's spans as one tree: decode, repair missing parents, break parent cycles.

Called by ``assembly.py`` (and ``spanrl inspect rollout`` to print the tree). Spans arrive in
any order, across requests and traces; the tree is rebuilt from parent ids alone. The root is
the rollout's ``spanrl.rollout`` span (or a virtual root when that span never arrived); a span
whose parent is unknown, and a span on a parent cycle, hangs from the root instead, with a
problem noted. Children are ordered by start time; everything runs in linear time (plus the
sort of each child list).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from opentelemetry.proto.common.v1.common_pb2 import ArrayValue, KeyValueList
from opentelemetry.proto.trace.v1.trace_pb2 import Status

from spanrl.instrumentation import semconv
from spanrl.instrumentation.packed_values import unpack_logprobs, unpack_token_ids
from spanrl.otlp_receiver.otlp_shadow import ShadowSpan
from spanrl.otlp_receiver.span_checks import SCALAR_KINDS, any_value_to_python

VIRTUAL_ROOT_ID = "virtual-root"


@dataclass(slots=True)
class SpanEvent:
    name: str
    time_ns: int
    attributes: dict[str, Any]


@dataclass(slots=True)  # no per-record __dict__: a 100k-span rollout's records fit the caches better
class SpanRecord:
    """One span, decoded for assembly. ``key`` is the span id in hex (unique in a rollout)."""

    key: str
    trace_id: str
    parent_key: str | None
    name: str
    start_ns: int
    end_ns: int
    status_error: bool
    status_message: str
    attributes: dict[str, Any]
    events: list[SpanEvent]
    children: list[SpanRecord] = field(default_factory=list)
    parent: SpanRecord | None = None
    # Filled by SpanTree: position in the depth-first order and end of the subtree there.
    pre: int = 0
    post: int = 0

    @property
    def span_kind(self) -> str | None:
        kind = self.attributes.get(semconv.OPENINFERENCE_SPAN_KIND)
        return kind.upper() if isinstance(kind, str) else None


class LazyArray:
    """An array attribute kept as its serialized ``ArrayValue`` until someone needs the values.

    Token-id arrays are most of a rollout's bytes; keeping them compact while the tree is built
    and decoding only those of the calls that become transitions keeps assembly linear in
    practice (100k-span rollouts no longer thrash the CPU caches with millions of int objects).
    """

    __slots__ = ("raw",)

    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    def to_list(self) -> list:
        return [any_value_to_python(v) for v in ArrayValue.FromString(self.raw).values]

    def to_ints(self) -> list[int]:
        """The values of an array known to hold only ints (token ids, checked at ingest)."""
        return [v.int_value for v in ArrayValue.FromString(self.raw).values]

    def __eq__(self, other) -> bool:
        if isinstance(other, LazyArray):
            return self.raw == other.raw
        return isinstance(other, list) and self.to_list() == other

    def __repr__(self) -> str:
        return f"LazyArray({self.to_list()!r})"


def token_ids_of(value) -> list[int] | None:
    """A token-id attribute's ids (checked at ingest), packed (a string: packed_values.py) or an
    array, lazy or already a list; None when absent or of another kind."""
    if isinstance(value, str):
        return unpack_token_ids(value)
    if isinstance(value, LazyArray):
        return value.to_ints()
    return value if isinstance(value, list) else None


def logprobs_of(value) -> list[float] | None:
    """A logprob attribute's values, packed or an array (as ``token_ids_of``)."""
    if isinstance(value, str):
        return unpack_logprobs(value)
    if isinstance(value, LazyArray):
        return value.to_list()
    return value if isinstance(value, list) else None


def _attribute_value(value):
    """A shadow-schema AnyValue (arrays and kvlists kept as bytes) as ``any_value_to_python`` would
    give it, arrays left lazy."""
    kind = value.WhichOneof("value")
    if kind in SCALAR_KINDS:
        return getattr(value, kind)
    if kind == "array_value":
        return LazyArray(value.array_value)
    if kind == "kvlist_value":
        return {kv.key: any_value_to_python(kv.value) for kv in KeyValueList.FromString(value.kvlist_value).values}
    return None


def record_from_body(body: bytes) -> SpanRecord:
    """Decode one stored span (validated at ingest) through the shadow schema."""
    span = ShadowSpan.FromString(body)
    return SpanRecord(
        key=span.span_id.hex(),
        trace_id=span.trace_id.hex(),
        parent_key=span.parent_span_id.hex() or None,
        name=span.name,
        start_ns=span.start_time_unix_nano,
        end_ns=span.end_time_unix_nano,
        status_error=span.status.code == Status.STATUS_CODE_ERROR,
        status_message=span.status.message,
        attributes={kv.key: _attribute_value(kv.value) for kv in span.attributes},
        events=[
            SpanEvent(
                name=event.name,
                time_ns=event.time_unix_nano,
                attributes={kv.key: any_value_to_python(kv.value) for kv in event.attributes},
            )
            for event in span.events
        ],
    )


def records_from_bodies(bodies: Iterable[bytes]) -> list[SpanRecord]:
    return [record_from_body(body) for body in bodies]


# siblings (and rollout spans) in start order, ties by span id; read in C, not through a lambda
START_ORDER = attrgetter("start_ns", "key")


class SpanTree:
    """The tree of one rollout's spans, with ``order`` = depth-first (pre-order) list."""

    def __init__(self, records: list[SpanRecord]) -> None:
        self.records = records  # arrival order: cheaper to walk than ``order`` when order is moot
        self.problems: list[str] = []
        by_key: dict[str, SpanRecord] = {}
        rollout_spans = []
        # One pass does what it can for every record: a 100k-span rollout's records do not fit the
        # CPU caches, so each pass over them costs ~0.1-0.2 us a span in memory reads alone.
        for record in records:
            record.children = []  # records may be reused: the tree owns these links
            record.parent = None
            record.pre = -1  # not visited yet (_break_cycles)
            if record.key in by_key:  # the same span id twice (only across traces): keep first
                self.problems.append(f"span id {record.key} appears in two traces; kept one")
                continue
            by_key[record.key] = record
            if record.name == semconv.ROLLOUT_SPAN_NAME:
                rollout_spans.append(record)
        self.by_key = by_key
        self.root = self._choose_root(rollout_spans, by_key)
        self._link(by_key)
        self.order: list[SpanRecord] = []
        self._number()

    def _choose_root(self, roots: list[SpanRecord], by_key: dict[str, SpanRecord]) -> SpanRecord:
        self.has_rollout_span = bool(roots)
        self.separate_runs = len(_outermost(roots, by_key))
        if roots:
            roots.sort(key=START_ORDER)
            if len(roots) > 1:
                self.problems.append(
                    f"{len(roots)} {semconv.ROLLOUT_SPAN_NAME} spans; the earliest is the root"
                )
            return roots[0]
        starts = [r.start_ns for r in by_key.values()] or [0]
        ends = [r.end_ns for r in by_key.values()] or [0]
        self.problems.append(
            f"no {semconv.ROLLOUT_SPAN_NAME} span arrived; the tree hangs from a virtual root"
        )
        return SpanRecord(
            key=VIRTUAL_ROOT_ID, trace_id="", parent_key=None, name="(rollout)",
            start_ns=min(starts), end_ns=max(ends), status_error=False, status_message="",
            attributes={}, events=[],
        )

    def _link(self, by_key: dict[str, SpanRecord]) -> None:
        root = self.root
        orphans = 0
        for record in by_key.values():
            if record is root:
                continue
            parent = by_key.get(record.parent_key) if record.parent_key else None
            if parent is None or parent is record:
                if record.parent_key is not None:
                    orphans += 1
                parent = root
            record.parent = parent
        if orphans:
            self.problems.append(f"{orphans} span(s) whose parent never arrived hang from the root")
        self._break_cycles(by_key)
        for record in by_key.values():
            if record is not root:
                record.parent.children.append(record)  # type: ignore[union-attr]
        # children are sorted by _number, as it reaches each span

    def _break_cycles(self, by_key: dict[str, SpanRecord]) -> None:
        """Walk up from every span once; a walk that meets itself found a cycle. ``pre`` is -1 for
        a span not visited yet (set by ``__init__``), -2 on the current walk, -3 once it reaches the root."""
        self.root.pre = -3
        for start in by_key.values():
            path = []
            node = start
            while node.pre == -1:
                node.pre = -2
                path.append(node)
                node = node.parent  # type: ignore[assignment]
            if node.pre == -2:  # ``node`` is on this walk: a cycle through it
                self.problems.append(
                    f"parent cycle through span {node.key} ({node.name!r}); it now hangs from the root"
                )
                node.parent = self.root
            for visited in path:
                visited.pre = -3

    def _number(self) -> None:
        stack: list[tuple[SpanRecord, bool]] = [(self.root, False)]
        while stack:
            record, done = stack.pop()
            if done:
                record.post = len(self.order)
                continue
            record.pre = len(self.order)
            self.order.append(record)
            stack.append((record, True))
            children = record.children
            if len(children) > 1:
                children.sort(key=START_ORDER)
            for child in reversed(children):
                stack.append((child, False))

    def top_level(self) -> list[SpanRecord]:
        """Spans that were the root of their trace (no parent id), in tree order."""
        return [r for r in self.order if r.parent_key is None and r is not self.root]

    def depth(self, record: SpanRecord) -> int:
        depth = 0
        while record.parent is not None:
            record = record.parent
            depth += 1
        return depth


def _outermost(roots: list[SpanRecord], by_key: dict[str, SpanRecord]) -> list[SpanRecord]:
    """The rollout spans not nested in another one through real parent links: each is a
    separate run of the agent under this rollout id (more than one means the id was reused)."""
    keys = {r.key for r in roots}
    outermost = []
    for root in roots:
        node, steps = root, 0
        nested = False
        while node.parent_key is not None and steps <= len(by_key):
            parent = by_key.get(node.parent_key)
            if parent is None:
                break
            if parent.key in keys:
                nested = True
                break
            node, steps = parent, steps + 1
        if not nested:
            outermost.append(root)
    return outermost
