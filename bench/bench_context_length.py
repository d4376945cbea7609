"""What a long prompt costs the embedded engine: time and memory by prompt length, per preset.

``spanrl model init`` presets take 4,096 tokens of context. The context itself costs nothing
(RoPE positions are computed, not stored; the weights do not grow); a prompt that uses it does:
the prefill pass's attention and the KV cache grow with its length, each decode step reads the
whole cache. For each preset and prompt length this creates a model, runs one request
(prompt + ``--max-tokens``) a few times on the engine alone and prints the prefill time, the
time per decoded token, and the process's peak resident memory (``ru_maxrss``) growth over the
run at that length. One process per measurement, so peaks do not carry over.

``--rows N`` decodes N rows at once (one request with ``n=N``: the engine's batch, as concurrent
agents fill it); ``--compare-cache`` measures each length again with transformers' own
``DynamicLayer`` cache, which copies the whole cache at every decode step, instead of the
engine's growing layers (``engine/growing_cache.py``), and prints the ratio of decode times.

    python bench/bench_context_length.py [--presets tiny small --lengths 256 1024 2048 4000 --max-tokens 32]
    python bench/bench_context_length.py --presets small --lengths 256 1024 --rows 16 --compare-cache
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def measure(model_dir: str, length: int, max_tokens: int, repeat: int, rows: int = 1,
            dynamic_cache: bool = False) -> dict:
    """In this process: prefill seconds, seconds per decode step (``rows`` rows, one token each),
    peak RSS growth (MiB); the fastest of ``repeat`` requests."""
    import torch

    from spanrl.trainer_bridge.torch_backend.engine import kv_cache
    from spanrl.trainer_bridge.torch_backend.engine.policy_engine import PolicyEngine, SamplingParams

    if dynamic_cache:  # the baseline: leave transformers' DynamicLayers in place
        kv_cache.growing_layers = lambda cache: None
    torch.set_num_threads(1)
    engine = PolicyEngine.from_pretrained(model_dir, device="cpu", dtype="float32").start()
    engine.eos_ids = set()  # decode exactly max_tokens
    try:
        prompt = [3 + (i % 200) for i in range(length)]
        engine.generate(prompt[:16], SamplingParams(max_tokens=2))  # warm-up
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        prefill, per_token = [], []
        for _ in range(repeat):
            first_prefill, step = _one_request(engine, prompt, SamplingParams(max_tokens=max_tokens, n=rows))
            prefill.append(first_prefill)
            per_token.append(step)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    finally:
        engine.stop()
    return {"prefill_s": min(prefill), "decode_s_per_token": min(per_token), "peak_growth_mib": (peak - base) / 1024}


def _one_request(engine, prompt: list[int], params) -> tuple[float, float]:
    """Seconds to the first token (the prefill) and per decode step after it (choice 0's token
    events, which every step of the batch produces)."""
    times: list[float] = []

    def on_token(event) -> None:
        if event.choice == 0:
            times.append(time.perf_counter())

    started = time.perf_counter()
    engine.submit(prompt, params, on_token=on_token).wait(600)
    return times[0] - started, (times[-1] - times[0]) / (len(times) - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[256, 1024, 2048, 4000])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--rows", type=int, default=1, help="rows decoded together (one request, n=ROWS)")
    parser.add_argument("--compare-cache", action="store_true",
                        help="also measure with transformers' DynamicLayer cache and print the ratio")
    parser.add_argument("--one", nargs=2, metavar=("MODEL_DIR", "LENGTH"), help=argparse.SUPPRESS)
    parser.add_argument("--dynamic-cache", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]), args.max_tokens, args.repeat, args.rows,
                                 args.dynamic_cache)))
        return
    with tempfile.TemporaryDirectory() as scratch:
        for preset in args.presets:
            model_dir = str(Path(scratch) / preset)
            subprocess.run([sys.executable, "-m", "spanrl", "--log-level", "WARNING", "model", "init", model_dir,
                            "--preset", preset], check=True, stdout=subprocess.DEVNULL)
            for length in args.lengths:
                row = _measure_in_child(model_dir, length, args, dynamic_cache=False)
                line = (f"{preset:6s} prompt {length:5d} tokens, {args.rows} row(s): prefill "
                        f"{1000 * row['prefill_s']:7.1f} ms, decode {1000 * row['decode_s_per_token']:6.2f} ms/step, "
                        f"peak memory +{row['peak_growth_mib']:6.1f} MiB")
                if args.compare_cache:
                    baseline = _measure_in_child(model_dir, length, args, dynamic_cache=True)
                    line += (f"; DynamicLayer cache {1000 * baseline['decode_s_per_token']:6.2f} ms/step "
                             f"(x{baseline['decode_s_per_token'] / row['decode_s_per_token']:.2f} slower)")
                print(line, flush=True)


def _measure_in_child(model_dir: str, length: int, args: argparse.Namespace, dynamic_cache: bool) -> dict:
    command = [sys.executable, __file__, "--one", model_dir, str(length), "--max-tokens", str(args.max_tokens),
               "--repeat", str(args.repeat), "--rows", str(args.rows)]
    done = subprocess.run(command + (["--dynamic-cache"] if dynamic_cache else []),
                          check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
