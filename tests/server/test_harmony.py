"""The harmony format (gpt-oss): the gpt-oss reasoning parser splits the analysis channel from the answer and
passes messages to functions on to the gpt-oss tool-call parser, whole and streamed one character at a time
alike; a harmony chat template is detected as both; such replies are detokenized with their special tokens."""

from __future__ import annotations

import json

import pytest

from server.chat_tools import ChatFormat, detect_reasoning_format, detect_tool_format, template_renders_tools
from server.reasoning_parser import make_reasoning_stream, split_reasoning
from server.tool_parsers import ToolCallStream, make_tool_parser

ANALYSIS = "<|channel|>analysis<|message|>Need the weather first.<|end|>"
CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'


@pytest.mark.parametrize("text,reasoning,content,calls", [
    (ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is 4.", "Need the weather first.", "It is 4.", []),
    (ANALYSIS + CALL, "Need the weather first.", "", [("get_weather", {"city": "Paris"})]),
    # the recipient before the channel; two calls
    (('<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{"a": 1}<|call|>'
      '<|start|>assistant to=functions.g<|channel|>commentary json<|message|>{}<|call|>'), "", "",
     [("f", {"a": 1}), ("g", {})]),
    ("plain text, no harmony", "", "plain text, no harmony", []),
    ("<|channel|>analysis<|message|>cut short", "cut short", "", []),  # (max_tokens inside the reasoning)
])
def test_reasoning_and_calls_whole_and_streamed(text, reasoning, content, calls):
    for pieces in ([text], list(text)):
        stream = make_reasoning_stream("gpt-oss")
        tools = ToolCallStream(make_tool_parser("gpt-oss"))
        got_reasoning = got_content = ""
        for part in pieces:
            r, c = stream.feed(part)
            got_reasoning += r
            got_content += tools.feed(c) if c else ""
        r, c = stream.finish()
        got_reasoning += r
        got_content += tools.feed(c) if c else ""
        rest, got_calls = tools.finish()
        got_content += rest
        assert got_reasoning == reasoning
        assert got_content == content
        assert [(x.name, json.loads(x.arguments)) for x in got_calls] == calls
        assert "<|" not in got_content  # no markup leaks into the answer
    assert split_reasoning("gpt-oss", ANALYSIS) == ("Need the weather first.", "")


HARMONY_TEMPLATE = (
    "{#- the harmony format: analysis, commentary and final channels -#}"
    "{% if tools %}<|start|>developer<|message|>{% for t in tools %}type {{ t.function.name }} = () => any;"
    "{% endfor %}<|end|>{% endif %}"
    "{% for m in messages %}{% if m.tool_calls %}<|start|>assistant to=functions.{{ m.tool_calls[0].function.name }}"
    "<|channel|>commentary json<|message|>{{ m.tool_calls[0].function.arguments | tojson }}<|call|>"
    "{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")


def test_harmony_template_is_detected_and_reads_special_tokens(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    assert template_renders_tools(tok, HARMONY_TEMPLATE)
    assert detect_tool_format(tok, HARMONY_TEMPLATE) == "gpt-oss"
    assert detect_reasoning_format(tok, HARMONY_TEMPLATE) == "gpt-oss"
    assert ChatFormat("gpt-oss", "template", True, "gpt-oss", "template").reads_special_tokens
    assert not ChatFormat().reads_special_tokens
    assert not ChatFormat("hermes", "template", True, "qwen3", "template").reads_special_tokens


def test_server_detokenizes_with_special_tokens_for_the_gpt_oss_parser():
    """With the gpt-oss tool-call parser a chat reply keeps its special tokens (a logit bias forces one; the
    parser takes only harmony's markers out), where the default drops them."""
    import httpx

    from server.detokenizer import load_tokenizer
    from tests.fake_scheduler import ServerProcess

    for flags, expected in ((("--tool-call-parser", "gpt-oss"), "<|im_start|>" * 3), ((), "")):
        srv = ServerProcess(*flags).wait_healthy()
        try:
            special = load_tokenizer(str(srv.model_dir)).convert_tokens_to_ids("<|im_start|>")
            model = httpx.get(f"{srv.url}/v1/models", timeout=10).json()["data"][0]["id"]
            body = {"model": model, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
                    "logit_bias": {str(special): 100}, "messages": [{"role": "user", "content": "hi"}]}
            r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=30)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == expected
        finally:
            srv.stop()
