"""Tool calls and reasoning with no flags: the format a model's chat template uses, duet's default format for a
template that has none, and the grammar that makes a forced call (tool_choice required or named) parse.

Every endpoint that takes tools uses the same functions (server/serving_chat.py wraps them for a request:
`encode_chat`, `plan_tools`, `ChoiceOutput`):

- `resolve_chat_format(tokenizer, template, tool_call_parser, reasoning_parser)`, once at start-up: the
  `ChatFormat` (ServingContext.chat_format): which tool-call and reasoning parsers run, and whether the
  template renders tools itself;
- `prepare_tool_messages(fmt, messages, tools)` before the chat template: the messages (and tools) to render;
- `tool_choice_grammar(fmt.tool_parser, tools, name, parallel)`: the constraint of a forced call, and
  `named_call_affixes` / `parse_forced_calls` to read the constrained output back;
- `make_tool_parser(fmt.tool_parser, tools)` (server/tool_parsers.py) for tool_choice auto.

Detection (`detect_tool_format`, `detect_reasoning_format`): the template is rendered with a probe function
and an assistant turn calling it; the text names the format: `<function=NAME>` inside `<tool_call>`
(qwen3_coder), `<tool_call>` (hermes: Qwen2.5, Qwen3, Hermes), `[TOOL_CALLS]` (mistral), `<|python_tag|>` or
a `{"name": ..., "parameters": ...}` call (llama3). A template that renders tools in none of these leaves
tool_choice auto answering in text (a warning names --tool-call-parser). Reasoning: a generation prompt that
ends inside `<think>` is deepseek-r1 (the output starts in the reasoning), a template that mentions `<think>`
otherwise is qwen3 (the model opens it itself).

The default format (`render_default_tools`), for a template that renders neither tools nor tool calls (the
default model's): hermes-style. The functions' JSON definitions go into the system message (after the
request's own system text, or as a system message of their own) with the instruction to answer a call as
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`; an assistant turn's `tool_calls` are
written as those blocks after its text; the results of `tool` messages go back as
`<tool_response>\\n...\\n</tool_response>` blocks in a user turn (consecutive results in one turn). The output
is read with the hermes parser, and a forced call is constrained to the same blocks.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from dataclasses import dataclass

from model_executor.sampling_params import GrammarSpec
from server.protocol import ApiError
from server.protocol_convert import check_grammar, grammar_error_reason, json_schema_spec
from server.tool_parsers import ParsedToolCall, calls_from_required, make_tool_parser, tool_call_schema

logger = logging.getLogger("duet.chat_tools")

# `--tool-call-parser none` / `--reasoning-parser none`: no detection, nothing parsed.
OFF = "none"
_PROBE = "duet_probe_function"
_PROBE_TOOL = {"type": "function", "function": {
    "name": _PROBE, "description": "Probe.",
    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}}}
# Nine alphanumerics: Mistral templates refuse other tool call ids.
_PROBE_CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "duetprobe", "type": "function", "function": {"name": _PROBE, "arguments": {"x": "y"}}}]}
_USER = {"role": "user", "content": "Hello"}


@dataclass(frozen=True)
class ChatFormat:
    """How chat requests with tools and reasoning are rendered and read (resolved once at start-up).

    tool_parser: the format tool calls are written and read in (server/tool_parsers.py), None: not read
    (tool_choice auto answers in text). tool_source: "flag", "template" (detected), "default" (the template
    renders no tools: duet's default format) or "unknown" (the template renders tools in a format not
    recognised). renders_tools: the template takes `tools` and assistant `tool_calls` itself; False: the
    messages carry them in the default format. reasoning_parser: server/reasoning_parser.py's kind or None;
    reasoning_source: "flag", "template" or "none"."""

    tool_parser: str | None = "hermes"
    tool_source: str = "default"
    renders_tools: bool = False
    reasoning_parser: str | None = None
    reasoning_source: str = "none"

    @property
    def reads_special_tokens(self) -> bool:
        """Whether replies are detokenized with their special tokens: the harmony format (gpt-oss) marks its
        channels and calls with them, and its parsers take them out of the content."""
        return "gpt-oss" in (self.tool_parser, self.reasoning_parser)

    def describe(self) -> list[str]:
        """The start-up log lines saying what was chosen and why."""
        tools = {
            "flag": f"tool calls: {self.tool_parser or 'not parsed'} (--tool-call-parser)",
            "template": f"tool calls: {self.tool_parser} format, detected from the chat template",
            "default": "tool calls: the chat template does not render tools; they are described in the system "
                       "message in duet's default format and calls are read as hermes <tool_call> blocks",
            "unknown": "tool calls: the chat template renders tools in a format duet does not recognise; "
                       "tool_choice auto answers in text (give --tool-call-parser to read calls)",
        }[self.tool_source]
        if self.tool_source == "flag" and not self.renders_tools and self.tool_parser is not None:
            tools += "; the chat template does not render tools: they are described in duet's default (hermes) format"
        reasoning = {
            "flag": f"reasoning: {self.reasoning_parser or 'not split'} (--reasoning-parser)",
            "template": f"reasoning: {self.reasoning_parser} format, detected from the chat template",
            "none": "reasoning: not split (the chat template has no <think>)",
        }[self.reasoning_source]
        return [tools, reasoning]


def _render(tokenizer, template: str | dict, messages: list[dict], **kwargs) -> str | None:
    """The template's text for messages, None if it refuses them. A dict of named templates (some tokenizers
    have one for tool use): the tokenizer picks, as it does for requests."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             chat_template=template if isinstance(template, str) else None, **kwargs)
    except Exception:  # noqa: BLE001 - a template that refuses the probe: the feature is not there
        return None


def template_renders_tools(tokenizer, template: str | dict | None) -> bool:
    """Whether the template writes the `tools` it is given into the prompt (the default model's drops them)."""
    if not template:
        return False
    with_tools = _render(tokenizer, template, [_USER], tools=[_PROBE_TOOL], add_generation_prompt=True)
    return with_tools is not None and _PROBE in with_tools


def detect_tool_format(tokenizer, template: str | dict | None) -> str | None:
    """The tool-call format (a TOOL_CALL_PARSERS name) a template renders tools and calls in, or None."""
    if not template:
        return None
    texts = [_render(tokenizer, template, [_USER], tools=[_PROBE_TOOL], add_generation_prompt=True),
             _render(tokenizer, template, [_USER, _PROBE_CALL], tools=[_PROBE_TOOL])]
    text = "\n".join(t for t in texts if t)
    if "<|channel|>" in text and f"to=functions.{_PROBE}" in text:
        return "gpt-oss"
    if f"<function={_PROBE}>" in text or ("<function=" in text and "<parameter=" in text):
        return "qwen3_coder"
    if "<tool_call>" in text:
        return "hermes"
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<|python_tag|>" in text or re.search(rf'"name":\s*"{_PROBE}",\s*"parameters"', text):
        return "llama3"
    return None


def detect_reasoning_format(tokenizer, template: str | dict | None) -> str | None:
    """deepseek-r1 when the generation prompt ends inside `<think>`, qwen3 when the template otherwise
    mentions `<think>`, else None."""
    if not template:
        return None
    source = template if isinstance(template, str) else "\n".join(str(t) for t in template.values())
    if "<|channel|>" in source and "analysis" in source:  # the harmony format (gpt-oss)
        return "gpt-oss"
    if "<think>" not in source:
        return None
    prompt = _render(tokenizer, template, [_USER], add_generation_prompt=True) or ""
    _, sep, tail = prompt.rpartition("<think>")
    if sep and "</think>" not in tail:
        return "deepseek-r1"
    return "qwen3"


def resolve_chat_format(tokenizer, template: str | dict | None, tool_call_parser: str | None,
                        reasoning_parser: str | None) -> ChatFormat:
    """The flags win (`none`: off); unset, each is detected from the template (see the module docstring)."""
    renders = template_renders_tools(tokenizer, template)
    if tool_call_parser is not None:
        parser, source = (None if tool_call_parser == OFF else tool_call_parser), "flag"
    elif not template:
        parser, source = None, "unknown"
    elif not renders:
        parser, source = "hermes", "default"
    else:
        parser = detect_tool_format(tokenizer, template)
        source = "template" if parser else "unknown"
    if reasoning_parser is not None:
        reasoning, r_source = (None if reasoning_parser == OFF else reasoning_parser), "flag"
    else:
        reasoning = detect_reasoning_format(tokenizer, template)
        r_source = "template" if reasoning else "none"
    return ChatFormat(parser, source, renders, reasoning, r_source)


def log_chat_format(fmt: ChatFormat) -> None:
    for line in fmt.describe():
        (logger.warning if "does not recognise" in line else logger.info)("%s", line)


# ---- the default format -----------------------------------------------------------------------------

DEFAULT_TOOLS_INSTRUCTIONS = """\
# Tools

You can call functions to help with the answer. Their definitions, as JSON, one per line:
<tools>
{tools}
</tools>

To call a function, answer with a JSON object holding its name and its arguments, inside <tool_call></tool_call> tags; use one such block per call:
<tool_call>
{{"name": "function name", "arguments": {{"argument name": "value"}}}}
</tool_call>
When no function is needed, answer in plain text."""


def default_tools_prompt(tools: list[dict]) -> str:
    """The system text describing tools (function definitions {"name", "description", "parameters"}) in the
    default format."""
    lines = "\n".join(json.dumps({"type": "function", "function": t}, ensure_ascii=False) for t in tools)
    return DEFAULT_TOOLS_INSTRUCTIONS.format(tools=lines)


def default_call_text(name: str, arguments) -> str:
    """One call as the default format writes it (arguments: an object, or JSON text)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def render_default_tools(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """The messages with tools, assistant tool calls and tool results written in the default format, for a
    template that renders none of them.

    messages: chat messages as dicts ({"role", "content"}, assistant "tool_calls" in OpenAI's shape with the
    arguments as an object or JSON text, tool "tool_call_id"); tools: function definitions or None. Returns
    new messages with only system, user and assistant roles and string contents."""
    out: list[dict] = []
    if tools:
        prompt = default_tools_prompt(tools)
        if messages and messages[0]["role"] == "system":
            first = dict(messages[0], content=f"{messages[0].get('content') or ''}\n\n{prompt}".lstrip("\n"))
            out.append(first)
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": prompt})
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        calls = m.get("tool_calls") or []
        m = {k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")}
        if calls:
            written = "\n".join(default_call_text(c["function"]["name"], c["function"].get("arguments"))
                                for c in calls)
            m["content"] = f"{m.get('content') or ''}\n{written}".lstrip("\n")
        out.append(m)
    return [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]


def prepare_tool_messages(fmt: ChatFormat, messages: list[dict],
                          tools: list[dict] | None) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) to give the chat template: unchanged when it renders tools itself, else the default
    format's messages and no tools."""
    if fmt.renders_tools:
        return messages, tools
    return render_default_tools(messages, tools), None


# ---- forced calls: tool_choice required or a named function --------------------------------------------


@dataclass(frozen=True)
class _CallSyntax:
    """How a format writes calls: each call is begin(name) + the arguments + end; several are separated by
    separator, all of them between open and close."""

    begin: str  # with {name}
    end: str
    separator: str
    open: str = ""
    close: str = ""
    style: str = "json"  # xgrammar's JSON-schema content style for the arguments


_SYNTAX = {
    "hermes": _CallSyntax('<tool_call>\n{{"name": "{name}", "arguments": ', "}\n</tool_call>", "\n"),
    "llama3": _CallSyntax('{{"name": "{name}", "parameters": ', "}", "; "),
    "mistral": _CallSyntax('{{"name": "{name}", "arguments": ', "}", ", ", open="[", close="]"),
    "qwen3_coder": _CallSyntax("<tool_call>\n<function={name}>\n", "\n</function>\n</tool_call>", "\n",
                               style="qwen_xml"),
}
MAX_ARGUMENT_WHITESPACE = 16  # (scheduler/grammar.py's MAX_JSON_WHITESPACE, for the same reason)


def _parameters(tool: dict) -> dict:
    return tool.get("parameters") or {"type": "object", "properties": {}}


def tool_choice_grammar(parser: str | None, tools: list[dict], name: str | None, parallel: bool) -> GrammarSpec:
    """The constraint of a forced call: name None for tool_choice required (one call or more, or exactly one
    when not parallel), else the named function's single call.

    In a known format (hermes, llama3, mistral, qwen3_coder) the output is the calls written as that format
    writes them, nothing else (an xgrammar structural tag, sent as EBNF), so the model is held to the syntax
    its prompt shows and the format's own parser reads it. Otherwise vLLM's JSON shapes: named, the arguments
    object; required, an array of {"name", "parameters"} objects."""
    if parser not in _SYNTAX:
        return json_schema_spec(tool_call_schema(tools, name, parallel), "tools")
    return _structural_grammar(parser, json.dumps(tools), name, parallel)  # (key order: the properties' order)


@functools.lru_cache(maxsize=256)  # an agent sends the same tools turn after turn
def _structural_grammar(parser: str, tools_json: str, name: str | None, parallel: bool) -> GrammarSpec:
    import xgrammar as xgr

    syntax, tools = _SYNTAX[parser], json.loads(tools_json)

    def tag(tool: dict) -> dict:
        return {"type": "tag", "begin": syntax.begin.format(name=tool["name"]), "end": syntax.end,
                "content": {"type": "json_schema", "json_schema": _parameters(tool), "style": syntax.style,
                            "max_whitespace_cnt": MAX_ARGUMENT_WHITESPACE}}

    if name is not None:
        fmt = tag(next(t for t in tools if t["name"] == name))
    else:
        fmt = {"type": "tags_with_separator", "tags": [tag(t) for t in tools], "separator": syntax.separator,
               "at_least_one": True, "stop_after_first": not parallel}
    if syntax.open:
        fmt = {"type": "sequence", "elements": [{"type": "const_string", "value": syntax.open}, fmt,
                                                {"type": "const_string", "value": syntax.close}]}
    try:
        grammar = xgr.Grammar.from_structural_tag({"type": "structural_tag", "format": fmt})
    except Exception as e:  # noqa: BLE001 - xgrammar refuses a schema it cannot do: the client's tools
        raise ApiError(400, "tools: a function's parameters cannot be enforced as a JSON schema: "
                            f"{grammar_error_reason(e)}", "tools") from None
    spec = GrammarSpec("ebnf", str(grammar))
    check_grammar(spec, "tools")
    return spec


def named_call_affixes(parser: str | None, name: str) -> tuple[str, str] | None:
    """(text before, text after) the arguments of a forced named call, whose arguments are JSON: streamed
    as they are written. None: the format's arguments are not JSON (qwen3_coder), read when complete."""
    syntax = _SYNTAX.get(parser)
    if syntax is None:
        return "", ""  # the output is the arguments object
    if syntax.style != "json":
        return None
    return syntax.open + syntax.begin.format(name=name), syntax.end + syntax.close


def parse_forced_calls(parser: str | None, text: str, tools: list[dict],
                       name: str | None) -> list[ParsedToolCall] | None:
    """The calls of a complete forced-call output (tool_choice_grammar's), or None when it does not parse
    (cut short by max_tokens)."""
    if name is not None:
        affixes = named_call_affixes(parser, name)
        if affixes is not None:
            head, tail = affixes
            if not text.startswith(head) or not text.endswith(tail) or len(text) < len(head) + len(tail):
                return None
            arguments = text[len(head):len(text) - len(tail)]
            try:
                json.loads(arguments)
            except json.JSONDecodeError:
                return None
            return [ParsedToolCall(name, arguments)]
    if parser not in _SYNTAX:
        return calls_from_required(text)
    _, calls = make_tool_parser(parser, tools).extract(text)
    return calls or None
