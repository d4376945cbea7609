"""GPU smoke run of the verl backend: the calculator agent, a few steps, verl + vLLM on one GPU.

    python bench/verl_gpu_smoke.py [--steps 5] [--output-dir verl-smoke]

Runs ``spanrl demo --backend verl`` (warm start, receiver, runner with the calculator agent,
verl's FSDP2 actor and a vLLM replica on the GPU behind the gateway) and prints, per step, the
mean reward, the step time and its parts as the verl backend measured them (old log-probs,
update, weight sync) plus the time spent waiting for rollouts. Needs a CUDA GPU and the `verl`
extra (docs/verl.md); on a machine without one it says so and exits 1 (CPU mode has its own
test and `bench/bench_verl_step.py`).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--output-dir", default="verl-smoke")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("verl_gpu_smoke: no CUDA GPU visible here; this run needs one (see docs/verl.md)")
        return 1
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "spanrl", "demo", "--backend", "verl", "--device", "cuda",
         "--output-dir", args.output_dir, "--steps", str(args.steps), "--stop-at-reward", "2"],
        text=True,
    )
    if result.returncode != 0:
        print(f"verl_gpu_smoke: spanrl demo exited {result.returncode}; logs in {args.output_dir}")
        return result.returncode
    from spanrl.schema import metrics as keys

    rows = keys.read_metrics(os.path.join(args.output_dir, "run"))
    print(f"{'step':>4} {'reward':>7} {'step_s':>7} {'rollouts_s':>10} {'old_lp_s':>8} {'update_s':>8} {'sync_s':>7}")
    for row in rows:
        print(f"{row[keys.STEP]:>4} {row[keys.REWARD_MEAN]:>7.2f} {row[keys.STEP_SECONDS]:>7.1f} "
              f"{row.get(keys.ROLLOUT_SECONDS, float('nan')):>10.1f} {row.get('actor/old_log_prob_s', 0.0):>8.2f} "
              f"{row.get('actor/update_s', 0.0):>8.2f} {row.get('actor/weight_sync_s', 0.0):>7.2f}")
    print(f"{len(rows)} steps, {time.monotonic() - started:.0f} s in total (start-up and warm start included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
