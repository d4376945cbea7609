"""``spanrl model init DIR``: create a small Hugging Face model directory locally.

Registered by ``spanrl/cli.py``; the work is done by ``model_init.create_model_dir``. Imports
nothing heavy at module level.
"""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("model", help="create a model directory locally (no hub)")
    actions = parser.add_subparsers(dest="model_action", metavar="ACTION")
    init = actions.add_parser(
        "init",
        help="create a Qwen2-style HF model: config, random weights, BPE tokenizer, chat template",
    )
    init.add_argument("dir", help="output directory (created; must be empty unless --force)")
    init.add_argument("--preset", choices=["tiny", "small"], default="tiny",
                      help="tiny: 2 layers, hidden 128 (~0.5 M params); small: 4 layers, hidden 256")
    init.add_argument("--corpus", action="append", default=[], metavar="FILE",
                      help="text or chat JSONL file to train the tokenizer on (repeatable)")
    init.add_argument("--vocab-size", type=int, default=None,
                      help="target tokenizer vocabulary (default: 384 tiny, 1024 small)")
    init.add_argument("--seed", type=int, default=0, help="seed for weights (default 0)")
    init.add_argument("--force", action="store_true", help="overwrite a non-empty directory")
    init.set_defaults(func=_init)
    parser.set_defaults(func=lambda args: (parser.print_help(), 2)[1])


def _init(args: argparse.Namespace) -> int:
    from spanrl.trainer_bridge.torch_backend.model_init import PRESETS, CorpusError, create_model_dir

    print(f"spanrl model init: dir={args.dir} preset={args.preset} corpus={args.corpus} "
          f"vocab_size={args.vocab_size or PRESETS[args.preset].vocab_size} seed={args.seed}")
    try:
        out = create_model_dir(args.dir, preset=args.preset, corpus_files=args.corpus,
                               vocab_size=args.vocab_size, seed=args.seed, overwrite=args.force)
    except (CorpusError, FileExistsError, ValueError) as exc:
        print(f"error: {exc}")
        return 2
    print(f"created {out}")
    return 0
