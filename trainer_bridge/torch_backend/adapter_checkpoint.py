"""A checkpoint's per-agent adapters, for ``spanrl serve CHECKPOINT``: found, checked, loaded.

A torch-backend checkpoint trained with ``adapters:`` (``checkpoints.py``) is the frozen base (a
Hugging Face model directory) plus each adapter in peft's format under ``adapters/<name>/``; each
adapter's agents are in ``trainer_state.json`` (``config.adapters``, the ``adapters:`` setting as
written). ``checkpoint_adapter_specs`` reads them and checks every adapter's files before any
model loads (``UserError`` naming the file that is missing or unreadable);
``load_adapter_weights`` loads them onto the engine's model with peft
(``multi_adapter.attach_adapters``), exports them for the engine (``multi_adapter.adapter_weights``)
and takes peft's layers off again, so the engine serves them exactly as during training
(``engine/multi_lora.py``, routed by ``server/adapter_routing.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from spanrl.errors import UserError
from spanrl.trainer_bridge.adapter_specs import AdapterSpec, parse_adapters

ADAPTERS_DIR = "adapters"  # the same names as checkpoints.py (which imports torch)
STATE_FILE = "trainer_state.json"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class AdapterCheckpointError(UserError):
    """A checkpoint's adapters cannot be served: the message names the file and what is wrong."""


def checkpoint_adapter_specs(model_dir: str | Path) -> tuple[AdapterSpec, ...]:
    """The adapters a checkpoint holds (empty: a plain model directory), each adapter's files
    checked; ``AdapterCheckpointError`` names a missing or unreadable file."""
    root = Path(model_dir)
    folder = root / ADAPTERS_DIR
    if not folder.is_dir():
        return ()
    state_file = root / STATE_FILE
    if not state_file.is_file():
        raise AdapterCheckpointError(f"{state_file}: missing; a checkpoint with {folder} needs it (it names each "
                                     f"adapter's agents): serve the checkpoint folder `spanrl train` wrote")
    try:
        state = json.loads(state_file.read_text())
        specs = parse_adapters(state["config"]["adapters"])
    except (OSError, ValueError, KeyError, TypeError, UserError) as exc:
        raise AdapterCheckpointError(f"{state_file}: cannot read its adapters (config.adapters): {exc}") from exc
    if not specs:
        raise AdapterCheckpointError(f"{state_file}: names no adapters (config.adapters), but {folder} exists")
    extra = sorted({p.name for p in folder.iterdir() if p.is_dir()} - {spec.name for spec in specs})
    if extra:
        raise AdapterCheckpointError(f"{folder}: holds adapters {extra} that {state_file} does not name")
    for spec in specs:
        _check_adapter_files(folder / spec.name)
    return specs


def _check_adapter_files(folder: Path) -> None:
    config_file, weights_file = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
    for needed in (config_file, weights_file):
        if not needed.is_file():
            raise AdapterCheckpointError(f"{needed}: missing (an adapter in peft's format is {ADAPTER_CONFIG} "
                                         f"+ {ADAPTER_WEIGHTS})")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterCheckpointError(f"{config_file}: not a JSON adapter config: {exc}") from exc
    if not isinstance(config, dict) or config.get("peft_type") != "LORA" or not config.get("r"):
        raise AdapterCheckpointError(f"{config_file}: not a LoRA adapter config (needs peft_type LORA and r)")
    from safetensors import SafetensorError, safe_open

    try:  # reads the header and checks it against the file's size: a cut-off file fails here
        with safe_open(str(weights_file), framework="pt") as weights:
            keys = list(weights.keys())
    except (OSError, SafetensorError) as exc:
        raise AdapterCheckpointError(f"{weights_file}: unreadable safetensors file: {exc}") from exc
    if not any("lora_" in key for key in keys):
        raise AdapterCheckpointError(f"{weights_file}: holds no LoRA weights")


def load_adapter_weights(model: Any, model_dir: str | Path,
                         specs: tuple[AdapterSpec, ...]) -> dict[str, dict[str, tuple[Any, Any]]]:
    """Every adapter's weights for ``engine.attach_adapters``, read by peft onto ``model`` (the
    engine's base model), which is left as it was (peft's layers removed)."""
    from spanrl.trainer_bridge.torch_backend.multi_adapter import adapter_weights, attach_adapters

    folder = Path(model_dir) / ADAPTERS_DIR
    try:
        peft_model = attach_adapters(model, specs, folder)
    except (RuntimeError, ValueError, KeyError) as exc:  # e.g. an adapter of another base model's shapes
        raise AdapterCheckpointError(f"{folder}: its adapters do not load onto {model_dir}'s model: {exc}") from exc
    try:
        return adapter_weights(peft_model)
    finally:
        peft_model.unload()  # the plain model again, its own Linear layers in place


__all__ = ["AdapterCheckpointError", "checkpoint_adapter_specs", "load_adapter_weights"]
