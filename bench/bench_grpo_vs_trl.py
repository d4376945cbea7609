"""GRPO update throughput: spanrl's TorchTrainer versus TRL's GRPOTrainer, same run, same batch.

Both sides get the same locally created model, the same batch of (prompt, completion,
advantage) samples, fp32 on the same device, AdamW with the same learning rate, gradient
clipping at 1.0, no KL, one optimizer step per batch, token-mean loss (TRL ``bnpo``) and
the whole batch in one pass. Generation is not timed: only the policy update (forward,
loss, backward, optimizer step). TRL's side runs its own ``GRPOTrainer._compute_loss``.

TRL is not a spanrl dependency; install it beside the venv without touching torch:

    pip install --no-deps --target /tmp/trl_env datasets==5.2.0 dill==0.4.1 \\
        multiprocess==0.70.19 pandas==3.1.1 pyarrow==26.0.1 trl==1.16.0
    PYTHONPATH=/tmp/trl_env python bench/bench_grpo_vs_trl.py [--preset tiny --batch 64 --steps 20]

Prints update tokens/s for both and the ratio (goal: spanrl >= 2x TRL). The default batch is 64
distinct prompts, one completion each: there spanrl's packing (no padding: ~2x fewer positions)
and its last layer run on the scored positions only separate the two sides (docs/performance.md).
``--group-size 8`` gives GRPO's own batch, 8 completions a prompt, as TRL's ``num_generations``
(default 8) makes it, where spanrl also runs each group's prompt once.
"""

from __future__ import annotations

import argparse
import logging
import random
import tempfile
import time
import warnings
from pathlib import Path


def make_batch(tokenizer, count: int, seed: int, workload: str = "single", group_size: int = 1):
    """Chat prompts, random completions ending in <|im_end|>, +-1 advantages.

    ``single``: one-turn prompts of 20-130 tokens. ``agent``: the transitions of multi-turn
    agent rollouts — the k-th call of a rollout carries the k earlier turns in its prompt, so
    prompt lengths spread from ~20 to ~600 tokens. ``group_size`` samples in a row share their
    first user turn (a GRPO group: one task, several rollouts): with ``single`` the whole prompt.
    """
    rng = random.Random(seed)
    vocab = len(tokenizer)
    samples = []
    first_turn = ""
    for index in range(count):
        turns = 1 if workload == "single" else rng.randint(1, 8)
        if index % group_size == 0:  # (drawn here, group size 1 draws the batches it always drew)
            first_turn = " ".join(str(rng.randint(1, 999)) for _ in range(rng.randint(2, 30)))
        messages = []
        for turn in range(turns):
            words = first_turn if turn == 0 else " ".join(str(rng.randint(1, 999)) for _ in range(rng.randint(2, 30)))
            messages += [{"role": "user", "content": f"Add these: {words}"},
                         {"role": "assistant", "content": f"CALC {words[:40]}"}]
        text = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=False)
        prompt = tokenizer.encode(text, add_special_tokens=False)
        completion = [rng.randrange(3, vocab) for _ in range(rng.randint(4, 48))] + [tokenizer.eos_token_id]
        samples.append((prompt, completion, 1.0 if index % 2 else -1.0))
    return samples


def make_rollout_batch(tokenizer, count: int, seed: int, group_size: int = 1):
    """The calls of multi-turn rollouts, as an agent makes them: call k+1's prompt is call k's
    prompt, its completion and a tool result, so a rollout's later calls carry its earlier ones
    token for token; ``group_size`` rollouts in a row share their first user turn. 1-8 calls a
    rollout, ``count`` calls in all."""
    rng = random.Random(seed)
    vocab = len(tokenizer)
    samples = []
    first_turn = ""
    rollout = 0
    while len(samples) < count:
        if rollout % group_size == 0:
            first_turn = " ".join(str(rng.randint(1, 999)) for _ in range(rng.randint(2, 30)))
        text = tokenizer.apply_chat_template([{"role": "user", "content": f"Add these: {first_turn}"}],
                                             add_generation_prompt=True, tokenize=False)
        prompt = tokenizer.encode(text, add_special_tokens=False)
        advantage = 1.0 if rollout % 2 else -1.0
        for _ in range(min(rng.randint(1, 8), count - len(samples))):
            completion = [rng.randrange(3, vocab) for _ in range(rng.randint(4, 48))] + [tokenizer.eos_token_id]
            samples.append((prompt, completion, advantage))
            result = " ".join(str(rng.randint(1, 999)) for _ in range(rng.randint(1, 10)))
            tool_turn = f"\n<|im_start|>tool\n{result}<|im_end|>\n<|im_start|>assistant\n"
            prompt = prompt + completion + tokenizer.encode(tool_turn, add_special_tokens=False)
        rollout += 1
    return samples


def spanrl_side(model_dir, batches, lr, device="cpu", share_prefixes=True):
    from spanrl.trainer_bridge.backend import TrainingSample
    from spanrl.trainer_bridge.torch_backend.config import TrainerConfig
    from spanrl.trainer_bridge.torch_backend.trainer import TorchTrainer

    # default micro-batching: length-sorted, 8192 tokens
    trainer = TorchTrainer(model_dir, TrainerConfig(learning_rate=lr, device=device, grad_clip=1.0,
                                                    loss_agg_mode="token-mean", share_prefixes=share_prefixes))

    def step(batch):
        trainer.grpo_step([TrainingSample(p, c, a) for p, c, a in batch])
    return step


def trl_side(model_dir, batches, lr, out_dir):
    import pyarrow
    import torch
    from datasets import Dataset
    from datasets.table import InMemoryTable
    from trl import GRPOConfig, GRPOTrainer

    batch_size = len(batches[0])
    # never read (no generation is timed); built without datasets' dill fingerprinting, which
    # fails on this Python/pyarrow combination
    prompts = Dataset(InMemoryTable(pyarrow.table({"prompt": ["hi"] * batch_size})), fingerprint="bench")
    config = GRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=batch_size, num_generations=2,
        max_completion_length=64, learning_rate=lr, max_grad_norm=1.0, beta=0.0, loss_type="bnpo",
        epsilon=0.2, use_cpu=True, bf16=False, fp16=False, report_to=[], logging_steps=1_000_000,
        gradient_accumulation_steps=1, num_iterations=1, weight_decay=0.0,
    )
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                          args=config, train_dataset=prompts)
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(), which we bypass
    model, pad = trainer.model, trainer.processing_class.pad_token_id

    def tensors(batch):
        prompt_width = max(len(p) for p, _, _ in batch)
        completion_width = max(len(c) for _, c, _ in batch)
        prompt_ids = torch.full((len(batch), prompt_width), pad)
        prompt_mask = torch.zeros_like(prompt_ids)
        completion_ids = torch.full((len(batch), completion_width), pad)
        completion_mask = torch.zeros_like(completion_ids)
        for row, (p, c, _) in enumerate(batch):  # TRL's layout: prompts left-padded, completions right
            prompt_ids[row, prompt_width - len(p):] = torch.tensor(p)
            prompt_mask[row, prompt_width - len(p):] = 1
            completion_ids[row, : len(c)] = torch.tensor(c)
            completion_mask[row, : len(c)] = 1
        return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
                "completion_mask": completion_mask,
                "advantages": torch.tensor([a for _, _, a in batch], dtype=torch.float32),
                "num_items_in_batch": completion_mask.sum()}

    def step(batch):
        model.train()
        loss = trainer.compute_loss(model, tensors(batch))
        trainer.accelerator.backward(loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
    return step


def timed(step, batches) -> float:
    step(batches[0])  # warm-up, not timed
    started = time.perf_counter()
    for batch in batches[1:]:
        step(batch)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--model-dir", default=None, help="use this HF model instead of a fresh preset")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--workload", choices=["single", "agent", "rollouts"], default="single",
                        help="single-turn prompts; multi-turn agent transitions drawn one by one (prompts up to "
                             "~600 tokens); or the calls of whole rollouts (a later call carries the earlier ones)")
    parser.add_argument("--group-size", type=int, default=1,
                        help="samples in a row that share their first user turn (GRPO's group; 1: none share)")
    parser.add_argument("--share-prefixes", choices=["on", "off"], default="on",
                        help="spanrl packs a beginning shared by several samples once (the default) or not")
    parser.add_argument("--steps", type=int, default=20,
                        help="timed steps per side (after one warm-up); with 5 the ratio moves by +-15 %% between runs")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--device", default="cpu",
                        help="cpu or cuda for spanrl's side (TRL picks the GPU itself when there is one)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads for both sides (1 is steadier on a busy machine)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore")
    import torch
    from transformers import AutoTokenizer

    from spanrl.trainer_bridge.torch_backend.model_init import create_model_dir

    if args.threads:
        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as scratch:
        model_dir = Path(args.model_dir) if args.model_dir else create_model_dir(
            Path(scratch) / args.preset, preset=args.preset, seed=0)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        batches = [make_rollout_batch(tokenizer, args.batch, seed, args.group_size) if args.workload == "rollouts"
                   else make_batch(tokenizer, args.batch, seed, args.workload, args.group_size)
                   for seed in range(args.steps + 1)]
        tokens = sum(len(p) + len(c) for batch in batches[1:] for p, c, _ in batch)
        print(f"model {model_dir.name} ({args.preset}), {args.workload} workload, batch {args.batch}, "
              f"groups of {args.group_size}, spanrl's shared prefixes {args.share_prefixes}, "
              f"{args.steps} timed steps, "
              f"{tokens} tokens, torch threads {torch.get_num_threads()}")
        ours = timed(spanrl_side(model_dir, batches, args.lr, args.device, args.share_prefixes == "on"), batches)
        theirs = timed(trl_side(model_dir, batches, args.lr, str(Path(scratch) / "trl")), batches)
    print(f"spanrl TorchTrainer.grpo_step : {tokens / ours:10.0f} tokens/s ({ours / args.steps * 1000:.0f} ms/step)")
    print(f"TRL GRPOTrainer update        : {tokens / theirs:10.0f} tokens/s "
          f"({theirs / args.steps * 1000:.0f} ms/step)")
    print(f"ratio spanrl / TRL: {theirs / ours:.2f}x (goal >= 2x)")


if __name__ == "__main__":
    main()
