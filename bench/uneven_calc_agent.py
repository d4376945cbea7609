"""The bundled calculator agent with uneven speed, for ``bench_async.py``.

One attempt in ``UNEVEN_SLOW_EVERY`` (default 4) sleeps ``UNEVEN_SLOW_S`` seconds (default 4)
before it starts, as an agent waiting on a slow tool or a long environment step would; the
others start at once. Which attempts are slow is random per attempt, so most groups hold a
straggler. Run by ``spanrl run --agent uneven_calc_agent:solve --python-path bench``.
"""

from __future__ import annotations

import os
import random
import time

from spanrl.examples.calc_agent.agent import solve as calc_solve

_rng = random.Random(os.getpid())


def solve(task: dict) -> str:
    """Wait like a slow environment one time in ``UNEVEN_SLOW_EVERY``, then solve ``task``."""
    if _rng.randrange(int(os.environ.get("UNEVEN_SLOW_EVERY", "4"))) == 0:
        time.sleep(float(os.environ.get("UNEVEN_SLOW_S", "4")))
    return calc_solve(task)
