"""bench/reliability.py in its short form (small numbers), as CI runs it: nothing lost, every
fault survived, no fuzz crash, no rollout lost between runners and the bridge. The overload part
is the suite's overload test: Python and Node.js agents at ~2x the receiver's measured capacity;
the bench also fails when the receiver never pushed back or its memory grew past a bound."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_short_form_loses_nothing_and_crashes_nothing(node):
    result = subprocess.run([sys.executable, str(REPO / "bench" / "reliability.py"), "--short"], cwd=REPO,
                            capture_output=True, text=True, timeout=280)
    output = result.stdout
    assert result.returncode == 0, output + result.stderr[-4000:]
    spans = re.search(r"^spans: sent (\d+) / acked (\d+) / stored (\d+) / lost (\d+)$", output, re.M)
    assert spans, output
    sent, acked, stored, lost = map(int, spans.groups())
    assert sent >= acked > 0 and stored > 0 and lost == 0
    injected, survived = map(int, re.search(r"^faults: injected (\d+) / survived (\d+)$", output, re.M).groups())
    assert injected == survived >= 4
    cases, server_errors, crashes = map(int, re.search(r"^fuzz: cases (\d+) / 5xx (\d+) / crashes (\d+)$", output,
                                                       re.M).groups())
    assert cases >= 100 and server_errors == 0 and crashes == 0
    assert re.search(r"^  bridge-slow-clients: cases \d+ / 5xx 0 / crashes 0$", output, re.M), output
    losses = re.findall(r"^runner<->bridge at (\d+) concurrent agents: rollouts lost (\d+) of (\d+)", output, re.M)
    assert [(int(a), int(lost), int(of)) for a, lost, of in losses] == [(1, 0, 1), (32, 0, 32), (256, 0, 256)]
    assert "node-grpc" in output and "node-http-json" in output  # the Node.js agents took part
