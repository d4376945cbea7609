"""Overload (short form): Python and Node.js agents export at about twice the receiver's measured
capacity; the receiver pushes back (retryable refusals), every acknowledged span is stored and
nothing else, every span an agent ended is accounted for, and the receiver's memory stays bounded.
``bench/reliability.py`` runs the same at length."""

from __future__ import annotations

import reliability_overload  # tests/reliability/ is on sys.path (conftest.py)

MIB = 1024 * 1024


def test_twice_the_capacity_loses_nothing_acknowledged(receiver_process, node):
    # a small pending limit, so that pushing back shows within a few seconds of load
    receiver = receiver_process("--max-pending-mb", "0.05").start()
    report = reliability_overload.run_overload(receiver, seconds=1.5, python_agents=2, node_agents=2, node=node,
                                               capacity_s=1.0)
    print("\n".join(report.lines()))
    assert report.sent > 0 and report.acked > 0
    assert report.lost == 0  # every acknowledged span is in the store, or was rejected in the answer
    # stored: what was acknowledged (less what the answer rejected), plus any span whose answer the
    # client never got (it counted a failure); nothing else
    assert report.stored == report.acked - report.rejected_late + report.stored_failed
    assert report.acked + report.failed + report.dropped_by_clients == report.sent
    assert min(a.dropped for a in report.agents) >= 0
    assert report.overloaded_requests > 0, "the receiver never pushed back: the load was not above capacity"
    assert report.rss_peak_bytes - report.rss_start_bytes < 200 * MIB
