"""Create a small Hugging Face causal LM from scratch, locally: config, weights, tokenizer.

Called by ``spanrl model init`` (``model_cli.py``) and by tests and the demo. No model hub:
the byte-level BPE tokenizer is trained here with the ``tokenizers`` library on the corpus
files given plus a small built-in text, and the weights are randomly initialised.

The model is a Qwen2-style decoder (``model_type: qwen2``) so vLLM and transformers load it
as they load Qwen. transformers 5 rebuilds the tokenizer of a ``qwen2`` model as
``Qwen2Tokenizer`` with Qwen's own normaliser and pre-tokenizer, whatever ``tokenizer.json``
says. So we build our tokenizer with exactly that pipeline (NFC, Qwen's split regex, which
already isolates every digit, then byte-level): both loading paths (``AutoTokenizer`` and
``PreTrainedTokenizerFast(tokenizer_file=...)``) then encode identically.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)

# Qwen2's pre-tokenizer regex (transformers/models/qwen2/tokenization_qwen2.py). ``\p{N}``
# on its own makes every digit a separate pre-token, so digits are single tokens.
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# How the functions a request offers (``tools``) open the system prompt, in the form Qwen-family
# templates use: one JSON object per tool between <tools> tags, and how to call one.
TOOLS_INTRO = "# Tools\n\nYou may call the functions below; their signatures are inside <tools></tools>:\n<tools>"
TOOLS_OUTRO = ("\n</tools>\n\nTo call a function, write its name and arguments as a JSON object inside "
               "<tool_call></tool_call> tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
               "<args-json-object>}\n</tool_call>")

# ChatML, as Qwen writes it: ``<|im_start|>role\ncontent<|im_end|>\n`` per message. With tools (as
# Qwen2.5/Qwen3 templates do): the tools block joins the system message; an assistant message's
# ``tool_calls`` follow its content as ``<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>``
# (``arguments`` written verbatim when it is a JSON string, so a call the server returned renders
# back exactly as sampled); consecutive ``tool`` messages form one user turn of
# ``<tool_response>`` blocks. ``chat_format.render_chatml`` renders the same text in Python.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(system_done=false) %}"
    "{%- macro text(message) %}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- elif message['content'] is not none and message['content'] is defined %}"
    "{{- message['content'] | map(attribute='text') | join('') }}"
    "{%- endif %}"
    "{%- endmacro %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- text(messages[0]) + '\\n\\n' }}"
    "{%- set ns.system_done = true %}{%- endif %}"
    "{{- " + repr(TOOLS_INTRO) + " }}"  # a Python literal is a jinja one
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- " + repr(TOOLS_OUTRO) + " + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- set content = text(message) %}"
    "{%- if loop.first and ns.system_done %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant\\n' + content }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- if call['function'] is defined %}{%- set call = call['function'] %}{%- endif %}"
    "{%- if content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": ' + (call['name'] | tojson) + ', \"arguments\": ' }}"
    "{%- if call['arguments'] is string %}{{- call['arguments'] }}"
    "{%- else %}{{- call['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class ModelPreset:
    """Sizes of one preset; ``vocab_size`` is the tokenizer's target (BPE may stop earlier)."""

    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int
    vocab_size: int


# Both presets take 4,096 tokens of context: a tool-using agent's prompt (instructions, tool
# schemas, history) is often past 1,300 tokens. The context costs nothing until a prompt uses it
# (RoPE positions are computed, not stored); what a long prompt costs is in docs/policy.md.
DEFAULT_CONTEXT = 4096
PRESETS: dict[str, ModelPreset] = {
    # ~0.5 M parameters: trains in minutes on 2 CPU cores (2-digit arithmetic copying).
    "tiny": ModelPreset(2, 128, 4, 4, 512, DEFAULT_CONTEXT, 384),
    # ~3 M parameters: 4 layers, for 3-digit operands and longer texts.
    "small": ModelPreset(4, 256, 4, 4, 1024, DEFAULT_CONTEXT, 1024),
}

# A little built-in text so the tokenizer knows common English, chat roles and arithmetic
# even when no corpus is given.
BUILTIN_CORPUS = [
    "You are a helpful assistant.",
    "system", "user", "assistant", "tool",
    "What is 37 + 45? Use the calculator when it helps.",
    "CALC 37+45", "RESULT 82", "ANSWER 82",
    "The quick brown fox jumps over the lazy dog.",
    "Question: what is the answer? Answer: the answer is 42.",
    "Let me think step by step. First, add the tens, then the ones.",
    "Sure, here is the result you asked for.",
    "Hello! How can I help you today?",
    "The function returned an error, please try again.",
    '{"name": "calculator", "arguments": {"expression": "12*7"}}',
]


class CorpusError(ValueError):
    """A corpus file cannot be read as plain text or chat JSONL."""


def _texts_from_chat_record(record: object) -> Iterator[str]:
    if isinstance(record, dict):
        messages = record.get("messages")
        if isinstance(messages, list):
            for message in messages:
                if isinstance(message, dict):
                    if isinstance(message.get("role"), str):
                        yield message["role"]
                    content = message.get("content")
                    if isinstance(content, str):
                        yield content
                    elif isinstance(content, list):
                        for part in content:
                            if isinstance(part, dict) and isinstance(part.get("text"), str):
                                yield part["text"]
                    yield from _tool_call_texts(message.get("tool_calls"))
            for tool in record.get("tools") or ():
                yield json.dumps(tool, ensure_ascii=False)
            return
        for key in ("text", "prompt", "completion", "question", "answer"):
            if isinstance(record.get(key), str):
                yield record[key]


def _tool_call_texts(calls: object) -> Iterator[str]:
    """A demonstration's tool calls as the chat template writes them (so the tokenizer learns
    ``<tool_call>`` and the JSON around the arguments)."""
    for call in calls if isinstance(calls, list) else ():
        function = call.get("function", call) if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            arguments = function.get("arguments")
            written = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
            name = json.dumps(function["name"], ensure_ascii=False)
            yield f'<tool_call>\n{{"name": {name}, "arguments": {written}}}\n</tool_call>'
    if calls:
        yield "<tool_response>\n</tool_response>"


def iter_corpus_texts(path: str | Path) -> Iterator[str]:
    """Texts of a corpus file: chat JSONL (``{"messages": [...]}`` per line) or plain text.

    A ``.jsonl``/``.json`` file is read line by line as JSON; a line that is not JSON is used
    as plain text (so a mixed file loses nothing). Any other file is plain text, one line a text.
    """
    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"corpus file {str(path)!r} does not exist or is not a file")
    as_json = path.suffix.lower() in (".jsonl", ".json")
    with path.open(encoding="utf-8", errors="replace") as handle:
        for line in handle:
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if as_json:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    yield line
                    continue
                yield from _texts_from_chat_record(record)
            else:
                yield line


def build_tokenizer(corpus_texts: Iterable[str], vocab_size: int):
    """Train a byte-level BPE ``tokenizers.Tokenizer`` with Qwen2's pre-tokenization.

    Special tokens get the first ids: ``<|endoftext|>`` (pad) = 0, ``<|im_start|>`` = 1,
    ``<|im_end|>`` = 2 (end of sequence). The 256 byte symbols are always in the vocabulary,
    so any text encodes.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    minimum = len(SPECIAL_TOKENS) + 256
    if vocab_size < minimum:
        raise ValueError(f"--vocab-size must be at least {minimum} (256 bytes + special tokens)")
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_texts, trainer=trainer)
    return tokenizer


def _tokenizer_config(model_max_length: int) -> dict:
    added = {}
    for index, token in enumerate(SPECIAL_TOKENS):
        added[str(index)] = {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
    return {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": model_max_length,
        "split_special_tokens": False,
        "chat_template": CHAT_TEMPLATE,
    }


def create_model_dir(
    out_dir: str | Path,
    preset: str = "tiny",
    corpus_files: Iterable[str | Path] = (),
    vocab_size: int | None = None,
    seed: int = 0,
    overwrite: bool = False,
    context_length: int | None = None,
) -> Path:
    """Write a complete HF model directory to ``out_dir`` and return its path. ``context_length``
    (default: the preset's, 4,096) is the most tokens of prompt + response the model takes.

    Files: ``config.json``, ``generation_config.json``, ``model.safetensors``,
    ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``,
    ``chat_template.jinja``.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    sizes = PRESETS[preset]
    context = int(context_length or sizes.max_position_embeddings)
    if context < 16:
        raise ValueError(f"context_length must be at least 16 tokens, got {context}")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty (pass overwrite=True / --force)")
    out.mkdir(parents=True, exist_ok=True)

    tokenizer, ids = _write_tokenizer_files(out, corpus_files, vocab_size or sizes.vocab_size, seed, context)
    config = _write_model_weights(out, sizes, context, tokenizer.get_vocab_size(), ids, seed)
    logger.info("wrote %s: preset %s, vocabulary %d", out, preset, config.vocab_size)
    return out


def _write_tokenizer_files(out: Path, corpus_files: Iterable[str | Path], vocab_size: int, seed: int,
                           context: int) -> tuple[Any, dict[str, int]]:
    """Train the BPE tokenizer on the corpus (shuffled by ``seed``) plus the built-in texts and write
    it with its config, special-token map and chat template; returns it and the special tokens' ids."""
    texts: list[str] = []
    for corpus in corpus_files:
        texts.extend(iter_corpus_texts(corpus))
    logger.info("training a BPE tokenizer on %d corpus texts + %d built-in", len(texts), len(BUILTIN_CORPUS))
    random.Random(seed).shuffle(texts)
    tokenizer = build_tokenizer(texts + BUILTIN_CORPUS, vocab_size)
    tokenizer.save(str(out / "tokenizer.json"))
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    (out / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(context), indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": IM_END, "pad_token": PAD_TOKEN,
                    "additional_special_tokens": [IM_START, IM_END]}, indent=2) + "\n"
    )
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return tokenizer, ids


def _write_model_weights(out: Path, sizes: Any, context: int, vocab_size: int, ids: dict[str, int],
                         seed: int) -> Any:
    """A freshly initialised Qwen2 model of ``sizes`` (seeded) saved with its generation config."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    legacy: dict[str, Any] = {"rope_theta": 10000.0, "torch_dtype": "float32"}  # read from **kwargs
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=sizes.hidden_size,
        intermediate_size=sizes.intermediate_size,
        num_hidden_layers=sizes.num_hidden_layers,
        num_attention_heads=sizes.num_attention_heads,
        num_key_value_heads=sizes.num_key_value_heads,
        max_position_embeddings=context,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        bos_token_id=None,
        eos_token_id=ids[IM_END],
        pad_token_id=ids[PAD_TOKEN],
        **legacy,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=[ids[IM_END], ids[PAD_TOKEN]], pad_token_id=ids[PAD_TOKEN],
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
    )
    model.save_pretrained(out)
    logger.info("%d parameters", sum(p.numel() for p in model.parameters()))
    return config
