"""The embedded torch backend's trainer: GRPO updates and SFT warm start on any HF causal LM.

Driven by the bridge loop (``spanrl train`` with backend ``torch``), by the demo and by tests.
``TorchTrainer(model_dir, TrainerConfig(...))`` loads the model (CPU or CUDA, optionally
LoRA through peft), and offers:

- ``grpo_step(samples)``: one policy update on ``TrainingSample``s whose advantages the
  caller computed (``grpo.group_advantages``): dual-clip PPO loss, verl's loss aggregation,
  optional KL to a frozen reference, AdamW with gradient clipping, micro-batches cut by a
  token budget whose losses add up to the whole batch's loss.
- ``sft_steps(batches)`` / ``sft_from_jsonl(path)``: cross-entropy on assistant tokens of
  chat examples (``{"messages": [...]}``), the ``<|im_end|>`` that closes each included.
- ``save_checkpoint(dir)`` / ``TorchTrainer.resume(dir)``: HF-format weights
  (``from_pretrained``-loadable) plus optimizer state, step and policy version.
- ``policy_state_dict()``: weights for ``PolicyEngine.swap_weights`` (LoRA merged).

Each ``grpo_step`` and each ``sft_steps`` call produces a new policy: ``policy_version`` +1.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import random
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from spanrl.trainer_bridge import grpo
from spanrl.trainer_bridge.torch_backend.config import TrainerConfig
from spanrl.trainer_bridge.torch_backend.devices import resolve_device

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.pt"
ADAPTER_DIR = "adapter"
CHECKPOINT_PREFIX = "step-"


@dataclass(frozen=True)
class TrainingSample:
    """One transition to train on: the call's prompt ids, its response ids and its advantage.

    ``old_logprobs``: the engine's logprob of each response token when it sampled them
    (``None``: recomputed with the current weights before the update).
    """

    prompt_token_ids: Sequence[int]
    response_token_ids: Sequence[int]
    advantage: float
    old_logprobs: Sequence[float] | None = None


@dataclass
class _Batch:
    """A padded micro-batch: ``input_ids [B, L]`` and response positions ``[B, T]``."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    gather_index: torch.Tensor      # [B, T] position in the next-token logprob row
    targets: torch.Tensor           # [B, T] response token ids
    response_mask: torch.Tensor     # [B, T] float
    rows: list[int] = field(default_factory=list)  # indices into the caller's list


class TorchTrainer:
    """GRPO + SFT on a Hugging Face causal LM (see the module docstring)."""

    def __init__(self, model_dir: str | Path, config: TrainerConfig | None = None,
                 _adapter_dir: str | Path | None = None, _reference_dir: str | Path | None = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.config = config or TrainerConfig()
        self.model_dir = str(model_dir)
        self.device = resolve_device(self.config.device)
        torch.manual_seed(self.config.seed)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        model.to(self.device)
        if self.config.gradient_checkpointing:
            model.gradient_checkpointing_enable()
            model.config.use_cache = False
        self.reference = None
        if self.config.kl_coef > 0 and not self.config.lora_rank:
            # KL is to the initial policy: a resumed full fine-tune (``_reference_dir``: the
            # base model) must not take the checkpoint it starts from as its reference.
            if _reference_dir is not None:
                if not (Path(_reference_dir) / "config.json").is_file():
                    raise FileNotFoundError(
                        f"the KL reference (the base model the checkpoint was trained from) is not "
                        f"a model directory: {str(_reference_dir)!r}")
                reference = AutoModelForCausalLM.from_pretrained(str(_reference_dir), dtype=torch.float32)
                self.reference = reference.to(self.device).eval().requires_grad_(False)
            else:
                self.reference = copy.deepcopy(model).eval().requires_grad_(False)
        if self.config.lora_rank:
            from peft import LoraConfig, PeftModel, get_peft_model

            if _adapter_dir is not None:
                model = PeftModel.from_pretrained(model, str(_adapter_dir), is_trainable=True)
            else:
                model = get_peft_model(model, LoraConfig(
                    r=self.config.lora_rank, lora_alpha=self.config.lora_alpha,
                    lora_dropout=self.config.lora_dropout,
                    target_modules=list(self.config.lora_target_modules), task_type="CAUSAL_LM"))
        self.model = model
        self.model.train()
        self.step = 0
        self.policy_version = 0
        self.optimizer = self._new_optimizer(self.config.learning_rate)
        self._sft_optimizer = None
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        logger.info("torch trainer: %s on %s, %d trainable parameters, config %s",
                    self.model_dir, self.device, trainable, asdict(self.config))

    # ------------------------------------------------------------------ basics

    def _trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def _new_optimizer(self, lr: float) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self._trainable(), lr=lr, betas=self.config.betas,
                                 weight_decay=self.config.weight_decay,
                                 foreach=self.device.type == "cuda")

    def _autocast(self):
        if self.config.autocast_dtype:
            from spanrl.trainer_bridge.torch_backend.devices import resolve_dtype

            return torch.autocast(self.device.type, dtype=resolve_dtype(self.config.autocast_dtype, self.device))
        return torch.autocast(self.device.type, enabled=False)

    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        """The current policy's weights with plain HF keys (LoRA merged), for ``swap_weights``."""
        if not self.config.lora_rank:
            return self.model.state_dict()
        self.model.merge_adapter()
        try:
            merged = {}
            for key, value in self.model.state_dict().items():
                if "lora_" in key:
                    continue
                plain = key.replace("base_model.model.", "", 1).replace(".base_layer", "")
                merged[plain] = value.detach().clone()
        finally:
            self.model.unmerge_adapter()
        return merged

    # ------------------------------------------------------------------ batching

    def _micro_batches(self, sequences: list[tuple[list[int], int]]) -> list[list[int]]:
        """Indices grouped so ``rows * longest`` stays within ``micro_batch_tokens``."""
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i][0]))
        groups: list[list[int]] = []
        current: list[int] = []
        longest = 0
        for index in order:
            length = len(sequences[index][0])
            if current and (len(current) + 1) * max(longest, length) > self.config.micro_batch_tokens:
                groups.append(current)
                current, longest = [], 0
            current.append(index)
            longest = max(longest, length)
        if current:
            groups.append(current)
        return groups

    def _pad(self, sequences: list[tuple[list[int], list[int]]], rows: list[int]) -> _Batch:
        """Right-padded ``ids`` with the positions of the loss tokens (``label_mask`` 1)."""
        chosen = [sequences[i] for i in rows]
        width = max(len(ids) for ids, _ in chosen)
        targets_width = max(max(1, sum(mask)) for _, mask in chosen)
        batch = len(chosen)
        input_ids = torch.full((batch, width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((batch, width), dtype=torch.long)
        gather_index = torch.zeros((batch, targets_width), dtype=torch.long)
        targets = torch.zeros((batch, targets_width), dtype=torch.long)
        response_mask = torch.zeros((batch, targets_width), dtype=torch.float32)
        for b, (ids, mask) in enumerate(chosen):
            input_ids[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            attention[b, : len(ids)] = 1
            positions = [t for t in range(1, len(ids)) if mask[t]]
            if positions:
                gather_index[b, : len(positions)] = torch.tensor(positions) - 1
                targets[b, : len(positions)] = torch.tensor([ids[t] for t in positions])
                response_mask[b, : len(positions)] = 1.0
        return _Batch(input_ids.to(self.device), attention.to(self.device), gather_index.to(self.device),
                      targets.to(self.device), response_mask.to(self.device), rows)

    def _token_logprobs(self, model, batch: _Batch) -> torch.Tensor:
        """``log p(target | prefix)`` of every loss token, ``[B, T]`` float32.

        The LM head runs only on the positions that are scored (not on prompt tokens): the
        decoder's hidden states are gathered first, which saves most of the head's work and
        memory for large vocabularies.
        """
        rows = torch.arange(batch.input_ids.shape[0], device=batch.input_ids.device).unsqueeze(1)
        decoder, head = _decoder_and_head(model)
        with self._autocast():
            if decoder is None:
                logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
                picked = logits[rows, batch.gather_index]
            else:
                hidden = decoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
                picked = head(hidden[rows, batch.gather_index])  # [B, T, V]
        return grpo_logprobs(picked, batch.targets)

    @staticmethod
    def _sample_sequences(samples: Sequence[TrainingSample]) -> list[tuple[list[int], list[int]]]:
        sequences = []
        for number, sample in enumerate(samples):
            prompt, response = list(sample.prompt_token_ids), list(sample.response_token_ids)
            if not prompt or not response:
                raise ValueError(f"sample {number} has an empty prompt or response")
            sequences.append((prompt + response, [0] * len(prompt) + [1] * len(response)))
        return sequences

    def sequence_logprobs(self, samples: Sequence[TrainingSample]) -> list[list[float]]:
        """Current policy's logprob of each response token of each sample (no gradient)."""
        sequences = self._sample_sequences(samples)
        out: list[list[float]] = [[] for _ in samples]
        with torch.no_grad():
            for rows in self._micro_batches(sequences):
                batch = self._pad(sequences, rows)
                values = self._token_logprobs(self.model, batch)
                for b, i in enumerate(rows):
                    out[i] = values[b, : len(samples[i].response_token_ids)].float().tolist()
        return out

    # ------------------------------------------------------------------ GRPO

    def grpo_step(self, samples: Sequence[TrainingSample]) -> dict[str, float]:
        """One GRPO/PPO update on ``samples``; returns float statistics (loss, kl, clipfrac, ...).

        Old logprobs come from each sample when given (the engine's), else are recomputed
        with the current weights. The loss of the whole batch is aggregated as
        ``config.loss_agg_mode`` says, micro-batch by micro-batch.
        """
        if not samples:
            raise ValueError("grpo_step needs at least one sample")
        started = time.perf_counter()
        config = self.config
        sequences = self._sample_sequences(samples)
        groups = self._micro_batches(sequences)
        batches = [self._pad(sequences, rows) for rows in groups]
        total_tokens = float(sum(len(s.response_token_ids) for s in samples))
        total_sequences = float(len(samples))
        scale_factor = config.loss_scale_factor or max(len(s.response_token_ids) for s in samples)
        agg_kwargs = {"batch_num_tokens": total_tokens, "global_batch_size": total_sequences,
                      "loss_scale_factor": scale_factor}

        # Old logprobs: the engine's when given. Missing ones are the current policy's; with a
        # single epoch the weights do not change before the loss is taken, so they are the
        # detached logprobs of the training forward pass itself (no extra forward pass).
        given_old = self._usable_old_logprobs(samples)
        old, missing_rows, ref, advantages = [], [], [], []
        recompute_up_front = config.ppo_epochs > 1
        self.model.eval()
        with torch.no_grad():
            for batch in batches:
                lengths = [len(samples[i].response_token_ids) for i in batch.rows]
                missing = torch.tensor([given_old[i] is None for i in batch.rows],
                                       device=self.device).unsqueeze(1)
                recomputed = (self._token_logprobs(self.model, batch)
                              if recompute_up_front and bool(missing.any()) else None)
                old_values = torch.zeros_like(batch.response_mask)
                adv = torch.zeros_like(batch.response_mask)
                for b, i in enumerate(batch.rows):
                    given = given_old[i]
                    if given is not None:
                        old_values[b, : lengths[b]] = torch.tensor(list(given), dtype=torch.float32)
                    elif recomputed is not None:
                        old_values[b] = recomputed[b].float()
                    adv[b, : lengths[b]] = float(samples[i].advantage)
                old.append(old_values * batch.response_mask)
                missing_rows.append(missing if recomputed is None else torch.zeros_like(missing))
                advantages.append(adv)
                if config.kl_coef > 0:
                    ref.append(self._reference_logprobs(batch))
        self.model.train()

        totals = {"pg_loss": 0.0, "kl_loss": 0.0, "pg_clipfrac": 0.0, "ppo_kl": 0.0, "pg_clipfrac_lower": 0.0}
        grad_norm = 0.0
        for _epoch in range(config.ppo_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for number, batch in enumerate(batches):
                logprobs = self._token_logprobs(self.model, batch)
                old_logprobs = torch.where(missing_rows[number], logprobs.detach() * batch.response_mask,
                                           old[number])
                pg_loss, metrics = grpo.policy_loss_dual_clip(
                    old_logprobs, logprobs, advantages[number], batch.response_mask,
                    clip_ratio_low=config.clip_ratio_low, clip_ratio_high=config.clip_ratio_high,
                    clip_ratio_c=config.clip_ratio_c, loss_agg_mode=config.loss_agg_mode, **agg_kwargs)
                loss = pg_loss
                if config.kl_coef > 0:
                    kl = grpo.kl_penalty(logprobs, ref[number], config.kl_estimator)
                    kl_loss = grpo.agg_loss(kl, batch.response_mask, config.loss_agg_mode, **agg_kwargs)
                    loss = loss + config.kl_coef * kl_loss
                    totals["kl_loss"] += float(kl_loss.detach())
                loss.backward()
                share = float(batch.response_mask.sum()) / total_tokens
                totals["pg_loss"] += float(pg_loss.detach())
                for key in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"):
                    totals[key] += metrics[key] * share
            grad_norm = self._clip_and_step(self.optimizer)
        self.step += 1
        self.policy_version += 1
        seconds = time.perf_counter() - started
        stats = {key: value / config.ppo_epochs for key, value in totals.items()}
        stats.update({
            "loss": stats["pg_loss"] + config.kl_coef * stats["kl_loss"],
            "grad_norm": grad_norm,
            "samples": float(len(samples)),
            "response_tokens": total_tokens,
            "tokens": float(sum(len(seq) for seq, _ in sequences)),
            "micro_batches": float(len(batches)),
            "advantage_mean": sum(float(s.advantage) for s in samples) / len(samples),
            "lr": self.optimizer.param_groups[0]["lr"],
            "seconds": seconds,
            "tokens_per_s": float(sum(len(seq) for seq, _ in sequences)) * config.ppo_epochs / max(seconds, 1e-9),
            "step": float(self.step),
            "policy_version": float(self.policy_version),
        })
        if config.checkpoint_every and self.step % config.checkpoint_every == 0:
            self._periodic_checkpoint()
        return stats

    @staticmethod
    def _usable_old_logprobs(samples: Sequence[TrainingSample]) -> list[Sequence[float] | None]:
        """Each sample's given old logprobs, or ``None`` (recompute) where their count does not
        match its response: agent data from another engine must not stop training."""
        usable: list[Sequence[float] | None] = []
        mismatched: list[str] = []
        for number, sample in enumerate(samples):
            given = sample.old_logprobs
            if given is not None and len(given) != len(sample.response_token_ids):
                mismatched.append(f"sample {number}: {len(given)} for {len(sample.response_token_ids)} tokens")
                given = None
            usable.append(given)
        if mismatched:
            logger.warning("%d of %d samples have a different number of old logprobs than response "
                           "tokens (%s%s): their old logprobs are recomputed with the current weights",
                           len(mismatched), len(samples), "; ".join(mismatched[:3]),
                           ", ..." if len(mismatched) > 3 else "")
        return usable

    def _reference_logprobs(self, batch: _Batch) -> torch.Tensor:
        if self.reference is not None:
            return self._token_logprobs(self.reference, batch).float()
        with self.model.disable_adapter():  # LoRA: the base weights are the reference
            return self._token_logprobs(self.model, batch).float()

    def _clip_and_step(self, optimizer: torch.optim.Optimizer) -> float:
        params = self._trainable()
        if self.config.grad_clip and self.config.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, self.config.grad_clip)
        else:
            norm = torch.norm(torch.stack([p.grad.norm() for p in params if p.grad is not None]))
        norm_value = float(norm)
        if not torch.isfinite(norm):
            logger.warning("non-finite gradient norm (%s): update skipped", norm_value)
            optimizer.zero_grad(set_to_none=True)
            return norm_value
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return norm_value

    # ------------------------------------------------------------------ SFT

    def encode_chat_example(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        """Token ids of a chat and a 0/1 mask of the assistant tokens to learn.

        Assistant tokens are the ids a serving engine would sample after the chat template's
        generation prompt: the content and the end-of-turn token (``<|im_end|>``).
        """
        return encode_chat_for_sft(self.tokenizer, messages)

    def sft_loss(self, examples: Sequence[dict]) -> float:
        """Mean cross-entropy on the assistant tokens of ``examples`` (no update)."""
        sequences = [self.encode_chat_example(_messages_of(e)) for e in examples]
        total_tokens = float(sum(sum(mask) for _, mask in sequences))
        loss = 0.0
        with torch.no_grad():
            for rows in self._micro_batches(sequences):
                batch = self._pad(sequences, rows)
                logprobs = self._token_logprobs(self.model, batch)
                loss += float(-(logprobs * batch.response_mask).sum()) / total_tokens
        return loss

    def sft_steps(self, batches: Iterable[Sequence[dict]], lr: float | None = None,
                  max_steps: int | None = None, progress: bool = True,
                  on_step: Callable[[int, dict], None] | None = None) -> dict[str, float]:
        """Supervised steps: one AdamW step per batch of chat examples ``{"messages": [...]}``.

        ``batches`` is any iterable (a generator may build fresh examples each step, e.g. a
        curriculum). Loss: cross-entropy averaged over every assistant token of the batch.
        The SFT optimizer is separate from GRPO's and persists across calls. Bumps
        ``policy_version`` once per call. Returns ``steps``, ``loss_first``, ``loss_last``,
        ``tokens``, ``seconds``, ``policy_version``.
        """
        from tqdm.auto import tqdm

        rate = lr if lr is not None else self.config.sft_learning_rate
        if self._sft_optimizer is None:
            self._sft_optimizer = self._new_optimizer(rate)
        for group in self._sft_optimizer.param_groups:
            group["lr"] = rate
        started = time.perf_counter()
        losses: list[float] = []
        tokens = 0
        bar = tqdm(total=max_steps, desc="sft", unit="step", disable=not progress)
        self.model.train()
        for number, examples in enumerate(batches):
            if max_steps is not None and number >= max_steps:
                break
            sequences = [self.encode_chat_example(_messages_of(e)) for e in examples]
            batch_tokens = float(sum(sum(mask) for _, mask in sequences))
            if batch_tokens == 0:
                raise ValueError(f"SFT batch {number} has no assistant tokens to learn")
            step_loss = 0.0
            for rows in self._micro_batches(sequences):
                batch = self._pad(sequences, rows)
                logprobs = self._token_logprobs(self.model, batch)
                loss = -(logprobs * batch.response_mask).sum() / batch_tokens
                loss.backward()
                step_loss += float(loss.detach())
            self._clip_and_step(self._sft_optimizer)
            losses.append(step_loss)
            tokens += int(batch_tokens)
            bar.update(1)
            bar.set_postfix(loss=f"{step_loss:.3f}")
            if on_step is not None:
                on_step(number, {"loss": step_loss, "tokens": batch_tokens})
        bar.close()
        if losses:
            self.policy_version += 1
        return {
            "steps": float(len(losses)),
            "loss_first": losses[0] if losses else float("nan"),
            "loss_last": losses[-1] if losses else float("nan"),
            "tokens": float(tokens),
            "seconds": time.perf_counter() - started,
            "policy_version": float(self.policy_version),
        }

    def sft_from_jsonl(self, path: str | Path, steps: int, batch_size: int = 64, lr: float | None = None,
                       seed: int = 0, progress: bool = True) -> dict[str, float]:
        """``sft_steps`` on random batches drawn from a chat JSONL file (one example a line)."""
        examples = load_chat_jsonl(path)
        rng = random.Random(seed)

        def batches():
            while True:
                yield [rng.choice(examples) for _ in range(batch_size)]

        return self.sft_steps(batches(), lr=lr, max_steps=steps, progress=progress)

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, out_dir: str | Path) -> Path:
        """Write an HF model directory plus trainer state to ``out_dir`` (atomically replaced).

        ``from_pretrained(out_dir)`` loads the policy (LoRA merged); ``TorchTrainer.resume``
        continues with the same step, policy version and optimizer state.
        """
        out = Path(out_dir)
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = out.parent / f".{out.name}.partial-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        if self.config.lora_rank:
            self.model.get_base_model().save_pretrained(staging, state_dict=self.policy_state_dict())
            self.model.save_pretrained(staging / ADAPTER_DIR)
        else:
            self.model.save_pretrained(staging)
        self.tokenizer.save_pretrained(staging)
        torch.save({"optimizer": self.optimizer.state_dict(),
                    "sft_optimizer": self._sft_optimizer.state_dict() if self._sft_optimizer else None,
                    "torch_rng": torch.get_rng_state()}, staging / OPTIMIZER_FILE)
        state = {"step": self.step, "policy_version": self.policy_version,
                 "base_model_dir": self._base_model_dir(), "lora": bool(self.config.lora_rank),
                 "config": asdict(self.config), "saved_at": time.time()}
        (staging / STATE_FILE).write_text(json.dumps(state, indent=2))  # written last: marks complete
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
            staging.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            staging.rename(out)
        logger.info("checkpoint saved: %s (step %d, policy version %d)", out, self.step, self.policy_version)
        return out

    def _base_model_dir(self) -> str:
        return getattr(self, "_base_dir", None) or self.model_dir

    def _periodic_checkpoint(self) -> None:
        root = Path(self.config.checkpoint_dir)
        self.save_checkpoint(root / f"{CHECKPOINT_PREFIX}{self.step:06d}")
        kept = sorted(list_checkpoints(root))
        for stale in kept[: max(0, len(kept) - max(1, self.config.keep_checkpoints))]:
            shutil.rmtree(stale, ignore_errors=True)

    @classmethod
    def resume(cls, checkpoint: str | Path, config: TrainerConfig | None = None) -> TorchTrainer:
        """A trainer continuing from a checkpoint directory, or from the latest one under it.

        ``config`` overrides the saved settings (e.g. another device); by default the saved
        ones are used.
        """
        path = latest_checkpoint(checkpoint)
        state = json.loads((path / STATE_FILE).read_text())
        if config is None:
            saved = {f.name: state["config"][f.name] for f in fields(TrainerConfig) if f.name in state["config"]}
            config = TrainerConfig(**saved)
        if state.get("lora"):
            trainer = cls(state["base_model_dir"], config, _adapter_dir=path / ADAPTER_DIR)
        else:
            trainer = cls(path, config, _reference_dir=state["base_model_dir"])
        trainer._base_dir = state["base_model_dir"]
        saved_optim = torch.load(path / OPTIMIZER_FILE, map_location=trainer.device, weights_only=False)
        trainer.optimizer.load_state_dict(saved_optim["optimizer"])
        if saved_optim.get("sft_optimizer") is not None:
            trainer._sft_optimizer = trainer._new_optimizer(config.sft_learning_rate)
            trainer._sft_optimizer.load_state_dict(saved_optim["sft_optimizer"])
        # map_location put the RNG state on the trainer's device; set_rng_state takes only a
        # CPU ByteTensor (on CUDA it raised "RNG state must be a torch.ByteTensor").
        torch.set_rng_state(saved_optim["torch_rng"].cpu())
        trainer.step = int(state["step"])
        trainer.policy_version = int(state["policy_version"])
        logger.info("resumed from %s: step %d, policy version %d", path, trainer.step, trainer.policy_version)
        return trainer


# ----------------------------------------------------------------------------- helpers


def grpo_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)[targets]`` in float32 without materialising the full softmax twice.

    ``logits [B, T, V]``, ``targets [B, T]`` -> ``[B, T]``.
    """
    logits = logits.float()
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def _decoder_and_head(model):
    """The decoder stack and LM head of a plain or PEFT-wrapped HF causal LM, or ``(None, None)``.

    ``(None, None)`` (use the full forward) for models whose logits are post-processed after
    the head (e.g. Gemma's soft-capping).
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(base.config, "final_logit_softcapping", None):
        return None, None
    decoder = getattr(base, "model", None)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if decoder is None or head is None or not hasattr(decoder, "forward"):
        return None, None
    return decoder, head


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints (``step-NNNNNN`` with a state file) under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith(CHECKPOINT_PREFIX) and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(path: str | Path) -> Path:
    """``path`` itself when it is a checkpoint, else its newest complete ``step-*`` checkpoint."""
    path = Path(path)
    if (path / STATE_FILE).is_file():
        return path
    found = list_checkpoints(path)
    if not found:
        raise FileNotFoundError(f"no complete checkpoint (with {STATE_FILE}) in {path}")
    return found[-1]


def _messages_of(example) -> list[dict]:
    if isinstance(example, dict) and isinstance(example.get("messages"), list):
        return example["messages"]
    if isinstance(example, list):
        return example
    raise ValueError('an SFT example must be {"messages": [{"role": ..., "content": ...}, ...]}')


def load_chat_jsonl(path: str | Path) -> list[dict]:
    """Chat examples from a JSONL file; a bad line raises an error naming its line number."""
    examples = []
    with Path(path).open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                messages = _messages_of(record)
                if not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
                    raise ValueError("every message needs 'role' and 'content'")
            except (json.JSONDecodeError, ValueError) as exc:
                raise ValueError(f"{path}:{number}: not a chat example: {exc}") from exc
            examples.append({"messages": messages})
    if not examples:
        raise ValueError(f"{path} holds no chat examples")
    return examples


def encode_chat_for_sft(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """``(ids, mask)`` for a chat: mask 1 on each assistant message's sampled tokens.

    For every assistant message ``i`` the ids before it are the chat template of
    ``messages[:i]`` with the generation prompt — exactly the prompt the server sends to the
    model — and its tokens are the content plus the end-of-turn token, up to the first eos
    that follows (the template's trailing newline is context, not learned).
    """
    def render(upto: int, generation_prompt: bool) -> list[int]:
        text = tokenizer.apply_chat_template(messages[:upto], add_generation_prompt=generation_prompt,
                                             tokenize=False)
        return list(tokenizer.encode(text, add_special_tokens=False))

    eos = tokenizer.eos_token_id
    full = render(len(messages), False)
    mask = [0] * len(full)
    for index, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        prefix = render(index, True)
        through = render(index + 1, False)
        start = len(prefix)
        if full[: len(through)] != through or through[:start] != prefix:
            start = _common_prefix(prefix, through)  # a template that re-tokenizes across the seam
        end = len(through)
        for position in range(start, len(through)):
            if through[position] == eos:
                end = position + 1
                break
        for position in range(start, min(end, len(full))):
            mask[position] = 1
    return full, mask


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
