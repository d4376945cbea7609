"""The re-tokenizer renders a chat template in Jinja's immutable sandbox: a template that reaches
for Python internals or changes the messages it reads is stopped, and that call is reported as
not re-tokenized (a problem of the rollout), never run and never a crash of assembly."""

from __future__ import annotations

import json

import pytest

from spanrl.otlp_receiver.retokenize import RetokenizeError, Retokenizer

MESSAGES = [{"role": "user", "content": "what is 2 + 2 ?"}]


def tokenizer_dir(tmp_path, template: str):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<|user|>": 1, "<|assistant|>": 2, "what": 3, "is": 4, "2": 5, "+": 6, "?": 7}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return Retokenizer(str(tmp_path))


def test_an_ordinary_template_renders(tmp_path):
    retokenizer = tokenizer_dir(tmp_path, "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
                                          "{% endfor %}<|assistant|>")
    assert retokenizer.render_prompt(MESSAGES) == "<|user|> what is 2 + 2 ? <|assistant|>"


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",  # the classic way out to Python's internals
    "{{ messages.__class__.__init__.__globals__ }}",
    "{{ messages.append({'role': 'user', 'content': 'injected'}) }}{{ messages }}",  # mutates its input
    "{{ messages[0].update({'content': 'changed'}) }}",
])
def test_a_template_reaching_beyond_rendering_is_stopped(tmp_path, template):
    retokenizer = tokenizer_dir(tmp_path, template)
    messages = [dict(m) for m in MESSAGES]
    with pytest.raises(RetokenizeError, match="chat template error: SecurityError"):
        retokenizer.render_prompt(messages)
    assert messages == MESSAGES  # nothing was changed
