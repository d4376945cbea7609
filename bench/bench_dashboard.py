"""The dashboard's rollouts page on a store of 10^5 rollouts: how long one page takes to answer.

Builds a store of ``--rollouts`` assembled rollouts (the receiver's schema, each body a real
``Rollout`` of two calls with ``--prompt-tokens`` + ``--response-tokens`` ids, the trainer's
``trained_rollouts`` rows; ``tests/dashboard/synthetic_store.py``), serves ``spanrl dashboard``'s
app over HTTP on 127.0.0.1 (uvicorn in a thread) and times ``GET /rollouts`` with the filters a
user sets: the first page, a page deep in, by step, by task, by status, by agent, by reward,
sorted by reward. Each is the median of ``--repeats`` requests (after one warm-up), once the
dashboard's facet index (``dashboard/facet_index.py``) has caught up; its build time is printed
(``--no-index``: the same pages read from the rollout bodies). Goal: every page under 1 s.

    python bench/bench_dashboard.py                        # 100000 rollouts, store in a temp folder
    python bench/bench_dashboard.py --rollouts 20000 --store /tmp/big.db --keep
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "dashboard"))

from synthetic_store import build_store  # noqa: E402

from spanrl.dashboard.app import create_app  # noqa: E402
from spanrl.dashboard.settings import DashboardSettings  # noqa: E402


def serve(app) -> tuple[str, uvicorn.Server, threading.Thread]:
    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread


def queries(rollouts: int, per_step: int) -> dict[str, str]:
    last_step = (rollouts - 1) // per_step + 1
    return {
        "first page": "/rollouts",
        "page 1000 (offset 49950)": "/rollouts?page=1000",
        f"step {last_step // 2}": f"/rollouts?step={last_step // 2}",
        "task t3": "/rollouts?task=t3",
        "task t3, page 20": "/rollouts?task=t3&page=20",
        "status failed": "/rollouts?status=failed",
        "agent writer": "/rollouts?agent=writer",
        "agent nobody (scans all)": "/rollouts?agent=nobody",
        "reward >= 0.99": "/rollouts?reward_min=0.99",
        "sorted by reward": "/rollouts?sort=reward_desc",
        "sorted by reward, task t3": "/rollouts?sort=reward_desc&task=t3",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rollouts", type=int, default=100_000)
    parser.add_argument("--prompt-tokens", type=int, default=120)
    parser.add_argument("--response-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--store", default=None, help="where to build the store (default: a temp folder)")
    parser.add_argument("--keep", action="store_true", help="keep a store given with --store between runs")
    parser.add_argument("--no-index", action="store_true", help="time the pages without the facet index")
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="bench-dashboard-")
    store = Path(args.store or os.path.join(folder, "spanrl.db"))
    tasks_per_step, group_size = 16, 8
    if not (args.keep and store.exists()):
        store.unlink(missing_ok=True)
        started = time.perf_counter()
        build_store(store, args.rollouts, tasks_per_step, group_size, prompt_tokens=args.prompt_tokens,
                    response_tokens=args.response_tokens)
        print(f"built {args.rollouts} rollouts in {time.perf_counter() - started:.1f} s "
              f"({store.stat().st_size / 2**20:.0f} MiB)", flush=True)
    app = create_app(DashboardSettings(store=str(store), output_dir=folder))
    started = time.perf_counter()
    url, server, thread = serve(app)
    results = {}
    try:
        if not args.no_index:  # the facet index is built in the background from start-up on
            while app.state.indexer.index.indexed_sequence < args.rollouts:
                time.sleep(0.1)
            print(f"facet index of {args.rollouts} rollouts built in {time.perf_counter() - started:.1f} s",
                  flush=True)
        else:
            app.state.indexer.stop()
            app.state.indexer = None
        with httpx.Client(base_url=url, timeout=120) as client:
            for name, path in queries(args.rollouts, tasks_per_step * group_size).items():
                assert client.get(path).status_code == 200, path  # warm-up (and the page must work)
                times = []
                for _ in range(args.repeats):
                    started = time.perf_counter()
                    response = client.get(path)
                    times.append(time.perf_counter() - started)
                    assert response.status_code == 200
                results[name] = statistics.median(times)
                print(f"{name:32s} {results[name] * 1000:8.1f} ms  ({response.text.count('data-rollout=')} rows)",
                      flush=True)
    finally:
        server.should_exit = True
        thread.join(30)
    slowest = max(results, key=lambda k: results[k])
    print(json.dumps({"rollouts": args.rollouts, "median_s": results, "slowest": slowest,
                      "all_under_1s": all(v < 1.0 for v in results.values())}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
