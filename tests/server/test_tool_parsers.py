"""Tool-call and reasoning parsers (pure Python): each format's calls, text that is not a call stays content,
streamed pieces give the same content and calls as the whole text, the tool_choice schemas, and the grammars
of forced calls (tool_choice required / named) in each format, read back by its parser."""

from __future__ import annotations

import json

import jsonschema
import pytest

from server.chat_tools import named_call_affixes, parse_forced_calls, tool_choice_grammar
from server.reasoning_parser import ReasoningStream, split_reasoning
from server.tool_parsers import ToolCallStream, calls_from_required, make_tool_parser, tool_call_schema

CASES = [
    ("hermes", ('Sure. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
                '<tool_call>{"name": "g", "arguments": {}}</tool_call>'), "Sure. ", [("f", {"a": 1}), ("g", {})]),
    ("hermes", "no calls here", "no calls here", []),
    ("hermes", "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ("llama3", ' {"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {"b": "x"}}', None,
     [("f", {"a": 1}), ("g", {"b": "x"})]),
    ("llama3", '<|python_tag|>{"name": "f", "parameters": {}}', None, [("f", {})]),
    ("llama3", "The answer is {1}", "The answer is {1}", []),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 2}}]', None, [("f", {"a": 2})]),
    ("mistral", '[{"name": "f", "arguments": {"a": 2}}, {"name": "g", "arguments": {}}]', None,
     [("f", {"a": 2}), ("g", {})]),
    ("mistral", "[1, 2] is a list", "[1, 2] is a list", []),
]


@pytest.mark.parametrize("parser,text,content,calls", CASES)
def test_parsers_whole_and_streamed(parser, text, content, calls):
    got_content, got_calls = make_tool_parser(parser).extract(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    # Streamed one character at a time: the content sent plus the final calls match.
    stream = ToolCallStream(make_tool_parser(parser))
    sent = "".join(stream.feed(ch) for ch in text)
    rest, streamed_calls = stream.finish()
    assert (sent + rest).strip() == (content or "").strip()
    assert [(c.name, c.arguments) for c in streamed_calls] == [(c.name, c.arguments) for c in got_calls]
    if calls:  # no part of a marker or a call leaks into the content
        assert "tool_call" not in sent and '"name"' not in sent


@pytest.mark.parametrize("kind,text,reasoning,content", [
    ("qwen3", "<think>\nplan</think>\n\nanswer", "\nplan", "answer"),
    ("qwen3", "just an answer", None, "just an answer"),
    ("deepseek-r1", "plan</think>answer", "plan", "answer"),
    ("deepseek-r1", "<think>plan</think>\nanswer", "plan", "answer"),
    ("deepseek-r1", "unfinished plan", "unfinished plan", ""),
])
def test_reasoning_split_whole_and_streamed(kind, text, reasoning, content):
    assert split_reasoning(kind, text) == (reasoning, content)
    s = ReasoningStream(kind)
    parts = [s.feed(ch) for ch in text] + [s.finish()]
    assert "".join(r for r, _ in parts) == (reasoning or "")
    assert "".join(c for _, c in parts) == content


TOOLS = [{"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}},
                                      "required": ["a"]}},
         {"name": "g"}]


def test_tool_choice_schemas():
    named = tool_call_schema(TOOLS, "f", parallel=True)
    jsonschema.validate({"a": 1}, named)
    required = tool_call_schema(TOOLS, None, parallel=False)
    jsonschema.validate([{"name": "f", "parameters": {"a": 1}}], required)
    for bad in ([], [{"name": "h", "parameters": {}}], [{"name": "f", "parameters": {"a": 1}}] * 2):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)
    calls = calls_from_required('[{"name": "f", "parameters": {"a": 1}}]')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"a": 1})]
    assert calls_from_required('{"name": "f"}') is None


WEATHER = [{"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}},
    "required": ["city", "days", "metric"]}},
           {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                                               "required": ["zone"]}}]
QWEN3_CODER_CALLS = ("Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
                     "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n</function>\n"
                     "</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=zone>\n123\n</parameter>\n"
                     "</function>\n</tool_call>")


def test_qwen3_coder_parser_types_values_by_the_schema():
    parser = make_tool_parser("qwen3_coder", WEATHER)
    content, calls = parser.extract(QWEN3_CODER_CALLS)
    assert content == "Let me look.\n"
    # A string parameter stays text even when it reads as a number; the others take the schema's type.
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "New York", "days": 3, "metric": True}), ("get_time", {"zone": "123"})]
    stream = ToolCallStream(make_tool_parser("qwen3_coder", WEATHER))
    sent = "".join(stream.feed(ch) for ch in QWEN3_CODER_CALLS)
    assert sent == "Let me look.\n" and [c.arguments for c in stream.finish()[1]] == [c.arguments for c in calls]
    broken = "<tool_call>\n<parameter=city>\nx\n</parameter>\n</tool_call>"  # no <function=...>
    assert parser.extract(broken) == (broken, [])


# One complete forced output per format: what each format's grammar must accept and its parser read.
FORCED = {
    "hermes": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2, "metric": true}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'),
    "llama3": ('{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2, "metric": true}}; '
               '{"name": "get_time", "parameters": {"zone": "UTC"}}'),
    "mistral": ('[{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2, "metric": true}}, '
                '{"name": "get_time", "arguments": {"zone": "UTC"}}]'),
    "qwen3_coder": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n2\n"
                    "</parameter>\n<parameter=metric>\ntrue\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
                    "<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n</function>\n</tool_call>"),
    None: '[{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2, "metric": true}}, '
          '{"name": "get_time", "parameters": {"zone": "UTC"}}]',
}
EXPECTED = [("get_weather", {"city": "Oslo", "days": 2, "metric": True}), ("get_time", {"zone": "UTC"})]


@pytest.fixture(scope="module")
def grammar_compiler(model_dir):
    import xgrammar as xgr

    from server.detokenizer import load_tokenizer

    tok = load_tokenizer(str(model_dir))
    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, stop_token_ids=[tok.eos_token_id]))


def _accepts(compiler, spec, text: str) -> bool:
    import xgrammar as xgr

    compiled = (compiler.compile_grammar(spec.value) if spec.kind == "ebnf"
                else compiler.compile_json_schema(spec.value, strict_mode=True))
    matcher = xgr.GrammarMatcher(compiled)
    return matcher.accept_string(text) and matcher.is_completed()  # the whole text, and a complete output


@pytest.mark.parametrize("parser", list(FORCED), ids=str)
def test_forced_calls_are_written_in_the_format_and_read_back(grammar_compiler, parser):
    """tool_choice required / named: the grammar admits the calls as the format writes them (and not free
    text), and parse_forced_calls reads what it admits."""
    text = FORCED[parser]
    required = tool_choice_grammar(parser, WEATHER, None, parallel=True)
    assert _accepts(grammar_compiler, required, text)
    assert not _accepts(grammar_compiler, required, "Sure! " + text)
    calls = parse_forced_calls(parser, text, WEATHER, None)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == EXPECTED
    single = tool_choice_grammar(parser, WEATHER, None, parallel=False)
    assert not _accepts(grammar_compiler, single, text)  # two calls where one is allowed
    # Named: one call of that function; its JSON arguments sit between fixed text (streamed as written).
    named = tool_choice_grammar(parser, WEATHER, "get_time", parallel=True)
    affixes = named_call_affixes(parser, "get_time")
    args = '{"zone": "UTC"}'
    one = (affixes[0] + args + affixes[1]) if affixes is not None else \
        "<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n</function>\n</tool_call>"
    assert _accepts(grammar_compiler, named, one)
    if parser is not None:  # (vLLM's named shape is the bare arguments object)
        assert not _accepts(grammar_compiler, named, one.replace("get_time", "get_weather"))
    [call] = parse_forced_calls(parser, one, WEATHER, "get_time")
    assert (call.name, json.loads(call.arguments)) == ("get_time", {"zone": "UTC"})
    assert parse_forced_calls(parser, one[:-3], WEATHER, "get_time") is None  # cut short: not a call


def test_named_call_streams_its_arguments_as_the_whole_reply():
    from server.chat_tools import ChatFormat
    from server.serving_chat import ChoiceOutput, ToolPlan

    head, tail = named_call_affixes("hermes", "get_time")
    text = head + '{"zone": "UTC"}' + tail

    def run(pieces):
        out = ChoiceOutput(ToolPlan("named", WEATHER, "get_time"), ChatFormat("hermes"))
        deltas = [out.feed(p) for p in pieces] + [out.finish()]
        return out, [c for d in deltas for c in d.get("tool_calls", [])]

    whole, _ = run([text])
    streamed, calls = run(list(text))
    assert whole.message() == {**streamed.message(), "tool_calls": whole.message()["tool_calls"]}
    assert "".join(c["function"]["arguments"] for c in calls) == '{"zone": "UTC"}'
    assert calls[0]["id"] == streamed.named_id and calls[0]["function"]["name"] == "get_time"
    assert sum("id" in c for c in calls) == 1 and "<" not in "".join(c["function"]["arguments"] for c in calls)
    cut, _ = run([text[:-5]])  # max_tokens: the arguments written so far, as OpenAI returns them
    assert cut.calls[0].arguments == '{"zone": "UTC"}'
    assert whole.finish_reason("stop") == "stop"


@pytest.mark.parametrize("plan,parser,pieces", [
    ("auto", "hermes", ["Hello <"]),  # "<" held back (a call may start there), released by the finish
    ("auto", "hermes", ["Hi", " there <"]),
    ("named", "hermes", None),  # the last chunk holds the arguments' end and the closing text
])
def test_last_chunk_streams_its_text_and_the_finish_both(plan, parser, pieces):
    """A chat stream's last engine chunk carries text and the finish: its deltas (serving_chat.chunk_deltas)
    send both, so the streamed reply equals the whole one."""
    from server.chat_tools import ChatFormat
    from server.serving_chat import ChoiceOutput, ToolPlan, chunk_deltas

    if plan == "named":
        head, tail = named_call_affixes(parser, "get_time")
        text = head + '{"zone": "UTC"}' + tail
        pieces = [text[:len(head) + 4], text[len(head) + 4:]]
    tool_plan = ToolPlan(plan, WEATHER, "get_time" if plan == "named" else None)
    whole = ChoiceOutput(tool_plan, ChatFormat(parser))
    whole.feed("".join(pieces))
    whole.finish()
    out = ChoiceOutput(tool_plan, ChatFormat(parser))
    deltas = [d for i, p in enumerate(pieces) for d in chunk_deltas(out, p, i == len(pieces) - 1)]
    assert "".join(d.get("content", "") for d in deltas) == whole.content
    arguments = "".join(c["function"]["arguments"] for d in deltas for c in d.get("tool_calls", []))
    assert arguments == "".join(c.arguments for c in whole.calls)
    assert (whole.content or arguments) and all(deltas)
