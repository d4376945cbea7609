"""`spanrl model init`: a real HF model directory whose tokenizer loads the same both ways."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from spanrl.cli import main as spanrl_main

TEXTS = [
    "CALC 37+45",
    "RESULT 82\nANSWER 82",
    "  leading spaces, tabs\tand\n\nnewlines  ",
    "unicode: héllo wörld — 你好 🙂",
    "<|im_start|>user\nWhat is 12345 * 6789?<|im_end|>\n",
    "don't I'll we've 1.5e-3 {\"json\": [1, 2]}",
]


def test_cli_creates_a_loadable_qwen2_directory(tmp_path, calc_corpus):
    out = tmp_path / "m"
    assert spanrl_main(["model", "init", str(out), "--preset", "tiny", "--corpus", str(calc_corpus),
                        "--seed", "3"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen2"
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]) == (2, 128, 4)
    model = AutoModelForCausalLM.from_pretrained(out)
    parameters = sum(p.numel() for p in model.parameters())
    assert 300_000 < parameters < 800_000
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert 300 <= len(tokenizer) <= 512
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert model.config.eos_token_id == tokenizer.eos_token_id
    # a second init into the same, non-empty directory is refused without --force
    assert spanrl_main(["model", "init", str(out)]) == 2


def test_both_loading_paths_encode_identically_and_round_trip(tiny_model_dir):
    auto = AutoTokenizer.from_pretrained(tiny_model_dir)
    fast = PreTrainedTokenizerFast(tokenizer_file=str(tiny_model_dir / "tokenizer.json"))
    for text in TEXTS:
        ids = auto.encode(text, add_special_tokens=False)
        assert ids == fast.encode(text, add_special_tokens=False), text
        assert auto.decode(ids) == text


def test_digits_are_single_tokens_and_corpus_words_are_merged(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tokenizer.encode("1234567890", add_special_tokens=False)
    assert len(ids) == 10
    # "ANSWER" and "RESULT" appear hundreds of times in the corpus: BPE merged them
    assert len(tokenizer.encode("ANSWER", add_special_tokens=False)) <= 2
    assert len(tokenizer.encode("RESULT", add_special_tokens=False)) <= 2


def test_chat_template_turn_is_a_prefix_of_the_next_prompt(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

    def prompt_ids(messages):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 37 + 45?"}]
    first = prompt_ids(messages)
    assert tokenizer.decode(first).endswith("<|im_start|>assistant\n")
    reply = "CALC 37+45"
    response = tokenizer.encode(reply, add_special_tokens=False) + [tokenizer.eos_token_id]
    following = prompt_ids(messages + [{"role": "assistant", "content": reply},
                                       {"role": "user", "content": "RESULT 82"}])
    assert following[: len(first) + len(response)] == first + response
    assert len(following) > len(first) + len(response)


def test_small_preset_and_bad_input(tmp_path):
    from spanrl.trainer_bridge.torch_backend.model_init import CorpusError, create_model_dir

    out = create_model_dir(tmp_path / "s", preset="small", vocab_size=400)
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 4 and config["hidden_size"] == 256
    model = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        assert model(torch.tensor([[1, 2, 3]])).logits.shape[-1] == config["vocab_size"]
    with pytest.raises(CorpusError, match="does not exist"):
        create_model_dir(tmp_path / "x", corpus_files=[tmp_path / "missing.txt"])
    with pytest.raises(ValueError, match="unknown preset"):
        create_model_dir(tmp_path / "y", preset="huge")
