"""The chat template path of the TokenizerManager: --chat-template (file or text) replaces the model's,
chat_template_kwargs reach the template, tools are passed as {"type": "function", "function": ...}, the
arguments apply_chat_template reserves are refused with a 400 naming chat_template_kwargs, and
continue_final_message leaves the last turn open. server/chat_tools.py: the tool-call and reasoning formats
detected from a template (the flags win), and the default tool format of a template without tools."""

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


# ---- tool and reasoning formats: detected from the template, or duet's default format ----------------

_TURNS = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{% for c in m.tool_calls or [] %}"
          "{CALL}{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _template(tools_text: str, call: str) -> str:
    """A small template that writes the tools (when given) and the calls of assistant turns its own way."""
    return "{% if tools %}<|im_start|>system\n" + tools_text + "<|im_end|>\n{% endif %}" + _TURNS.replace("{CALL}", call)


TEMPLATES = {
    "hermes": _template("<tools>{{ tools | tojson }}</tools> answer with <tool_call></tool_call>",
                        '<tool_call>\n{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}'
                        "\n</tool_call>"),
    "llama3": _template("Use JSON. {{ tools | tojson }}",
                        '{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}'),
    "mistral": _template("[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]",
                         "[TOOL_CALLS][{{ c.function | tojson }}]"),
    "qwen3_coder": _template("<tools>{{ tools | tojson }}</tools>",
                             "<tool_call>\n<function={{ c.function.name }}>\n{% for k, v in c.function.arguments | "
                             "items %}<parameter={{ k }}>\n{{ v }}\n</parameter>\n{% endfor %}</function>\n</tool_call>"),
    None: _template("Functions: {{ tools | tojson }}", "CALL {{ c.function.name }}"),  # a format not known
}


@pytest.mark.parametrize("expected", list(TEMPLATES), ids=str)
def test_tool_format_is_detected_from_the_template(tokenizer, expected):
    from server.chat_tools import resolve_chat_format

    fmt = resolve_chat_format(tokenizer, TEMPLATES[expected], None, None)
    assert (fmt.tool_parser, fmt.renders_tools) == (expected, True)
    assert fmt.tool_source == ("template" if expected else "unknown")
    # The flags win; `none` turns tool-call parsing off.
    assert resolve_chat_format(tokenizer, TEMPLATES[expected], "llama3", None).tool_parser == "llama3"
    off = resolve_chat_format(tokenizer, TEMPLATES[expected], "none", None)
    assert (off.tool_parser, off.tool_source) == (None, "flag")


def test_a_template_without_tools_gets_the_default_format(tokenizer, model_dir):
    """The default model's template drops tools and writes an assistant tool-call turn as empty: duet then
    writes tools, calls and results into the messages itself (hermes-style), and reads calls as hermes."""
    from server.chat_tools import prepare_tool_messages, resolve_chat_format

    fmt = resolve_chat_format(tokenizer, tokenizer.chat_template, None, None)
    assert (fmt.tool_parser, fmt.tool_source, fmt.renders_tools) == ("hermes", "default", False)
    tools = [{"name": "get_weather", "description": "The weather",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "12 C"},
                {"role": "tool", "tool_call_id": "c2", "content": "sunny"}]
    plain = manager(tokenizer, None)
    assert plain.encode_chat(messages[:2], tools=tools) == plain.encode_chat(messages[:2])  # the template drops them
    rendered, template_tools = prepare_tool_messages(fmt, messages, tools)
    assert template_tools is None and [m["role"] for m in rendered] == ["system", "user", "assistant", "user"]
    text = tokenizer.decode(plain.encode_chat(rendered))
    assert "<|im_start|>system\nBe brief.\n\n# Tools\n" in text
    assert '{"type": "function", "function": {"name": "get_weather", "description": "The weather"' in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
            "</tool_call><|im_end|>") in text
    assert ("<|im_start|>user\n<tool_response>\n12 C\n</tool_response>\n<tool_response>\nsunny\n"
            "</tool_response><|im_end|>") in text
    # A template that renders tools gets the messages unchanged.
    native = resolve_chat_format(tokenizer, TEMPLATES["hermes"], None, None)
    assert prepare_tool_messages(native, messages, tools) == (messages, tools)


@pytest.mark.parametrize("template,expected", [
    (None, None),  # the default model's
    (("{% for m in messages %}{{ m.role }}: {% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>"
     "{% endif %}{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"), "qwen3"),
    (("{% for m in messages %}{{ m.role }}: {{ m.content.split('</think>')[-1] }}\n{% endfor %}"
     "{% if add_generation_prompt %}assistant: <think>\n{% endif %}"), "deepseek-r1"),
], ids=["no-think", "qwen3", "deepseek-r1"])
def test_reasoning_format_is_detected_from_the_template(tokenizer, template, expected):
    from server.chat_tools import resolve_chat_format

    fmt = resolve_chat_format(tokenizer, template or tokenizer.chat_template, None, None)
    assert (fmt.reasoning_parser, fmt.reasoning_source) == (expected, "template" if expected else "none")
    forced = resolve_chat_format(tokenizer, template or tokenizer.chat_template, None, "deepseek-r1")
    assert (forced.reasoning_parser, forced.reasoning_source) == ("deepseek-r1", "flag")
    assert resolve_chat_format(tokenizer, template or tokenizer.chat_template, None, "none").reasoning_parser is None


def test_continue_final_message_leaves_the_last_turn_open(tokenizer):
    tm = manager(tokenizer, None)
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello, I am"}]
    text = tokenizer.decode(tm.encode_chat(msgs, add_generation_prompt=False, continue_final_message=True))
    assert text.endswith("<|im_start|>assistant\nHello, I am")
    assert tokenizer.decode(tm.encode_chat(msgs, add_generation_prompt=False)).endswith("Hello, I am<|im_end|>\n")
