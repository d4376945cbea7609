"""The embedded torch backend's trainer: GRPO updates and SFT warm start on any HF causal LM.

Driven by the torch backend (``backend.TorchBackend``, behind the bridge loop of ``spanrl
train``), by the demo and by tests. ``TorchTrainer(model_dir, TrainerConfig(...))`` loads the
model (CPU or CUDA, optionally LoRA through peft), and offers:

- ``grpo_step(samples)``: one policy update on ``TrainingSample``s whose advantages the
  caller computed (``advantages.group_advantages``): dual-clip PPO loss (``losses``), verl's loss aggregation,
  optional KL to a frozen reference, AdamW with gradient clipping, micro-batches cut by a
  token budget whose losses add up to the whole batch's loss (``batching``).
- ``sft_steps(batches)`` / ``sft_from_jsonl(path)``: cross-entropy on assistant tokens of
  chat examples (``{"messages": [...]}``), the ``<|im_end|>`` that closes each included (``sft``).
- ``save_checkpoint(dir)`` / ``TorchTrainer.resume(dir)``: HF-format weights
  (``from_pretrained``-loadable) plus optimizer state, step and policy version (``checkpoints``).
- ``policy_state_dict()``: weights for ``PolicyEngine.swap_weights`` (LoRA merged).

Each ``grpo_step`` and each ``sft_steps`` call produces a new policy: ``policy_version`` +1.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from spanrl.trainer_bridge.backend import TrainingSample
from spanrl.trainer_bridge.torch_backend import losses, multi_adapter, sft
from spanrl.trainer_bridge.torch_backend.batching import (
    MaskedSequence,
    PreparedUpdate,
    TokenBatch,
    enable_packing,
    enable_tail,
    loss_token_values,
    micro_batches,
    pack_batch,
    pad_batch,
    sample_sequences,
    token_logprobs,
    usable_old_logprobs,
)
from spanrl.trainer_bridge.torch_backend.checkpoints import (
    latest_checkpoint,
    list_checkpoints,
    resume_trainer,
    save_checkpoint,
    save_periodic_checkpoint,
)
from spanrl.trainer_bridge.torch_backend.config import TrainerConfig
from spanrl.trainer_bridge.torch_backend.devices import resolve_device

# Older imports name these here: ``from ...torch_backend.trainer import TrainingSample``.
__all__ = ["TorchTrainer", "TrainerConfig", "TrainingSample", "latest_checkpoint", "list_checkpoints"]

logger = logging.getLogger(__name__)


class TorchTrainer:
    """GRPO + SFT on a Hugging Face causal LM (see the module docstring)."""

    def __init__(self, model_dir: str | Path, config: TrainerConfig | None = None,
                 _adapter_dir: str | Path | None = None, _reference_dir: str | Path | None = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.config = config or TrainerConfig()
        self.model_dir = str(model_dir)
        self.base_model_dir = self.model_dir  # the model training started from (resume sets it)
        self.device = resolve_device(self.config.device)
        torch.manual_seed(self.config.seed)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        model: Any = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        model.to(self.device)
        if self.config.gradient_checkpointing:
            model.gradient_checkpointing_enable()
            model.config.use_cache = False
        self.reference: Any = None
        if self.config.kl_coef > 0 and not self.config.lora_rank and not self.config.adapters:
            # KL is to the initial policy: a resumed full fine-tune (``_reference_dir``: the
            # base model) must not take the checkpoint it starts from as its reference.
            if _reference_dir is not None:
                if not (Path(_reference_dir) / "config.json").is_file():
                    raise FileNotFoundError(
                        f"the KL reference (the base model the checkpoint was trained from) is not "
                        f"a model directory: {str(_reference_dir)!r}")
                reference: Any = AutoModelForCausalLM.from_pretrained(str(_reference_dir), dtype=torch.float32)
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
        elif self.config.adapters:  # one LoRA per agent on a frozen base (multi_adapter.py)
            model = multi_adapter.attach_adapters(model, self.config.adapter_specs, _adapter_dir)
        self.model: Any = model
        self.model.train()
        self.step = 0
        self.policy_version = 0
        self.agents_seen: set[str] = set()  # agents whose samples reached an update (adapters)
        self.adapter_optimizers = multi_adapter.new_adapter_optimizers(self) if self.config.adapters else {}
        self.optimizer = (next(iter(self.adapter_optimizers.values())) if self.adapter_optimizers
                          else self.new_optimizer(self.config.learning_rate))
        self.sft_optimizer: torch.optim.Optimizer | None = None
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        # packed micro-batches (no padding) when the model gives the same logprobs packed
        vocab_size = self.model.get_input_embeddings().num_embeddings
        self.packed = self.config.pack_sequences and enable_packing(self.model, vocab_size, self.device)
        if self.packed and self.reference is not None:  # the same architecture: the same answer
            self.packed = enable_packing(self.reference, vocab_size, self.device)
        # the last layer on scored positions only (scored_tail.py), where it changes no logprob
        self.tail = self.packed and self.config.scored_tail and enable_tail(self.model, vocab_size, self.device)
        if self.tail and self.reference is not None:
            self.tail = enable_tail(self.reference, vocab_size, self.device)
        if self.config.pack_sequences and not self.packed:
            logger.info("torch trainer: %s cannot take packed sequences (its attention is not SDPA or "
                        "differs packed); micro-batches are padded", self.model_dir)
        trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        logger.info("torch trainer: %s on %s, %d trainable parameters, config %s",
                    self.model_dir, self.device, trainable, asdict(self.config))

    # ------------------------------------------------------------------ basics

    def _trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def new_optimizer(self, lr: float, parameters: list[torch.nn.Parameter] | None = None) -> torch.optim.Optimizer:
        """AdamW over ``parameters`` (default: the trainable ones) with the configured betas and
        weight decay. On CPU torch's fused kernel: one pass over each tensor instead of a kernel
        per operation, ~4x faster a step on the small preset (docs/performance.md)."""
        params = self._trainable() if parameters is None else parameters
        device = self.device.type
        return torch.optim.AdamW(params, lr=lr, betas=self.config.betas, weight_decay=self.config.weight_decay,
                                 foreach=device == "cuda", fused=True if device == "cpu" else None)

    def autocast(self) -> AbstractContextManager:
        """The autocast context of forward passes (off unless ``config.autocast_dtype``)."""
        if self.config.autocast_dtype:
            from spanrl.trainer_bridge.torch_backend.devices import resolve_dtype

            return torch.autocast(self.device.type, dtype=resolve_dtype(self.config.autocast_dtype, self.device))
        return torch.autocast(self.device.type, enabled=False)

    def policy_state_dict(self) -> dict[str, torch.Tensor]:
        """The current policy's weights with plain HF keys (LoRA merged), for ``swap_weights``; with
        per-agent adapters the frozen base's (``adapter_weights`` has the adapters)."""
        if self.config.adapters:
            return multi_adapter.base_state_dict(self.model)
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

    def token_batches(self, sequences: Sequence[MaskedSequence]) -> list[TokenBatch]:
        """``sequences`` in micro-batches as the model takes them: packed (no padding, shared
        beginnings run once when ``share_prefixes``) when the model allows it (``self.packed``),
        else padded; each within ``micro_batch_tokens``."""
        share = self.config.share_prefixes
        groups = micro_batches(sequences, self.config.micro_batch_tokens, packed=self.packed, share_prefixes=share)
        if self.packed:
            return [pack_batch(sequences, rows, self.device, share_prefixes=share, tail=self.tail) for rows in groups]
        return [pad_batch(sequences, rows, self.pad_id, self.device) for rows in groups]

    def token_logprobs(self, batch: TokenBatch, model: Any = None) -> torch.Tensor:
        """``[B, T]`` logprobs of ``batch``'s scored tokens under ``model`` (default: the policy)."""
        return token_logprobs(self.model if model is None else model, batch, self.autocast())

    def sequence_logprobs(self, samples: Sequence[TrainingSample]) -> list[list[float]]:
        """Current policy's logprob of each response token of each sample (no gradient)."""
        sequences = sample_sequences(samples)
        out: list[list[float]] = [[] for _ in samples]
        with torch.no_grad():
            for batch in self.token_batches(sequences):
                values = self.token_logprobs(batch)
                for b, i in enumerate(batch.rows):
                    out[i] = values[b, : samples[i].loss_token_count].float().tolist()
        return out

    # ------------------------------------------------------------------ GRPO

    def grpo_step(self, samples: Sequence[TrainingSample]) -> dict[str, float]:
        """One GRPO/PPO update on ``samples``; returns float statistics (loss, kl, clipfrac, ...).

        Old logprobs come from each sample when given (the engine's), else are recomputed
        with the current weights. The loss of the whole batch is aggregated as
        ``config.loss_agg_mode`` says, micro-batch by micro-batch. Three steps, as verl's
        ``update_policy``: ``_prepare`` (what the update consumes), ``_update`` (the epochs of
        optimizer steps), ``_step_stats``.
        """
        if not samples:
            raise ValueError("grpo_step needs at least one sample")
        if self.config.adapters:  # each adapter on its own agents' samples
            stats = multi_adapter.adapter_grpo_step(self, samples)
        else:
            started = time.perf_counter()
            prepared = self._prepare(samples)
            totals, grad_norm = self._update(prepared)
            self.step += 1
            self.policy_version += 1
            stats = self._step_stats(prepared, totals, grad_norm, time.perf_counter() - started)
        config = self.config
        if config.checkpoint_every and self.step % config.checkpoint_every == 0:
            save_periodic_checkpoint(self, str(config.checkpoint_dir), config.keep_checkpoints)
        return stats

    def _prepare(self, samples: Sequence[TrainingSample]) -> PreparedUpdate:
        """Micro-batches of ``samples`` with what the update consumes: old logprobs (the engine's, or
        recomputed up front with several epochs), the engine's for truncated IS, per-token
        advantages, the reference's logprobs with a KL penalty."""
        config = self.config
        sequences = sample_sequences(samples)
        batches = self.token_batches(sequences)
        # Old logprobs: the engine's when given. Missing ones are the current policy's; with a
        # single epoch the weights do not change before the loss is taken, so they are the
        # detached logprobs of the training forward pass itself (no extra forward pass).
        given_old = usable_old_logprobs(samples)
        is_cap = config.rollout_is_cap  # truncated IS: old logprobs are the current weights' then
        prepared = PreparedUpdate(samples, sequences, batches, float(sum(s.loss_token_count for s in samples)))
        self.model.eval()
        with torch.no_grad():
            for batch in batches:
                lengths = [samples[i].loss_token_count for i in batch.rows]
                missing = torch.tensor([given_old[i] is None or is_cap > 0 for i in batch.rows],
                                       device=self.device).unsqueeze(1)
                recomputed = (self.token_logprobs(batch)
                              if config.ppo_epochs > 1 and bool(missing.any()) else None)
                given = torch.zeros_like(batch.response_mask)
                adv = torch.zeros_like(batch.response_mask)
                for b, i in enumerate(batch.rows):
                    engine_values = given_old[i]
                    if engine_values is not None:
                        given[b, : lengths[b]] = torch.tensor(loss_token_values(samples[i], engine_values))
                    adv[b, : lengths[b]] = torch.tensor(loss_token_values(samples[i], samples[i].response_advantages))
                old_values = given.clone()
                if recomputed is not None:
                    old_values = torch.where(missing, recomputed.float(), old_values)
                if is_cap > 0:  # the engine's logprobs; NaN (weight 1) where a row has none
                    has_engine = torch.tensor([given_old[i] is not None for i in batch.rows],
                                              device=self.device).unsqueeze(1)
                    prepared.engine_old.append(torch.where(has_engine, given, torch.full_like(given, float("nan"))))
                prepared.old.append(old_values * batch.response_mask)
                prepared.missing_rows.append(missing if recomputed is None else torch.zeros_like(missing))
                prepared.advantages.append(adv)
                if config.kl_coef > 0:
                    prepared.ref.append(self._reference_logprobs(batch))
        self.model.train()
        return prepared

    def _update(self, prepared: PreparedUpdate) -> tuple[dict[str, float], float]:
        """``ppo_epochs`` optimizer steps over the prepared micro-batches; summed statistics and the
        last gradient norm."""
        config = self.config
        samples = prepared.samples
        agg_kwargs = {"batch_num_tokens": prepared.total_tokens, "global_batch_size": float(len(samples)),
                      "loss_scale_factor": config.loss_scale_factor or max(len(s.response_token_ids) for s in samples)}
        totals = dict.fromkeys(("pg_loss", "kl_loss", "pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"), 0.0)
        if config.rollout_is_cap > 0:
            totals.update(rollout_is_mean=0.0, rollout_is_truncated=0.0)
        grad_norm = 0.0
        for _epoch in range(config.ppo_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for number in range(len(prepared.batches)):
                self._micro_batch_loss(prepared, number, agg_kwargs, totals)
            grad_norm = self.clip_and_step(self.optimizer)
        return totals, grad_norm

    def _micro_batch_loss(self, prepared: PreparedUpdate, number: int, agg_kwargs: dict,
                          totals: dict[str, float]) -> None:
        """Forward and backward of micro-batch ``number``; its statistics added to ``totals``."""
        config, batch = self.config, prepared.batches[number]
        logprobs = self.token_logprobs(batch)
        old_logprobs = torch.where(prepared.missing_rows[number], logprobs.detach() * batch.response_mask,
                                   prepared.old[number])
        is_weights: torch.Tensor | None = None
        metrics: dict[str, float] = {}
        if config.rollout_is_cap > 0:
            engine = prepared.engine_old[number]
            engine = torch.where(torch.isnan(engine), old_logprobs, engine)
            is_weights, metrics = losses.truncated_is_weights(old_logprobs, engine, batch.response_mask,
                                                              config.rollout_is_cap)
        pg_loss, pg_metrics = losses.policy_loss_dual_clip(
            old_logprobs, logprobs, prepared.advantages[number], batch.response_mask,
            clip_ratio_low=config.clip_ratio_low, clip_ratio_high=config.clip_ratio_high,
            clip_ratio_c=config.clip_ratio_c, loss_agg_mode=config.loss_agg_mode,
            token_weights=is_weights, **agg_kwargs)
        metrics = {**pg_metrics, **metrics}
        loss = pg_loss
        if config.kl_coef > 0:
            kl = losses.kl_penalty(logprobs, prepared.ref[number], config.kl_estimator)
            kl_loss = losses.agg_loss(kl, batch.response_mask, config.loss_agg_mode, **agg_kwargs)
            loss = loss + config.kl_coef * kl_loss
            totals["kl_loss"] += float(kl_loss.detach())
        loss.backward()
        share = float(batch.response_mask.sum()) / prepared.total_tokens
        totals["pg_loss"] += float(pg_loss.detach())
        for key in ("pg_clipfrac", "ppo_kl", "pg_clipfrac_lower", "rollout_is_mean", "rollout_is_truncated"):
            if key in totals:
                totals[key] += metrics[key] * share

    def _step_stats(self, prepared: PreparedUpdate, totals: dict[str, float], grad_norm: float,
                    seconds: float) -> dict[str, float]:
        """The statistics of one ``grpo_step`` (per-epoch means of the summed losses)."""
        config, samples = self.config, prepared.samples
        tokens = float(sum(len(seq) for seq, _ in prepared.sequences))
        stats = {key: value / config.ppo_epochs for key, value in totals.items()}
        stats.update({
            "loss": stats["pg_loss"] + config.kl_coef * stats["kl_loss"],
            "grad_norm": grad_norm,
            "samples": float(len(samples)),
            "response_tokens": prepared.total_tokens,
            "tokens": tokens,
            "model_tokens": float(sum(batch.input_ids.numel() for batch in prepared.batches)),
            "micro_batches": float(len(prepared.batches)),
            "advantage_mean": sum(float(s.advantage) for s in samples) / len(samples),
            "lr": self.optimizer.param_groups[0]["lr"],
            "seconds": seconds,
            "tokens_per_s": tokens * config.ppo_epochs / max(seconds, 1e-9),
            "step": float(self.step),
            "policy_version": float(self.policy_version),
        })
        return stats

    def _reference_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        if self.reference is not None:
            return self.token_logprobs(batch, self.reference).float()
        with self.model.disable_adapter():  # LoRA: the base weights are the reference
            return self.token_logprobs(batch).float()

    def clip_and_step(self, optimizer: torch.optim.Optimizer) -> float:
        """Clip the gradient norm, step ``optimizer`` (skipped on a non-finite norm); the norm."""
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

    # ------------------------------------------------------------------ SFT (``sft``)

    def encode_chat_example(self, messages: list[dict]) -> MaskedSequence:
        """Token ids of a chat and a 0/1 mask of the assistant tokens to learn.

        Assistant tokens are the ids a serving engine would sample after the chat template's
        generation prompt: the content and the end-of-turn token (``<|im_end|>``).
        """
        return sft.encode_chat_for_sft(self.tokenizer, messages)

    def sft_loss(self, examples: Sequence[dict]) -> float:
        """Mean cross-entropy on the assistant tokens of ``examples`` (no update)."""
        return sft.sft_loss(self, examples)

    def sft_steps(self, batches: Iterable[Sequence[dict]], lr: float | None = None,
                  max_steps: int | None = None, progress: bool = True,
                  on_step: Callable[[int, dict], None] | None = None) -> dict[str, float]:
        """Supervised steps: one AdamW step per batch of chat examples ``{"messages": [...]}``.

        ``batches`` is any iterable (a generator may build fresh examples each step, e.g. a
        curriculum). Loss: cross-entropy averaged over every assistant token of the batch.
        The SFT optimizer is separate from GRPO's and persists across calls. Bumps
        ``policy_version`` once per call. Returns ``steps``, ``loss_first``, ``loss_last``,
        ``tokens``, ``examples_encoded`` (examples drawn again are encoded once: ``sft.EncodingCache``),
        ``seconds``, ``policy_version``.
        """
        return sft.sft_steps(self, batches, lr=lr, max_steps=max_steps, progress=progress, on_step=on_step)

    def sft_from_jsonl(self, path: str | Path, steps: int, batch_size: int = 64, lr: float | None = None,
                       seed: int = 0, progress: bool = True) -> dict[str, float]:
        """``sft_steps`` on random batches drawn from a chat JSONL file (one example a line)."""
        return sft.sft_from_jsonl(self, path, steps, batch_size=batch_size, lr=lr, seed=seed, progress=progress)

    # ------------------------------------------------------------------ checkpoints (``checkpoints``)

    def save_checkpoint(self, out_dir: str | Path) -> Path:
        """Write an HF model directory plus trainer state to ``out_dir`` (atomically replaced).

        ``from_pretrained(out_dir)`` loads the policy (LoRA merged); ``TorchTrainer.resume``
        continues with the same step, policy version and optimizer state.
        """
        return save_checkpoint(self, out_dir)

    @classmethod
    def resume(cls, checkpoint: str | Path, config: TrainerConfig | None = None) -> TorchTrainer:
        """A trainer continuing from a checkpoint directory, or from the latest one under it.

        ``config`` overrides the saved settings (e.g. another device); by default the saved
        ones are used.
        """
        return resume_trainer(cls, checkpoint, config)
