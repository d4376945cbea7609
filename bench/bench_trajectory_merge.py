"""Trajectory merging: tokens per update and update time, merged rows vs one row per call.

A multi-turn tool-using agent's conversations are rendered with a real chat template (the
tokenizer of the model trained): every call's prompt is the chat so far with the generation
prompt, its response the assistant's reply tokens and the end-of-turn token, as an engine
returns them. The same samples are then trained once per transition and once merged
(``trajectory_merge.merge_trajectories``) by the torch trainer's ``grpo_step``.

Reported: prompt + response tokens per update both ways, the unique tokens (each rollout's
final sequence: what one pass over the conversations must read; goal: merged <= 1.1x), prefix
mismatches, and the update time of each (median of ``--repeats``) and their ratio.

    python bench/bench_trajectory_merge.py                  # tiny model, created here
    python bench/bench_trajectory_merge.py --model DIR --turns 8 --rollouts 16 --device cuda
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from typing import Any

from spanrl.trainer_bridge.backend import TrainingSample
from spanrl.trainer_bridge.torch_backend.trainer import TorchTrainer, TrainerConfig
from spanrl.trainer_bridge.trajectory_merge import merge_trajectories

SYSTEM = "You are a careful assistant. Use the calculator with CALC <expression>; finish with ANSWER <number>."


def conversation_samples(tokenizer: Any, rollout: int, turns: int, rng: random.Random) -> list[TrainingSample]:
    """The calls of one agent run of ``turns`` model calls (tool result between two calls)."""
    a, b = rng.randint(10, 999), rng.randint(10, 999)
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Work out {a} * {b} step by step, checking each partial product."}]
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    samples = []
    advantage = rng.uniform(-1.0, 1.0)
    for turn in range(turns):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = tokenizer.encode(text, add_special_tokens=False)  # as an engine tokenizes the rendered chat
        x, y = rng.randint(1, 99), rng.randint(1, 99)
        reply = f"CALC {x}*{y}" if turn < turns - 1 else f"ANSWER {a * b}"
        response = tokenizer.encode(reply, add_special_tokens=False) + [end_of_turn]
        samples.append(TrainingSample(prompt_token_ids=list(prompt), response_token_ids=response, advantage=advantage,
                                      group_id=f"task{rollout // 4}", rollout_id=f"r{rollout}", turn_index=turn))
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"RESULT {x * y}"}]
    return samples


def timed_update(model_dir: str, device: str, samples: list[TrainingSample], repeats: int) -> float:
    trainer = TorchTrainer(model_dir, TrainerConfig(device=device, learning_rate=1e-6, seed=0))
    trainer.grpo_step(samples)  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        trainer.grpo_step(samples)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="HF model directory (default: a tiny model created here)")
    parser.add_argument("--turns", type=int, default=6, help="model calls per rollout")
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="timed updates each way (median)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    model_dir = args.model
    if not model_dir:
        from spanrl.examples.calc_agent.demonstrations import write_demonstrations
        from spanrl.trainer_bridge.torch_backend.model_init import create_model_dir

        folder = tempfile.mkdtemp(prefix="bench-merge-")
        corpus = f"{folder}/demonstrations.jsonl"
        write_demonstrations(corpus, count=200, seed=0)
        model_dir = str(create_model_dir(f"{folder}/tiny", preset="tiny", corpus_files=[corpus], seed=0))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(0)
    samples = [s for r in range(args.rollouts) for s in conversation_samples(tokenizer, r, args.turns, rng)]
    rows, stats = merge_trajectories(samples)
    unique = sum(len(s.prompt_token_ids) + len(s.response_token_ids)
                 for s in samples if s.turn_index == args.turns - 1)
    per_transition_s = timed_update(model_dir, args.device, samples, args.repeats)
    merged_s = timed_update(model_dir, args.device, rows, args.repeats)
    print(json.dumps({
        "model": model_dir, "device": args.device, "rollouts": args.rollouts, "turns": args.turns,
        "rows_per_transition": len(samples), "rows_merged": len(rows), "prefix_mismatches": stats.prefix_mismatches,
        "unique_tokens": unique, "tokens_per_transition": stats.tokens_per_transition,
        "tokens_merged": stats.tokens_merged,
        "merged_over_unique": round(stats.tokens_merged / unique, 3),
        "per_transition_over_unique": round(stats.tokens_per_transition / unique, 3),
        "update_s_per_transition": round(per_transition_s, 4), "update_s_merged": round(merged_s, 4),
        "update_time_ratio_merged_over_per_transition": round(merged_s / per_transition_s, 3),
    }, indent=1))


if __name__ == "__main__":
    main()
