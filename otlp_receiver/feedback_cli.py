"""``spanrl inspect feedback``: late feedback in the store, its counters, and where each stands.

Called by ``inspect_cli.py`` (which registers the subcommand). Prints the counters (received,
joined, replayed, expired, evicted, rejected, clipped, duplicates, evaluations ignored, pending
now) and one row per feedback kept (pending: its target is not assembled yet; joined: to which rollout and call),
``--json`` for machines.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable


def show_feedback(args, store_path: str, table: Callable[[list[str], list[list]], str]) -> int:
    """Print the counters and the feedback of the store at ``store_path`` (``table``: inspect's)."""
    from spanrl.otlp_receiver.feedback_store import FeedbackStore

    with FeedbackStore(store_path) as book:
        counters = book.counters()
        rows = book.all(args.state)
    if args.json:
        print(json.dumps({"counters": counters, "feedback": [
            {"key": s.feedback.key, "state": s.state, "target_kind": s.feedback.target_kind,
             "target": s.feedback.target, "name": s.feedback.name, "value": s.feedback.value,
             "comment": s.feedback.comment, "source": s.feedback.source, "received_at": s.received_at,
             "rollout_id": s.rollout_id, "call_span_id": s.call_span_id} for s in rows]}, indent=2))
        return 0
    print("counted: " + ", ".join(f"{k} {v}" for k, v in counters.items()))
    now = time.time()
    print(table(["key", "state", "target", "name", "value", "source", "rollout", "call", "age"], [
        [s.feedback.key, s.state, f"{s.feedback.target_kind}={s.feedback.target}", s.feedback.name,
         f"{s.feedback.value:g}", s.feedback.source, s.rollout_id, s.call_span_id, f"{now - s.received_at:.0f} s"]
        for s in rows]))
    return 0
