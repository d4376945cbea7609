"""What per-agent adapters cost with the verl backend: one update of one shared model vs updates of
one and of two adapters (each trained in turn in verl's LoRA actor, ``verl_backend/adapters.py``).

Run in the verl environment (``.ci/verl_env.sh``) on a quiet machine:

    .venv-verl/bin/python bench/bench_verl_adapters.py [--model DIR] [--samples 32] [--repeats 3]

Two backends, one after the other, on the same model and the same samples (CPU mode without a GPU):
- **one model**: ``backend: verl`` as default: every weight trained, then synced into vLLM;
- **adapters**: ``adapters: {writer, rewriter}`` (rank 8 on q/k/v/o): an update of the writer's
  samples only (one adapter), then of the writer's and the rewriter's (half each: two adapters,
  so two state swaps).

Prints the median update time of each (over ``--repeats`` rounds after one warm-up round) and the
adapters' parts per adapter: loading its state into the actor, verl's update, saving its state and
writing it in peft's format, vLLM loading it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from bench_verl_step import bench_model, make_samples, start_bench_backend  # noqa: E402

ADAPTERS = {"writer": {"agents": ["writer"]}, "rewriter": {"agents": ["rewriter"]}}
PARTS = ("load_state_s", "update_s", "save_state_s", "publish_s")


def as_agent(samples: list, agent: str) -> list:
    return [dataclasses.replace(s, agent_name=agent, group_id=f"{agent}-{s.group_id}") for s in samples]


def run_arm(model: str, workdir: str, adapters: dict, samples: int, repeats: int) -> dict[str, list]:
    """Each update kind's seconds and, with adapters, each adapter's parts, per round after the first."""
    backend = start_bench_backend(model, os.path.join(workdir, "adapters" if adapters else "shared"), adapters,
                                  "adapters" if adapters else "one model")
    rows: dict[str, list] = {}
    try:
        for repeat in range(repeats + 1):  # the first round warms every path up
            batch = make_samples(samples, seed=repeat)
            kinds = {"update": as_agent(batch, "writer")}
            if adapters:
                half = len(batch) // 2
                kinds = {"1 adapter": kinds["update"],
                         "2 adapters": as_agent(batch[:half], "writer") + as_agent(batch[half:], "rewriter")}
            for kind, kind_samples in kinds.items():
                stats = backend.update(kind_samples)
                if repeat:
                    rows.setdefault(kind, []).append(stats.seconds)
                    for key, value in stats.details.items():
                        if key.startswith("adapter/") and key.rsplit("/", 1)[1] in PARTS:
                            rows.setdefault(f"{kind}: {key}", []).append(value)
    finally:
        backend.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: a tiny one from spanrl model init)")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    workdir = tempfile.mkdtemp(prefix="bench-verl-adapters-")
    model = bench_model(args.model, workdir)
    shared = run_arm(model, workdir, {}, args.samples, args.repeats)
    adapters = run_arm(model, workdir, ADAPTERS, args.samples, args.repeats)
    baseline = statistics.median(shared["update"])
    print(f"\n{args.samples} samples an update, median (min-max) of {args.repeats} rounds")
    print(f"{'one model: update + weight sync':56s} {baseline:7.3f} s ({min(shared['update']):.3f}-"
          f"{max(shared['update']):.3f})  1.00x")
    for key, values in adapters.items():
        median = statistics.median(values)
        ratio = f"  {median / baseline:.2f}x" if ":" not in key else ""
        print(f"{'adapters, ' + key:56s} {median:7.3f} s ({min(values):.3f}-{max(values):.3f}){ratio}")


if __name__ == "__main__":
    main()
