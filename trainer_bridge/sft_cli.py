"""``spanrl sft MODEL_DIR``: warm-start a model from the command line (supervised fine-tuning).

Registered by ``core/cli.py``, which builds ``SftSettings`` (flags > ``OTEL_SPANRL_SFT_*``
> the ``--config`` YAML file > defaults), prints them and calls ``sft_command``. The examples
are a chat JSONL file of demonstrations and/or the best-rewarded rollouts of a receiver store;
the work is ``warm_start.warm_start_model``, the same as the ``warm_start:`` block of
``train.yaml``. The result is a new model directory (``--output``) or the model itself
(``--in-place``). Imports nothing heavy at module level.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from spanrl.errors import SettingError, UserError
from spanrl.settings_loader import CommandSettings

from .warm_start import WarmStartConfig, describe_sources


@dataclass
class SftSettings(WarmStartConfig):
    """The warm start's options plus where the model comes from and where it goes."""

    model: str = field(default="", metadata={"help": "the Hugging Face model directory to fine-tune",
                                             "positional": True})
    output: str = field(default="", metadata={"help": "write the fine-tuned model to this new directory"})
    in_place: bool = field(default=False, metadata={"help": "overwrite MODEL with the fine-tuned weights"})
    force: bool = field(default=False, metadata={"help": "replace a non-empty --output directory"})
    progress: bool = field(default=True, metadata={"help": "show a progress bar"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.model:
            raise SettingError("give the model directory to fine-tune: spanrl sft MODEL_DIR --demonstrations FILE "
                               "--output NEW_DIR")
        if bool(self.output) == self.in_place:
            raise SettingError("say where the fine-tuned model goes: --output NEW_DIR, or --in-place to overwrite "
                               f"{self.model}")
        if not self.enabled:
            raise SettingError("nothing to learn from: give --demonstrations FILE (chat JSONL) and/or --store FILE "
                               "(a receiver store; --top-k / --min-reward pick its best rollouts)")


SETTINGS = CommandSettings("sft", SftSettings, "SFT")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "sft",
        help="warm-start a model: supervised fine-tuning on demonstrations or the best rollouts of a store",
        description="Fine-tune MODEL_DIR on chat demonstrations (a JSONL file, one {\"messages\": [...]} a "
        "line) and/or the best-rewarded rollouts of a receiver store, and write the result to a new model "
        "directory (--output) or over the model (--in-place). A model fresh from `spanrl model init` needs "
        "this before RL: its agent would never earn a reward.",
    )
    SETTINGS.add_to(parser)
    parser.set_defaults(func=sft_command)


def sft_command(settings: SftSettings) -> int:
    from .warm_start import warm_start_model

    out = settings.model if settings.in_place else settings.output
    if not settings.in_place and os.path.isdir(out) and os.listdir(out):
        if os.path.abspath(out) == os.path.abspath(settings.model):
            raise UserError(f"--output {out} is the model itself: pass --in-place to overwrite it")
        if not settings.force:
            raise UserError(f"--output {out} is not empty: choose a new directory, or pass --force to replace it")
    print(f"spanrl sft: {settings.steps} steps of {settings.batch_size} examples from "
          f"{describe_sources(settings)}", flush=True)
    record = warm_start_model(settings, settings.model, out, progress=settings.progress)
    print(f"loss {record['loss_first']:.3f} -> {record['loss_last']:.3f} over {record['steps']} steps "
          f"in {record['seconds']:.0f} s\nmodel: {out}", flush=True)
    return 0
