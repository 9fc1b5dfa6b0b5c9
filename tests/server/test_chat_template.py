"""The chat template path of the TokenizerManager: --chat-template (file or text) replaces the model's,
chat_template_kwargs reach the template, tools are passed as {"type": "function", "function": ...}, and the
arguments apply_chat_template reserves are refused with a 400 naming chat_template_kwargs."""

from __future__ import annotations

import pytest

from server.metrics import ServerMetrics
from server.protocol import ApiError
from server.tokenizer_manager import TokenizerManager, load_chat_template

TEMPLATE = ("{{ messages[0]['content'] }}|{{ flag | default('off') }}|"
            "{% for t in tools or [] %}{{ t.type }}:{{ t.function.name }};{% endfor %}")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def manager(tokenizer, template: str | None) -> TokenizerManager:
    return TokenizerManager(tokenizer, ipc=None, info={"context_len": 512, "num_kv_slots": 1000},
                            metrics=ServerMetrics(), chat_template=template)


def test_template_override_kwargs_and_tools(tokenizer, tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE == load_chat_template(TEMPLATE)
    tm = manager(tokenizer, load_chat_template(str(path)))
    msgs = [{"role": "user", "content": "hello"}]
    assert tokenizer.decode(tm.encode_chat(msgs)) == "hello|off|"
    ids = tm.encode_chat(msgs, tools=[{"name": "f"}, {"name": "g"}], template_kwargs={"flag": "on"})
    assert tokenizer.decode(ids) == "hello|on|function:f;function:g;"
    # Without the override, the model's own template renders (its system prompt and role markers).
    assert "hello|" not in tokenizer.decode(manager(tokenizer, None).encode_chat(msgs))


@pytest.mark.parametrize("key", ["tokenize", "messages", "chat_template"])
def test_reserved_template_kwargs_are_a_400(tokenizer, key):
    with pytest.raises(ApiError) as e:
        manager(tokenizer, TEMPLATE).encode_chat([{"role": "user", "content": "x"}], template_kwargs={key: 1})
    assert e.value.param == "chat_template_kwargs" and key in e.value.message
