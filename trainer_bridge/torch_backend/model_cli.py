"""``spanrl model init DIR``: create a small Hugging Face model directory locally.

Registered by ``core/cli.py``, which builds ``ModelInitSettings`` (flags, then
``OTEL_SPANRL_MODEL_INIT_<FIELD>`` variables, then the ``--config`` YAML file, then defaults) and
calls ``_init``; the work is done by ``model_init.create_model_dir``. Imports nothing heavy at
module level (``model_init`` imports torch and tokenizers only inside its functions).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from spanrl.errors import SettingError, UserError
from spanrl.settings_loader import CommandSettings


@dataclass(frozen=True)
class ModelInitSettings:
    dir: str = field(metadata={"help": "output directory (created; must be empty unless --force)",
                               "positional": True})
    preset: str = field(default="tiny", metadata={
        "help": "tiny: 2 layers, hidden 128 (~0.5 M params); small: 4 layers, hidden 256"})
    corpus: list[str] = field(default_factory=list, metadata={
        "help": "text or chat JSONL files to train the tokenizer on"})
    vocab_size: int | None = field(default=None, metadata={
        "help": "target tokenizer vocabulary (default: 384 tiny, 1024 small)"})
    context_length: int | None = field(default=None, metadata={
        "help": "most tokens of prompt + response the model takes (default: 4096, both presets)"})
    seed: int = field(default=0, metadata={"help": "seed for weights"})
    force: bool = field(default=False, metadata={"help": "overwrite a non-empty directory"})

    def __post_init__(self) -> None:
        from .model_init import PRESETS, SPECIAL_TOKENS

        if self.preset not in PRESETS:
            raise SettingError(f"preset must be one of {sorted(PRESETS)}, got {self.preset!r}")
        minimum = len(SPECIAL_TOKENS) + 256
        if self.vocab_size is not None and self.vocab_size < minimum:
            raise SettingError(f"vocab_size must be at least {minimum} (256 bytes + special tokens)")
        if self.context_length is not None and self.context_length < 16:
            raise SettingError(f"context_length must be at least 16 tokens, got {self.context_length}")


SETTINGS = CommandSettings("model init", ModelInitSettings, "MODEL_INIT")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("model", help="create a model directory locally (no hub)")
    actions = parser.add_subparsers(dest="model_action", metavar="ACTION")
    init = actions.add_parser(
        "init",
        help="create a Qwen2-style HF model: config, random weights, BPE tokenizer, chat template",
    )
    SETTINGS.add_to(init)
    init.set_defaults(func=_init)
    parser.set_defaults(func=lambda args: (parser.print_help(), 2)[1])


def _init(settings: ModelInitSettings) -> int:
    from .model_init import CorpusError, create_model_dir

    try:
        out = create_model_dir(settings.dir, preset=settings.preset, corpus_files=settings.corpus,
                               vocab_size=settings.vocab_size, seed=settings.seed, overwrite=settings.force,
                               context_length=settings.context_length)
    except (CorpusError, FileExistsError) as exc:
        raise UserError(str(exc)) from exc
    print(f"created {out}")
    return 0

