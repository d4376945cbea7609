"""Faults, each injected once (``reliability_faults.py`` has the scenarios and their checks;
``bench/reliability.py`` repeats and counts them): kill -9 of the receiver mid-stream, the
store's disk full (RLIMIT_FSIZE on the receiver: see that module), the receiver down for a while
under an agent, the bridge restarted under running runners. (kill -9 of the receiver with the
rollout open: tests/otlp_receiver/test_receiver_crash.py; a trainer killed mid-step:
test_trainer_kill.py.)"""

from __future__ import annotations

import reliability_faults as faults  # tests/reliability/ is on sys.path (conftest.py)


def test_sigkill_of_the_receiver_mid_stream_loses_no_acknowledged_span(tmp_path):
    assert faults.receiver_sigkill_midstream(tmp_path) >= 30


def test_disk_full_is_retryable_loses_nothing_acknowledged_and_recovers(tmp_path):
    assert faults.disk_full(tmp_path) >= 2


def test_receiver_down_for_a_while_agents_finish_and_spans_arrive(tmp_path):
    assert faults.receiver_down_for_a_while(tmp_path) == 5


def test_the_bridge_restarted_under_running_runners_loses_no_rollout():
    result = faults.runner_bridge_round(16, restart_bridge=True)
    assert result.client_errors == []
    assert result.lost == 0 and result.reported_ok == result.attempts == 16
    assert result.retries > 0  # the reports did meet the bridge down, and were retried
