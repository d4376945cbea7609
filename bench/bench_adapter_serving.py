"""Serving per-agent LoRA adapters: engine throughput with 0, 1 and 3 adapters, same run.

One ``PolicyEngine`` (the embedded backend's, in this process, no HTTP) on a locally created
model; the adapters come from a ``TorchTrainer`` with ``adapters:`` (rank 8 on the attention
and MLP projections, spanrl's default targets), exported as the backend exports them. Three set-ups,
each a fresh engine on the same weights, measured in turn over ``--repeat`` rounds:

- ``base``:       no adapter attached (today's engine);
- ``1 adapter``:  one attached, every request asks for it;
- ``3 adapters``: three attached, requests take them in turn, so every batch mixes all three
  (the row-wise LoRA of ``engine/multi_lora.py``: one batched matmul pair per adapted layer).

Each set-up decodes ``--requests`` chat prompts in waves of ``--concurrency`` concurrent
requests, every row running exactly ``--max-tokens`` tokens (end-of-sequence ignored), and prints
generated tokens/s (median over rounds) and the ratio to ``base``. What it does not measure: the
HTTP front end (the same for all three) and accuracy (issue 26, item 5).

    python bench/bench_adapter_serving.py [--preset small --requests 64 --concurrency 16 --max-tokens 32 --repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from spanrl.trainer_bridge.torch_backend.config import TrainerConfig
from spanrl.trainer_bridge.torch_backend.engine.policy_engine import PolicyEngine, SamplingParams
from spanrl.trainer_bridge.torch_backend.model_init import create_model_dir
from spanrl.trainer_bridge.torch_backend.multi_adapter import adapter_weights
from spanrl.trainer_bridge.torch_backend.trainer import TorchTrainer

ADAPTER_NAMES = ("writer", "checker", "rewriter")
SETUPS = {"base": (), "1 adapter": ADAPTER_NAMES[:1], "3 adapters": ADAPTER_NAMES}


def exported_adapters(model_dir: str, rank: int) -> dict:
    """Every adapter's weights as the torch backend hands them to its engine."""
    adapters = {name: {"rank": rank, "alpha": 2 * rank} for name in ADAPTER_NAMES}
    trainer = TorchTrainer(model_dir, TrainerConfig(device="cpu", adapters=adapters))
    with torch.no_grad():  # LoRA's B starts at zero: give every adapter a real, distinct delta
        for name, parameter in trainer.model.named_parameters():
            if ".lora_B." in name:
                parameter.normal_(0.0, 0.02)
    return adapter_weights(trainer.model)


def tokens_per_second(model_dir: str, weights: dict, names: tuple[str, ...], requests: int,
                      concurrency: int, max_tokens: int) -> float:
    """One engine serving ``names`` (none: the base alone): generated tokens per second."""
    engine = PolicyEngine.from_pretrained(model_dir, device="cpu", dtype="float32", model_name="policy")
    if names:
        engine.attach_adapters({name: weights[name] for name in names}, {name: (name,) for name in names})
    engine.eos_ids = set()  # every row runs its max_tokens: the same work in every set-up
    engine.start()
    try:
        prompts = [engine.encode_chat([{"role": "user", "content": f"Question {n}: what is {n} + {n}?"}])
                   for n in range(requests)]

        def params(number: int) -> SamplingParams:
            adapter = names[number % len(names)] if names else None
            return SamplingParams(max_tokens=max_tokens, temperature=1.0, adapter=adapter)

        engine.generate(prompts[0], params(0), timeout=600)  # warm-up
        started = time.perf_counter()
        generated = 0
        for first in range(0, requests, concurrency):
            jobs = [engine.submit(prompts[n], params(n)) for n in range(first, min(first + concurrency, requests))]
            generated += sum(len(job.wait(600).choices[0].token_ids) for job in jobs)
        return generated / (time.perf_counter() - started)
    finally:
        engine.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", help="model size (spanrl model init's presets)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(create_model_dir(f"{tmp}/model", preset=args.preset, seed=0))
        weights = exported_adapters(model_dir, args.rank)
        results: dict[str, list[float]] = {label: [] for label in SETUPS}
        for round_number in range(args.repeat):
            for label, names in SETUPS.items():
                rate = tokens_per_second(model_dir, weights, names, args.requests, args.concurrency, args.max_tokens)
                results[label].append(rate)
                print(f"round {round_number + 1}: {label:<10} {rate:8.1f} tok/s", flush=True)
    base = statistics.median(results["base"])
    print(f"\npreset {args.preset}, rank {args.rank}, {args.requests} requests in waves of {args.concurrency}, "
          f"{args.max_tokens} tokens each; torch threads {torch.get_num_threads()}")
    for label, rates in results.items():
        median = statistics.median(rates)
        print(f"{label:<10} median {median:8.1f} tok/s (min {min(rates):.1f}, max {max(rates):.1f})  "
              f"ratio to base {median / base:.2f}x")


if __name__ == "__main__":
    main()
