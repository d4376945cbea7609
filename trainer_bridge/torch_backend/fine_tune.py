"""Supervised fine-tuning of a model directory by the torch trainer: the warm start's training.

``backend.fine_tune(request)`` (the seam) calls ``fine_tune`` for ``spanrl sft`` and the
``warm_start:`` block of ``spanrl train`` (``trainer_bridge/warm_start.py`` gathers the examples
and writes the record): chat demonstrations from a JSONL file, chat examples (calls recorded as
text only) and token examples (calls of well-rewarded rollouts) are learned for ``steps`` AdamW
steps (``sft.sft_on_examples``), and the model is written to ``out_dir`` as a plain model
directory (no optimizer state).
"""

from __future__ import annotations

import os
from typing import Any

from spanrl.errors import UserError
from spanrl.trainer_bridge.backend import FineTuneRequest

from . import sft
from .config import TrainerConfig
from .trainer import TorchTrainer

# trainer-only files of a checkpoint that a fine-tuned model directory does not need
CHECKPOINT_ONLY_FILES = ("optimizer.pt", "trainer_state.json")


def load_demonstrations(path: str) -> list[dict]:
    """The chat examples of a JSONL file; ``UserError`` naming the file or its bad line."""
    try:
        return sft.load_chat_jsonl(path)
    except FileNotFoundError as exc:
        raise UserError(f"demonstrations file not found: {path}") from exc
    except ValueError as exc:  # names the bad line
        raise UserError(str(exc)) from exc


def fine_tune(request: FineTuneRequest) -> dict[str, Any]:
    """SFT ``request.model_dir`` on its examples and write the result to ``request.out_dir`` (which
    may be ``model_dir`` itself: it is replaced atomically). Returns ``steps``, ``loss_first``,
    ``loss_last``, ``seconds`` and ``demonstrations`` (how many chat examples were learned)."""
    demonstrations = load_demonstrations(request.demonstrations) if request.demonstrations else []
    examples: list[Any] = [*demonstrations, *request.chat_examples, *request.token_examples]
    trainer = TorchTrainer(request.model_dir, TrainerConfig(
        sft_learning_rate=request.learning_rate, device=request.device, seed=request.seed))
    stats = sft.sft_on_examples(trainer, examples, request.steps, batch_size=request.batch_size,
                                lr=request.learning_rate, seed=request.seed, progress=request.progress)
    trainer.save_checkpoint(request.out_dir)
    for name in CHECKPOINT_ONLY_FILES:  # a plain model directory: GRPO starts its own optimizer
        path = os.path.join(request.out_dir, name)
        if os.path.exists(path):
            os.remove(path)
    return {**stats, "demonstrations": len(demonstrations)}
