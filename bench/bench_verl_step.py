"""The verl backend's step time and its parts vs verl's own calls on the same model and batch.

Run in the verl environment (``.ci/verl_env.sh``) on a quiet machine:

    .venv-verl/bin/python bench/bench_verl_step.py [--model DIR] [--samples 32] [--repeats 3]

Both sides run in one process on the same verl workers and vLLM replica (CPU mode without a
GPU):
- **verl's own step**: what verl's ``RayPPOTrainer`` does per update on a prepared batch —
  ``DataProto`` → ``to_tensordict`` → ``left_right_2_no_padding`` → ``compute_log_prob`` →
  ``update_actor`` → ``CheckpointEngineManager.update_weights``;
- **spanrl's step**: ``VerlBackend.update(samples)`` on the same samples: batch building from
  training samples, the gateway's pause/resume, the same verl calls, the version bump.

Prints each part (batch, old log-probs, update, weight sync) and the ratio spanrl / verl; the
goal is <= 1.2. Samples have no engine log-probs, so both recompute old log-probs.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from typing import Any


def make_samples(count: int, seed: int, vocab: int = 300) -> list:
    from spanrl.trainer_bridge.backend import TrainingSample

    rng = random.Random(seed)
    return [TrainingSample(prompt_token_ids=[rng.randrange(3, vocab) for _ in range(rng.randrange(24, 64))],
                           response_token_ids=[rng.randrange(3, vocab) for _ in range(rng.randrange(8, 32))],
                           advantage=rng.uniform(-1, 1), group_id=f"g{i // 4}", rollout_id=f"r{i}")
            for i in range(count)]


def verl_own_step(backend, samples) -> dict[str, float]:
    """verl's trainer calls, timed, on a batch built beforehand (not timed)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    from spanrl.trainer_bridge.verl_backend.backend import pad_to_multiple
    from spanrl.trainer_bridge.verl_backend.batch import build_verl_batch, to_worker_tensordict

    verl = backend.verl
    data = build_verl_batch(samples, pad_token_id=0, max_prompt_length=verl.max_prompt_length,
                            max_response_length=verl.max_response_length, temperature=verl.temperature).data
    data = pad_to_multiple(data, backend.workers.data_parallel_size)
    parts = {}
    mark = time.perf_counter()
    td = to_worker_tensordict(data, calculate_entropy=True, compute_loss=False)
    data.batch["old_log_probs"] = no_padding_2_padding(
        tu.get(backend.workers.actor.compute_log_prob(td), "log_probs"), td).float()
    parts["old_log_prob_s"] = time.perf_counter() - mark
    mark = time.perf_counter()
    size = len(data)
    td = to_worker_tensordict(data, calculate_entropy=False, global_batch_size=size, mini_batch_size=size, epochs=1,
                              seed=0, dataloader_kwargs={"shuffle": False}, compute_loss=True,
                              distillation_use_topk=False, distillation_only=False)
    backend.workers.actor.update_actor(td)
    parts["update_s"] = time.perf_counter() - mark
    mark = time.perf_counter()
    backend.workers.checkpoints.sleep_replicas()
    backend.workers.sync_weights(backend.policy_version)
    parts["weight_sync_s"] = time.perf_counter() - mark
    parts["total_s"] = sum(parts.values())
    return parts


def bench_model(model: str | None, workdir: str) -> str:
    """``model``, or a tiny one made by ``spanrl model init`` in ``workdir`` when None."""
    if model is not None:
        return model
    from spanrl.trainer_bridge.torch_backend.model_init import create_model_dir

    made = os.path.join(workdir, "model")
    create_model_dir(made, preset="tiny", seed=0)
    return made


def start_bench_backend(model: str, output_dir: str, adapters: dict | None = None, label: str = "verl") -> Any:
    """The verl backend on ``model`` (CPU mode without a GPU), started and timed aloud."""
    from spanrl.trainer_bridge.train_settings import TrainSettings
    from spanrl.trainer_bridge.verl_backend.backend import start_backend
    from spanrl.trainer_bridge.verl_backend.config import VerlConfig

    settings = TrainSettings(tasks="unused.jsonl", model=model, backend="verl", learning_rate=1e-5,
                             output_dir=output_dir, policy_port=0, checkpoint_every=0,
                             verl=VerlConfig(cpu_mode="auto"), adapters=adapters or {})
    started = time.perf_counter()
    backend = start_backend(settings.backend_run())
    print(f"{label}: verl workers + vLLM + gateway ready in {time.perf_counter() - started:.1f} s", flush=True)
    return backend


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: a tiny one from spanrl model init)")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    workdir = tempfile.mkdtemp(prefix="bench-verl-")
    backend = start_bench_backend(bench_model(args.model, workdir), os.path.join(workdir, "run"))
    try:
        ours, theirs = [], []
        for repeat in range(args.repeats + 1):  # the first round warms both paths up
            samples = make_samples(args.samples, seed=repeat)
            own = verl_own_step(backend, samples)
            stats = backend.update(samples)
            mine = {key: stats.details[key] for key in ("batch_s", "old_log_prob_s", "update_s", "weight_sync_s")}
            mine["total_s"] = stats.seconds
            if repeat:
                theirs.append(own)
                ours.append(mine)
        for name, rows in (("verl's own step", theirs), ("spanrl VerlBackend.update", ours)):
            parts = "  ".join(f"{key} {statistics.median(r[key] for r in rows):.3f}" for key in rows[0])
            print(f"{name:28s} {parts}")
        ratio = statistics.median(r["total_s"] for r in ours) / statistics.median(r["total_s"] for r in theirs)
        print(f"spanrl / verl step time: {ratio:.2f}x (goal <= 1.2); {args.samples} samples, "
              f"median of {args.repeats}")
    finally:
        backend.close()


if __name__ == "__main__":
    main()
