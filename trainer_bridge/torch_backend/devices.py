"""Which torch device and dtype a setting names: shared by the policy engine and the trainer.

``resolve_device`` and ``resolve_dtype`` read the ``device`` / ``dtype`` settings of
``config.EngineConfig`` and ``config.TrainerConfig`` (``auto``, ``cpu``, ``cuda:N``;
``float32``, ``bfloat16``...). Called by ``engine.policy_engine.PolicyEngine.from_pretrained``
and by ``trainer.TorchTrainer``.
"""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def resolve_device(device: str | None) -> torch.device:
    """``auto`` (or nothing): CUDA when there is one, else the CPU; anything else as torch reads it."""
    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    """``auto`` (or nothing): bfloat16 on CUDA, float32 elsewhere; else one of ``DTYPES``."""
    if dtype in (None, "", "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]
