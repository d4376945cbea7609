"""Share of slow tasks among the rollouts a run would train on, relaunch off vs on.

A task mix where half the tasks are slow: their agent runs longer and, as slow work does, hits
an infrastructure fault more often (the runner stops it at the timeout, or the runner dies).
Runners are threads that claim attempts over the real bridge HTTP API (``BridgeClient``, what
``spanrl run`` uses) from a real ``TaskDispatcher`` and report each attempt's outcome; a slow
attempt ends as ``timeout`` (or ``lost``-like ``runner error``) with probability ``--fault-p``,
every fast one ends ``ok``. Without relaunch the faulted attempts are left out, so slow tasks
are under-represented in what is trained; with ``relaunch_attempts`` they are re-run in their
group. Printed: the share of slow tasks among the ok (trainable) rollouts for both, and the ratio.
No model is trained: this measures what the dispatcher hands the trainer, not learning.

    python bench/bench_slow_tasks.py --rounds 20 --fault-p 0.3
"""

from __future__ import annotations

import argparse
import random
import threading
import time

from spanrl.bridge_protocol import TrainingFinished
from spanrl.runner.bridge_client import BridgeClient
from spanrl.trainer_bridge.bridge_api import BridgeAPI, PolicyInfo
from spanrl.trainer_bridge.task_dispatch import TaskDispatcher


def runner(url: str, stop: threading.Event, fault_p: float, slow_s: float, seed: int) -> None:
    """Claim and report attempts until ``stop``; slow tasks sleep ``slow_s`` and fault with ``fault_p``."""
    client = BridgeClient(url)
    rng = random.Random(seed)
    while not stop.is_set():
        try:
            attempt = client.claim()
        except TrainingFinished:
            return
        if attempt is None:
            time.sleep(0.005)
            continue
        slow = attempt.task.get("slow", False)
        time.sleep(slow_s if slow else slow_s / 10)
        if slow and rng.random() < fault_p:
            if rng.random() < 0.5:
                client.finish(attempt.rollout_id, "timeout", "agent did not finish in time")
            else:
                client.finish(attempt.rollout_id, "failed", "runner error: ConnectionError: upstream reset")
        else:
            client.finish(attempt.rollout_id, "ok")


def slow_share(relaunch_attempts: int, rounds: int, tasks_per_round: int, group_size: int, runners: int,
               fault_p: float, slow_s: float, seed: int) -> tuple[float, int, int]:
    """The share of slow tasks among ok rollouts over ``rounds`` rounds; (share, ok rollouts, relaunches)."""
    dispatcher = TaskDispatcher(rollout_timeout_s=60.0, relaunch_attempts=relaunch_attempts)
    api = BridgeAPI(dispatcher, PolicyInfo("http://127.0.0.1:9/v1", "policy"), lambda: 0, port=0).start()
    stop = threading.Event()
    threads = [threading.Thread(target=runner, args=(api.url, stop, fault_p, slow_s, seed + i), daemon=True)
               for i in range(runners)]
    for thread in threads:
        thread.start()
    rng = random.Random(seed)
    ok_slow = ok_total = relaunched = 0
    try:
        for step in range(rounds):
            tasks = [(f"t{step}-{i}", {"slow": rng.random() < 0.5}) for i in range(tasks_per_round)]
            dispatcher.open_round(step, tasks, group_size)
            outcomes = dispatcher.wait_round(poll_s=0.01, idle_after_s=0)
            relaunched += sum(dispatcher.relaunched().values())
            for attempt in dispatcher.round_attempts():
                if outcomes[attempt.rollout_id].status == "ok":
                    ok_total += 1
                    ok_slow += bool(attempt.task["slow"])
    finally:
        stop.set()
        dispatcher.close()
        for thread in threads:
            thread.join(5)
        api.stop()
    return (ok_slow / ok_total if ok_total else 0.0), ok_total, relaunched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--tasks-per-round", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--runners", type=int, default=8)
    parser.add_argument("--fault-p", type=float, default=0.3)
    parser.add_argument("--slow-s", type=float, default=0.05)
    parser.add_argument("--relaunch-attempts", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    common = (args.rounds, args.tasks_per_round, args.group_size, args.runners, args.fault_p, args.slow_s, args.seed)
    off, off_ok, _ = slow_share(0, *common)
    on, on_ok, relaunched = slow_share(args.relaunch_attempts, *common)
    print(f"slow tasks are ~50% of the attempts opened; slow attempts fault with p={args.fault_p}")
    print(f"relaunch off: slow share of trained rollouts {off:.3f} ({off_ok} ok rollouts)")
    print(f"relaunch on ({args.relaunch_attempts}): slow share {on:.3f} ({on_ok} ok rollouts, {relaunched} relaunches)")
    print(f"ratio on/off: {on / off if off else float('nan'):.3f}")


if __name__ == "__main__":
    main()
